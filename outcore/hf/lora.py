"""LoRA adapters over a sharded, offloaded base model, from a one-line spec.

[Note: a frozen base costs its 16-bit bytes only]
``get_peft_model`` freezes every base weight (``requires_grad=False``) and adds small
trainable ``lora_A``/``lora_B`` matrices. The engine keeps a frozen parameter as one shard in
the training dtype in its parameter tier (host memory or NVMe) and nothing else: no fp32
master (``ShardedParam.prepare_for_training`` drops it), no gradient (autograd never makes
one, and no gradient hook is registered), no optimizer state (only trainable parameters are
in the optimizer). In backward a frozen layer between the loss and an adapter is fetched for
its input gradient and released as soon as backward has moved past it (backward_holds.py's
[Note: frozen groups in backward]). So the base costs 2 bytes per parameter where a full fine-tune
costs 2 + 4 + 4 + 8 (training dtype, master, gradient, AdamW moments), and only the adapters
pay the latter. Built under ``outcore.init(cfg, frozen=True)`` the base never has the fp32
master even briefly (param.py's [Note: a parameter born frozen]).
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from outcore.errors import ConfigError

KEYS = {"r": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "targets": "target_modules"}


def parse_spec(spec: str) -> dict[str, Any]:
    """``r=8,alpha=16,targets=q_proj,v_proj`` -> LoraConfig keywords (peft's names).

    A comma-separated item without ``=`` continues the list of the key before it, so the
    target module names need no quoting."""
    out: dict[str, Any] = {}
    key: str | None = None
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if "=" in item:
            key, value = (s.strip() for s in item.split("=", 1))
            if key not in KEYS:
                raise ConfigError(f"--lora: unknown key {key!r} in {spec!r}; known: "
                                  f"{', '.join(KEYS)}")
            if KEYS[key] in out:
                raise ConfigError(f"--lora: {key} given twice in {spec!r}")
            out[KEYS[key]] = _value(key, value, spec)
        elif key == "targets":
            out["target_modules"].append(item)
        else:
            raise ConfigError(f"--lora: {item!r} in {spec!r} is not key=value (only targets "
                              "takes several comma-separated names)")
    if out.get("target_modules") == ["all-linear"]:
        out["target_modules"] = "all-linear"  # peft's shorthand is a string, not a name
    if "r" not in out or not out.get("target_modules"):
        raise ConfigError(f"--lora {spec!r}: give at least r=... and targets=..., e.g. "
                          "r=8,alpha=16,targets=q_proj,v_proj")
    return out


def _value(key: str, value: str, spec: str) -> Any:
    try:
        if key == "r":
            n = int(value)
            if n < 1:
                raise ValueError
            return n
        if key == "alpha":
            x = float(value)
            if not x > 0:  # alpha 0 scales the adapters' output to nothing
                raise ValueError
            return int(x) if x.is_integer() else x
        if key == "dropout":
            x = float(value)
            if not 0 <= x < 1:
                raise ValueError
            return x
    except ValueError:
        kind = {"r": "positive integer", "alpha": "positive number",
                "dropout": "number in [0, 1)"}[key]
        raise ConfigError(f"--lora: {key}={value!r} in {spec!r} is not a {kind}") from None
    return [value] if value else []


def lora_config(spec: str | dict[str, Any], causal_lm: bool = True) -> Any:
    """A ``peft.LoraConfig`` from a spec string or LoraConfig keywords; ``causal_lm``: for a
    Hugging Face causal LM (PEFT's generation support), else a plain adapter model."""
    from peft import LoraConfig, TaskType

    kwargs = parse_spec(spec) if isinstance(spec, str) else dict(spec)
    return LoraConfig(task_type=TaskType.CAUSAL_LM if causal_lm else None, **kwargs)


def apply_lora(model: nn.Module, spec: str | dict[str, Any]) -> nn.Module:
    """``get_peft_model(model, lora_config(spec))``; target names that match no module of
    the model are an error naming the module names it has."""
    from peft import get_peft_model

    # PEFT's causal-LM wrapper needs Hugging Face's generation hooks; any other module (one
    # of outcore's presets, a user's nn.Module) gets the plain adapter model
    config = lora_config(spec, causal_lm=callable(getattr(model, "prepare_inputs_for_generation",
                                                           None)))
    targets = config.target_modules
    wanted = set() if isinstance(targets, str) else set(targets or [])  # "all-linear": peft's
    names = [name for name, _ in model.named_modules()]
    # peft matches a target against a module name's last parts ("q_proj", "self_attn.q_proj")
    unknown = sorted(t for t in wanted if t != "all-linear" and
                     not any(n == t or n.endswith("." + t) for n in names))
    if unknown:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"})
        raise ConfigError(f"--lora targets {unknown} match no module of this model; its "
                          f"linear layers are named {linear}")
    with warnings.catch_warnings():
        # peft 0.21 asks transformers 5 a deprecated question; nothing the user can act on
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                                category=FutureWarning)
        return get_peft_model(model, config)
