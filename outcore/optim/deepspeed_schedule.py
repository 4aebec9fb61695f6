"""A DeepSpeed config's ``scheduler`` section as a torch scheduler on the engine's optimizer.

[Note: DeepSpeed's schedules]
DeepSpeed builds WarmupLR, WarmupDecayLR or WarmupCosineLR from a config's ``scheduler``
section and steps it after each applied update (not after a step skipped for an fp16
overflow). A script or a recipe carried over to outcore expects the same rates, so the same
three curves are built here as a torch scheduler over the engine's optimizer that sets each
param group's rate as DeepSpeed's does, with DeepSpeed 0.19's formulas: a logarithmic
(default; any ``warmup_type`` but "linear") or linear warm-up from ``warmup_min_lr`` to
``warmup_max_lr``, then constant (WarmupLR), linear decay back to ``warmup_min_lr`` at
``total_num_steps`` (WarmupDecayLR), or a cosine from each group's own rate down to
``cos_min_ratio`` of it, staying there after the end (WarmupCosineLR). The update each rate
reaches is DeepSpeed's too: its first update runs at the rate its scheduler sets when made
(the curve's first value; 0 for WarmupCosineLR), its second at the curve's first value, as
its first ``step()`` counts iteration 0 (checked against its classes in its engine's
order). A key the section leaves out takes DeepSpeed's default (WarmupLR's peak: each
group's own rate), as under transformers' integration, which fills only ``"auto"``; outside
``OutcoreTrainer`` nothing can fill ``"auto"``, so it is refused by name. Other DeepSpeed
schedulers are refused by name.
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
                        ) -> DeepSpeedLR:
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
    """A key's value outside ``OutcoreTrainer`` (and a number's or a left-out key's under
    it): the section's number, else DeepSpeed's default; "auto" has nothing to take its
    value from here."""
    path = f"DeepSpeed config scheduler.params.{key}"
    if given is MISSING and default is REQUIRED:
        raise ConfigError(f"{path} is needed (DeepSpeed has no default for it; under "
                          "OutcoreTrainer, \"auto\" takes the Trainer's)")
    if given is MISSING:
        return cast("float | None", default)
    if given == "auto":
        raise ConfigError(f"{path}: \"auto\" is filled from the Trainer under OutcoreTrainer "
                          "only; give a number")
    return float(number(f"scheduler.params.{key}", given))


def build(spec: Mapping[str, Any], optimizer: torch.optim.Optimizer,
          fill: Fill) -> DeepSpeedLR:
    """DeepSpeed's scheduler ``spec`` over ``optimizer`` (see the note); ``fill`` gives each
    key's value (``outside``, or the Trainer's in hf/schedule.py)."""
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
    log_warmup = params.get("warmup_type", "log") != "linear"  # DeepSpeed: any other is log
    total = int(value("total_num_steps", REQUIRED)) if kind != "WarmupLR" else 0
    # each group's rate before any schedule: a scheduler made after a resume (or after
    # another scheduler) finds the rate of the step it stopped at in "lr"
    own = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]

    def gamma(step: int) -> float:
        """The warm-up's share of the way at iteration ``step`` (1 once warmed up)."""
        if step >= warmup:
            return 1.0
        return math.log(step + 1) / math.log(warmup) if log_warmup else step / warmup

    rates: list[Callable[[int], float]]
    if kind == "WarmupCosineLR":
        start, floor = value("warmup_min_ratio", 0.0), value("cos_min_ratio", 0.0001)

        def ratio(step: int) -> float:
            if step < 0:  # DeepSpeed's ratio before its first step
                return 0.0
            if step < warmup:
                return start + gamma(step) * (1 - start)
            progress = min(1.0, (step - warmup + 1) / max(1, total - warmup))
            return max(0.0, floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))

        rates = [_scaled(ratio, lr) for lr in own]
    else:
        low = value("warmup_min_lr", 0.0)
        # WarmupLR without a peak warms each group up to its own rate, as DeepSpeed's does
        peak = fill("warmup_max_lr", params.get("warmup_max_lr", MISSING),
                    None if kind == "WarmupLR" else 0.001)

        def rate(step: int, high: float) -> float:
            if step < warmup or kind == "WarmupLR":  # before its first step: the lowest
                return low + (high - low) * gamma(max(0, step))
            return low + (high - low) * max(0.0, (total - step) / max(1.0, total - warmup))

        rates = [functools.partial(rate, high=lr if peak is None else peak) for lr in own]
    return DeepSpeedLR(optimizer, rates)


class DeepSpeedLR(torch.optim.lr_scheduler.LRScheduler):
    """Each group's rate as DeepSpeed's scheduler sets it: absolute rates, not factors of the
    group's own (a group made at rate 0 still warms up to the peak), one update late (see the
    note: DeepSpeed's engine runs its first update at the rate before its scheduler's first
    step, its second at the curve's first value)."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 rates: list[Callable[[int], float]]) -> None:
        self.rates = rates
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:  # type: ignore[override]  # torch's says list[float | Tensor]
        return [rate(self.last_epoch - 1) for rate in self.rates]

    def state_dict(self) -> dict[str, Any]:
        """torch's, without the rates (functions: made again from the config, as LambdaLR
        leaves out its lambdas), so that it pickles and goes into a checkpoint's client
        state."""
        return {k: v for k, v in super().state_dict().items() if k != "rates"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, and each group's rate set for the step restored: made after
        ``load_checkpoint``, the scheduler set its first rate over the one the checkpoint
        restored, and torch's own load leaves that until the next ``step()``, so the first
        update after the resume ran at the warm-up's start."""
        super().load_state_dict(state_dict)
        rates = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, rates, strict=True):
            group["lr"] = lr
        self._last_lr = list(rates)


def _scaled(ratio: Callable[[int], float], lr: float) -> Callable[[int], float]:
    """WarmupCosineLR's rate of a group whose own rate is ``lr``: a ratio of it."""
    return lambda step: lr * ratio(step)
