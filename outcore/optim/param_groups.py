"""torch-style parameter groups for ``outcore.initialize(model, cfg, param_groups=...)``.

The engine's optimizer takes groups as ``torch.optim`` does: dicts with ``"params"`` and any
hyper-parameter that overrides the config's optimizer for that group (no weight decay on
biases, another learning rate for a head). They are checked before anything is sharded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from outcore.errors import ConfigError

HP_KEYS = ("lr", "betas", "eps", "weight_decay", "momentum", "nesterov")
"""The hyper-parameters a group may set (the engine's optimizer's ``defaults``)."""

# keys torch's Adam, AdamW and SGD keep in their groups, with the values outcore's kernels
# match (None: any value, e.g. foreach/fused, which outcore picks itself)
_TORCH_KEYS = {"foreach": None, "fused": None, "capturable": False, "differentiable": False,
               "maximize": False, "amsgrad": False, "dampening": 0, "initial_lr": None,
               "decoupled_weight_decay": None, "clip_threshold": None, "decay_rate": None,
               "beta1": None, "scale_parameter": None, "relative_step": None,
               "warmup_init": None,
               # what torch's schedulers keep in a group they drive (OneCycleLR, CyclicLR,
               # SWALR), made before or after initialize
               "max_lr": None, "min_lr": None, "base_momentum": None, "max_momentum": None,
               "swa_lr": None}
_TORCH_TYPES = {("torch.optim", "AdamW"): "adamw", ("torch.optim", "Adam"): "adam",
                ("torch.optim", "SGD"): "sgd",
                ("transformers.optimization", "Adafactor"): "adafactor"}


def from_torch_optimizer(opt: torch.optim.Optimizer) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the optimizer config keys, the group dicts) of a torch optimizer outcore adopts.

    [Note: adopting a torch optimizer]
    A user (or the Trainer's ``optimizers=``) may bring a ``torch.optim.AdamW``, ``Adam`` or
    ``SGD``, or transformers' ``Adafactor`` (adafactor.py), built over the model's parameters.
    outcore runs the same update with the same kernels over its shards, so it takes the type
    and hyper-parameters from it and uses its
    ``param_groups`` dicts themselves as the engine's groups: a scheduler bound to the user's
    optimizer edits the dicts the shards' update reads. The user's optimizer is never stepped;
    any state it holds (a loaded state dict) is cut into the shards' moments.
    """
    module = type(opt).__module__
    kind = next((k for (where, name), k in _TORCH_TYPES.items()
                 if module.startswith(where) and type(opt).__name__ == name), None)
    if kind is None:
        raise ConfigError(f"optimizer {module}.{type(opt).__name__} cannot run over outcore's "
                          "shards; outcore runs torch's AdamW, Adam and SGD and transformers' "
                          "Adafactor (pass one of those, or set the optimizer in the config)")
    if kind == "adam" and opt.defaults.get("decoupled_weight_decay"):
        kind = "adamw"
    if kind == "adafactor":  # its numbers stay in its groups (lr may be None)
        return {"type": kind}, opt.param_groups
    keys = {"type": kind, **{k: opt.defaults[k] for k in HP_KEYS if k in opt.defaults}}
    if "betas" in keys:
        keys["betas"] = list(keys["betas"])
    return keys, opt.param_groups


def check_param_groups(module: nn.Module, param_groups: Iterable[dict[str, Any]] | None
                        ) -> list[tuple[dict[str, Any], list[nn.Parameter]]] | None:
    """Validate torch-style param groups before anything is sharded (a typo must not
    leave the model half converted); returns (the group dict, parameters) per group."""
    if param_groups is None:
        return None
    names = {id(p): n for n, p in module.named_parameters()}
    out, seen = [], set()
    for i, spec in enumerate(param_groups):
        unknown = set(spec) - {"params", *HP_KEYS, *_TORCH_KEYS}
        if unknown:
            raise ConfigError(f"param_groups[{i}]: unknown keys {sorted(unknown)}; "
                              f"allowed: params, {', '.join(HP_KEYS)}")
        _check_torch_keys(f"param_groups[{i}]", spec)
        params = list(spec.get("params", []))
        for p in params:
            if id(p) not in names:
                raise ConfigError(f"param_groups[{i}] holds a tensor that is not a "
                                  "parameter of this model")
            if id(p) in seen:
                raise ConfigError(f"parameter {names[id(p)]} appears in two param groups")
            seen.add(id(p))
        out.append((spec, params))
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ConfigError(f"trainable parameters in no param group: {missing[:5]}")
    return out


def check_loaded_group(i: int, saved: dict[str, Any]) -> None:
    """A saved param group ``load_state_dict`` takes: its torch keys at the values outcore's
    kernels match and its numbers numbers, as ``initialize`` checks them, so a refused load
    changes nothing and a taken one steps."""
    _check_torch_keys(f"optimizer state_dict's param group {i}", saved)
    for key in ("lr", "weight_decay", "momentum"):  # (Adafactor's eps is a pair)
        value = saved.get(key)
        if value is not None and not isinstance(value, (int, float, torch.Tensor)):
            raise ConfigError(f"optimizer state_dict's param group {i}: {key}={value!r} is "
                              "not a number")


def _check_torch_keys(where: str, group: dict[str, Any]) -> None:
    """torch's own group keys at the values outcore's kernels match (``_TORCH_KEYS``)."""
    for key, neutral in _TORCH_KEYS.items():
        if key in group and neutral is not None and group[key] != neutral:
            raise ConfigError(f"{where}: {key}={group[key]!r} is not supported; outcore's "
                              f"kernels run with {key}={neutral!r}")
