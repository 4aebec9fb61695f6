"""A DeepSpeed config's ``scheduler`` section under ``OutcoreTrainer``.

[Note: the recipe's schedule]
Under transformers' DeepSpeed integration a config with a ``scheduler`` section replaces the
Trainer's ``lr_scheduler_type``: DeepSpeed builds WarmupLR, WarmupDecayLR or WarmupCosineLR,
its ``"auto"`` values filled from ``TrainingArguments`` (the warm-up from 0 to
``learning_rate`` over ``get_warmup_steps``, the total from the run's step count). A recipe
carried over to outcore expects the same schedule, so the same three curves are built here as
torch ``LambdaLR`` schedulers over the engine's optimizer, with DeepSpeed's formulas: a
logarithmic (default) or linear warm-up from ``warmup_min_lr`` to ``warmup_max_lr``, then
constant (WarmupLR), linear decay back to ``warmup_min_lr`` at ``total_num_steps``
(WarmupDecayLR), or a cosine from the peak to ``cos_min_ratio`` of it (WarmupCosineLR).
The update that each rate reaches is DeepSpeed's too: its first two updates both run at the
curve's first value (checked against DeepSpeed 0.19's classes in its engine's order; one
update ahead of it before). Other DeepSpeed schedulers are refused by name.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from outcore.config.deepspeed import number
from outcore.errors import ConfigError

SUPPORTED = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def deepspeed_scheduler(spec: dict[str, Any], optimizer: torch.optim.Optimizer, args: Any,
                        num_training_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The LambdaLR equivalent of DeepSpeed's scheduler ``spec`` (see the note)."""
    kind = spec.get("type")
    if kind not in SUPPORTED:
        raise ConfigError(f"DeepSpeed config scheduler.type: {kind!r} is not supported under "
                          f"OutcoreTrainer; use one of {', '.join(SUPPORTED)}, or drop the "
                          "section and set TrainingArguments.lr_scheduler_type")
    params = dict(spec.get("params", {}))
    base = float(args.learning_rate)

    def value(key: str, auto: float, trainer: str | None = None) -> float:
        """The section's ``key``, or the Trainer's ``auto`` where it says "auto"; a number
        that differs from the Trainer's is refused, as transformers refuses it."""
        given = params.get(key, "auto")
        if given == "auto":
            return auto
        mine = number(f"scheduler.params.{key}", given)
        if trainer is not None and mine != auto:
            raise ConfigError(f"DeepSpeed config scheduler.params.{key}={given!r} and the "
                              f"Trainer's {trainer}={auto!r} differ; set one of them (\"auto\" "
                              "takes the Trainer's), as transformers' DeepSpeed integration "
                              "asks")
        return mine

    warmup = max(2, int(value("warmup_num_steps",
                              max(1, args.get_warmup_steps(num_training_steps)), "warmup_steps")))
    total = int(value("total_num_steps", num_training_steps, "number of training steps"))
    log_warmup = params.get("warmup_type", "log") == "log"
    if kind == "WarmupCosineLR":
        low, high = value("warmup_min_ratio", 0.0) * base, base
        floor = value("cos_min_ratio", 0.0001)
    else:
        low, high = value("warmup_min_lr", 0.0), value("warmup_max_lr", base)

    def rate(step: int) -> float:
        if step < warmup:
            gamma = math.log(step + 1) / math.log(warmup) if log_warmup else step / warmup
            return low + (high - low) * gamma
        if kind == "WarmupLR":
            return high
        if kind == "WarmupDecayLR":
            return low + (high - low) * max(0.0, (total - step) / max(1.0, total - warmup))
        progress = (step - warmup + 1) / max(1, total - warmup)
        return high * max(0.0, floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))

    # DeepSpeed's engine runs its first two updates at the curve's first value: its scheduler
    # sets it when made, and its first step() counts iteration 0 again
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: rate(max(0, step - 1)) / base)
