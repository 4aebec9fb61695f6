"""torch-style parameter groups for ``outcore.initialize(model, cfg, param_groups=...)``.

The engine's optimizer takes groups as ``torch.optim`` does: dicts with ``"params"`` and any
hyper-parameter that overrides the config's optimizer for that group (no weight decay on
biases, another learning rate for a head). They are checked before anything is sharded.
"""

from __future__ import annotations

import difflib
import math
import numbers
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from outcore.errors import ConfigError, user_stacklevel
from outcore.optim import adafactor
from outcore.runtime.plan import optimizer_state_kinds
from outcore.runtime.same_config import digest_of

if TYPE_CHECKING:
    from outcore.zero.param import ShardedParam

_Groups = TypeVar("_Groups", bound="list[tuple[dict[str, Any], list[ShardedParam]]]")

HP_KEYS = ("lr", "betas", "eps", "weight_decay", "momentum", "nesterov")
"""The hyper-parameters a group may set (the engine's optimizer's ``defaults``)."""

_KEYS_OF_TYPE = {"adam": ("lr", "betas", "eps", "weight_decay"),
                 "adamw": ("lr", "betas", "eps", "weight_decay"),
                 "sgd": ("lr", "weight_decay", "momentum", "nesterov")}


_COMPARED = (*HP_KEYS, *(k for k in adafactor.DEFAULTS if k not in HP_KEYS))
"""What a group sets that an update reads, and so must be alike on every rank: the
hyper-parameters, and Adafactor's own keys (its runner reads every key of its group)."""


def hp_keys(kind: str) -> tuple[str, ...]:
    """The hyper-parameters the optimizer ``kind`` of the config runs with: its ``defaults``
    and what its groups are completed with. Only its own, as torch's optimizers have: torch's
    ``CyclicLR`` and ``OneCycleLR`` cycle ``betas`` wherever the defaults hold them, so an
    SGD whose defaults also held Adam's ``betas`` had its ``momentum`` left alone, and trained
    other weights than torch's SGD without a word (Adafactor's groups are completed by its
    own runner: every key)."""
    return _KEYS_OF_TYPE.get(kind, HP_KEYS)

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
# what torch's own optimizers of each type keep in a group beyond the hyper-parameters, at
# the values outcore's kernels run with (``_TORCH_KEYS``): ``state_dict()`` gives them, so
# that torch's optimizer loads it and steps (torch's SGD reads ``dampening`` and sets no
# default for it)
_ADAM_KEYS = {k: _TORCH_KEYS[k] for k in ("amsgrad", "maximize", "foreach", "capturable",
                                          "differentiable", "fused")}
TORCH_GROUP_KEYS: dict[str, dict[str, Any]] = {
    "adam": {**_ADAM_KEYS, "decoupled_weight_decay": False},
    "adamw": {**_ADAM_KEYS, "decoupled_weight_decay": True},
    "sgd": {k: _TORCH_KEYS[k] for k in ("dampening", "maximize", "foreach", "differentiable",
                                        "fused")}}
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


def check_param_groups(module: nn.Module, param_groups: Iterable[dict[str, Any]] | None,
                       optimizer: Any = None
                       ) -> list[tuple[dict[str, Any], list[nn.Parameter]]] | None:
    """Validate torch-style param groups before anything is sharded (a typo must not
    leave the model half converted); returns (the group dict, parameters) per group.
    ``optimizer``: the config's section, whose type and momentum the groups must fit."""
    if param_groups is None:
        return None
    names = {id(p): n for n, p in module.named_parameters()}
    out, seen = [], set()
    for i, spec in enumerate(_as_groups(param_groups)):
        _warn_near_misses(f"param_groups[{i}]", spec)
        _check_torch_keys(f"param_groups[{i}]", spec)
        check_group_numbers(f"param_groups[{i}]", spec)
        if optimizer is not None:
            _check_fits(f"param_groups[{i}]", spec, optimizer)
        given = spec.get("params", [])
        params: list[Any] = [given] if isinstance(given, torch.Tensor) else list(given)
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


