"""A DeepSpeed config's ``scheduler`` section as a torch scheduler on the engine's optimizer.

[Note: DeepSpeed's schedules]
DeepSpeed builds WarmupLR, WarmupDecayLR or WarmupCosineLR from a config's ``scheduler``
section and steps it after each applied update (not after a step skipped for an fp16
overflow). A script or a recipe carried over to outcore expects the same rates, so the same
three curves are built here as a torch ``LambdaLR`` over the engine's optimizer, one factor
per param group, with DeepSpeed 0.19's formulas: a logarithmic (default) or linear warm-up
from ``warmup_min_lr`` to ``warmup_max_lr``, then constant (WarmupLR), linear decay back to
``warmup_min_lr`` at ``total_num_steps`` (WarmupDecayLR), or a cosine from each group's own
rate down to ``cos_min_ratio`` of it, staying there after the end (WarmupCosineLR). The
update each rate reaches is DeepSpeed's too: its first two updates both run at the curve's
first value (its scheduler sets it when made, and its first ``step()`` counts iteration 0
again; checked against its classes in its engine's order). A key the section leaves out takes
DeepSpeed's default (WarmupLR's peak: each group's own rate); ``"auto"`` takes a value only
``OutcoreTrainer`` can fill (hf/schedule.py), so outside it ``"auto"`` is refused by name.
Other DeepSpeed schedulers are refused by name.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from outcore.config.deepspeed import is_deepspeed, number
from outcore.config.mappings import read_mapping
from outcore.errors import ConfigError

SUPPORTED = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
MISSING: Any = object()
"""A key the section leaves out."""
REQUIRED: Any = object()
"""The default of a key DeepSpeed needs (``total_num_steps``)."""
Fill = Callable[[str, Any, Any], "float | None"]
"""``(key, the section's value or MISSING, DeepSpeed's default or REQUIRED) -> value``."""


def deepspeed_scheduler(optimizer: torch.optim.Optimizer,
                        config: str | os.PathLike[str] | Mapping[str, Any],
                        ) -> torch.optim.lr_scheduler.LambdaLR:
    """DeepSpeed's scheduler from ``config`` (a DeepSpeed config file or dict) over
    ``optimizer`` (``engine.optimizer``), for a loop of your own: call its ``step()`` when
    ``engine.step()`` returns True, as DeepSpeed's engine steps its own (see the note)."""
    source = (read_mapping(config) if isinstance(config, (str, os.PathLike))
              else dict(config))
    spec = source.get("scheduler") if is_deepspeed(source) else None
    if not isinstance(spec, Mapping):
        raise ConfigError("deepspeed_scheduler: the config has no DeepSpeed 'scheduler' "
                          "section (a mapping with 'type' and 'params')")
    return build(spec, optimizer, outside)


def outside(key: str, given: Any, default: Any) -> float | None:
    """A key's value outside ``OutcoreTrainer``: the section's number, else DeepSpeed's
    default; "auto" has nothing to take its value from."""
    path = f"DeepSpeed config scheduler.params.{key}"
    if given is MISSING and default is REQUIRED:
        raise ConfigError(f"{path} is needed (DeepSpeed has no default for it)")
    if given is MISSING:
        return cast("float | None", default)
    if given == "auto":
        raise ConfigError(f"{path}: \"auto\" is filled from the Trainer under OutcoreTrainer "
                          "only; give a number")
    return float(number(f"scheduler.params.{key}", given))


def build(spec: Mapping[str, Any], optimizer: torch.optim.Optimizer,
          fill: Fill) -> torch.optim.lr_scheduler.LambdaLR:
    """The LambdaLR equivalent of DeepSpeed's scheduler ``spec`` (see the note); ``fill``
    gives each key's value (``outside``, or the Trainer's in hf/schedule.py)."""
    kind = spec.get("type")
    if kind not in SUPPORTED:
        raise ConfigError(f"DeepSpeed config scheduler.type: {kind!r} is not supported; use "
                          f"one of {', '.join(SUPPORTED)}, or a torch.optim.lr_scheduler on "
                          "engine.optimizer")
    params = dict(spec.get("params") or {})

    def value(key: str, default: Any) -> float:
        got = fill(key, params.get(key, MISSING), default)
        assert got is not None  # only WarmupLR's peak defaults to None, read apart below
        return got

    warmup = max(2, int(value("warmup_num_steps", 1000)))
    log_warmup = params.get("warmup_type", "log") == "log"
    total = int(value("total_num_steps", REQUIRED)) if kind != "WarmupLR" else 0
    groups = [float(g["lr"]) for g in optimizer.param_groups]

    def gamma(step: int) -> float:
        """The warm-up's share of the way at iteration ``step`` (1 once warmed up)."""
        if step >= warmup:
            return 1.0
        return math.log(step + 1) / math.log(warmup) if log_warmup else step / warmup

    rates: list[Callable[[int], float]]
    if kind == "WarmupCosineLR":
        start, floor = value("warmup_min_ratio", 0.0), value("cos_min_ratio", 0.0001)

        def ratio(step: int) -> float:
            if step < warmup:
                return start + gamma(step) * (1 - start)
            progress = min(1.0, (step - warmup + 1) / max(1, total - warmup))
            return max(0.0, floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))

        rates = [_scaled(ratio, g) for g in groups]
    else:
        low = value("warmup_min_lr", 0.0)
        # WarmupLR without a peak warms each group up to its own rate, as DeepSpeed's does
        peak = fill("warmup_max_lr", params.get("warmup_max_lr", MISSING),
                    None if kind == "WarmupLR" else 0.001)

        def rate(step: int, high: float) -> float:
            if step < warmup or kind == "WarmupLR":
                return low + (high - low) * gamma(step)
            return low + (high - low) * max(0.0, (total - step) / max(1.0, total - warmup))

        rates = [functools.partial(rate, high=g if peak is None else peak) for g in groups]
    # DeepSpeed's engine runs its first two updates at the curve's first value: its scheduler
    # sets it when made, and its first step() counts iteration 0 again
    return torch.optim.lr_scheduler.LambdaLR(optimizer, [
        _factor(r, g) for r, g in zip(rates, groups, strict=True)])


def _scaled(ratio: Callable[[int], float], lr: float) -> Callable[[int], float]:
    return lambda step: lr * ratio(step)


def _factor(rate: Callable[[int], float], lr: float) -> Callable[[int], float]:
    """LambdaLR's factor of a group whose rate was ``lr`` when made: DeepSpeed's rate one
    update late (see the note); a group made at rate 0 stays there."""
    return lambda step: rate(max(0, step - 1)) / lr if lr else 0.0