def _as_groups(given: Any) -> list[dict[str, Any]]:
    """The groups in torch.optim's forms: dicts, or parameters (``model.parameters()``,
    DeepSpeed's ``model_parameters=``), or ``(name, parameter)`` pairs, as one group. The
    parameters themselves reached the dict checks, which failed in torch's words."""
    if isinstance(given, (torch.Tensor, dict)):
        raise ConfigError(f"param_groups: give an iterable of parameters or of dicts (as "
                          f"torch.optim takes them), not a {type(given).__name__}")
    items = list(given)
    if not items:
        raise ConfigError("param_groups is empty: give the model's parameters, or dicts "
                          "with a 'params' key")
    if all(isinstance(x, dict) for x in items):
        return items
    if all(isinstance(x, torch.Tensor) for x in items):
        return [{"params": items}]
    if all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor)
           for x in items):
        return [{"params": [p for _, p in items]}]
    odd = next((x for x in items if not isinstance(x, (dict, torch.Tensor))), None)
    what = f"a {type(odd).__name__}" if odd is not None else "dicts and tensors together"
    raise ConfigError(f"param_groups holds {what}: give parameters, or dicts with a 'params' "
                      "key (torch.optim's forms), not a mix")


def _check_fits(where: str, spec: dict[str, Any], optimizer: Any) -> None:
    """What a group sets that the run's optimizer does not do, refused: SGD's momentum
    buffers are planned from the config's ``momentum``, so a group's momentum over a config
    without it restarted every step (trained as plain SGD, 1e-2 off torch in five steps); and
    Adam's weight decay is the type's, so a group's ``decoupled_weight_decay`` that says
    otherwise was dropped."""
    momentum, decoupled = spec.get("momentum"), spec.get("decoupled_weight_decay")
    planned = optimizer_state_kinds(optimizer.type, optimizer.momentum)
    if optimizer.type == "sgd" and "momentum_buffer" not in planned and _number(momentum or 0):
        raise ConfigError(f"{where}: momentum={momentum!r}, but the run keeps no momentum "
                          "buffers: they are planned from the config's optimizer.momentum, "
                          "which is 0. Set it above 0 (groups without momentum then say "
                          "momentum=0), or give the adopted SGD a momentum as its default")
    decay = spec.get("weight_decay", getattr(optimizer, "weight_decay", 0.0))
    if optimizer.type in ("adam", "adamw") and decoupled is not None and _number(decay) and (
            bool(decoupled) != (optimizer.type == "adamw")):  # (no decay: the two agree)
        raise ConfigError(f"{where}: decoupled_weight_decay={decoupled!r} with weight decay, "
                          f"but this run's optimizer is {optimizer.type}, which decays every "
                          f"group {'decoupled' if optimizer.type == 'adamw' else 'as L2'}; set "
                          f"optimizer.type to {'adamw' if decoupled else 'adam'}")


def _warn_near_misses(where: str, spec: dict[str, Any]) -> None:
    """A key of the user's own stays in its group, as torch's optimizers keep it (a name, a
    learning-rate scale that the user's scheduler reads); one a letter or two from a setting
    the update reads is most likely that setting misspelled, which would train with the
    default without a word, so it is named once."""
    known = ["params", *HP_KEYS, *_TORCH_KEYS]
    for key in spec:
        if key in known or not isinstance(key, str):
            continue
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
        if near:
            warnings.warn(f"{where}: key {key!r} is kept in the group but read by nothing "
                          f"(did you mean {near[0]!r}?)", stacklevel=user_stacklevel())


def check_loaded_group(i: int, saved: dict[str, Any]) -> None:
    """A saved param group ``load_state_dict`` takes: its torch keys at the values outcore's
    kernels match and its numbers numbers, as ``initialize`` checks them, so a refused load
    changes nothing and a taken one steps."""
    _check_torch_keys(f"optimizer state_dict's param group {i}", saved)
    check_group_numbers(f"optimizer state_dict's param group {i}", saved)


def check_group_numbers(where: str, group: dict[str, Any]) -> None:
    """A group's numbers within what the config accepts for them (``schema.OptimizerConfig``),
    but for a learning rate of 0, which a scheduler's warm-up sets: a NaN or negative one
    would train every weight to NaN, or away from the loss, without a word."""
    for key, low, strict in (("lr", 0.0, False), ("weight_decay", 0.0, False),
                             ("momentum", 0.0, False), ("eps", 0.0, True)):
        value = group.get(key)
        if value is None or (key == "eps" and isinstance(value, (tuple, list))):
            continue  # (Adafactor's eps is a pair, its lr may be None)
        number = _number(value)
        if number is None:
            raise ConfigError(f"{where}: {key}={value!r} is not a number")
        if not math.isfinite(number):
            raise ConfigError(f"{where}: {key}={value!r} is not finite")
        if number < low or (strict and number == low):
            raise ConfigError(f"{where}: {key}={value!r} must be "
                              f"{'above' if strict else 'at least'} {low:g}")
    betas = group.get("betas")
    if betas is not None:
        numbers = [_number(b) for b in betas] if isinstance(betas, (tuple, list)) else []
        if len(numbers) != 2 or any(b is None or not 0.0 <= b < 1.0 for b in numbers):
            raise ConfigError(f"{where}: betas={betas!r} is not two numbers in [0, 1)")


def check_momentum_kept(groups: list[dict[str, Any]], kind: str,
                        kinds: tuple[str, ...]) -> None:
    """A group's SGD momentum set after ``initialize`` where the run keeps no momentum
    buffers (``_check_fits`` refuses one given at ``initialize``): a scheduler that cycles
    it (``CyclicLR``, ``OneCycleLR``) or an edit of the group. torch's SGD then keeps a
    momentum buffer; the update here would restart it every step and train as plain SGD
    without a word, so the round's first update (in backward, with the state on NVMe) is
    refused, every group checked, before any is applied."""
    if kind != "sgd" or "momentum_buffer" in kinds:
        return
    for i, group in enumerate(groups):
        momentum = group.get("momentum", 0)
        if _number(momentum):
            raise ConfigError(
                f"param group {i}: momentum={momentum!r} at this step, but the run keeps no "
                "momentum buffers: they are planned at initialize from the config's "
                "optimizer.momentum (or the adopted SGD's default), which is 0. Set that above 0, "
                "or build the scheduler with cycle_momentum=False (CyclicLR, OneCycleLR)")


def _number(value: Any) -> float | None:
    """``value`` as a float: any real number (a NumPy scalar too, as a schedule computed
    with NumPy gives), or a tensor of one (torch allows a tensor ``lr``)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        return float(value) if value.numel() == 1 and not value.is_complex() else None
    return float(value) if isinstance(value, numbers.Real) else None


def _check_torch_keys(where: str, group: dict[str, Any]) -> None:
    """torch's own group keys at the values outcore's kernels match (``_TORCH_KEYS``)."""
    for key, neutral in _TORCH_KEYS.items():
        if key in group and neutral is not None and group[key] != neutral:
            raise ConfigError(f"{where}: {key}={group[key]!r} is not supported; outcore's "
                              f"kernels run with {key}={neutral!r}")


def _plain(value: Any) -> Any:
    """A hyper-parameter as JSON compares it: a tensor learning rate as its number, betas as
    a list."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
        return value.item()
    return list(value) if isinstance(value, tuple) else value


def check_same_groups(groups: _Groups, comm: Any) -> _Groups:
    """Refuse, on every rank together, optimizer groups that differ between ranks
    (runtime/same_config.py's [Note: every rank runs one config]); returns ``groups``."""
    if comm.world_size == 1:
        return groups
    where = f"on this rank (rank {comm.rank})"
    if not comm.alike([len(groups)])[0]:
        raise ConfigError(f"the ranks pass different param_groups: {len(groups)} group"
                          f"{'s' if len(groups) != 1 else ''} {where}, another number on "
                          "another; give every rank the same groups")
    # per group: each hyper-parameter (absent ones too, so every rank sends as many), then
    # the names of the parameters it holds, in any order
    hps = [[_plain(spec.get(k)) for k in _COMPARED] for spec, _ in groups]
    names = [sorted(sp.name for sp in sps) for _, sps in groups]  # a set has no order
    same = iter(comm.alike([digest_of(v) for hp, held in zip(hps, names, strict=True)
                            for v in (*hp, held)]))
    for i in range(len(groups)):
        differ = [f"{k}={v!r}" for k, v in zip(_COMPARED, hps[i], strict=True) if not next(same)]
        if differ:
            raise ConfigError(f"the ranks pass different param_groups: param_groups[{i}] "
                              f"{', '.join(differ)} {where} differ{'s' * (len(differ) == 1)} "
                              "on another; give every rank the same groups")
        if not next(same):
            shown = ", ".join(names[i][:4]) + (", ..." if len(names[i]) > 4 else "")
            raise ConfigError(f"the ranks pass different param_groups: param_groups[{i}] "
                              f"holds other parameters on another rank than {where} "
                              f"({len(names[i])}: {shown}); give every rank the same groups")
    return groups
