"""Dynamic loss scaling for fp16 (bf16 and fp32 need none).

[Note: skip, then shrink]
fp16 gradients underflow unless the loss is scaled up before backward. Too large a scale
overflows instead; then the step is skipped (no parameter or optimizer state changes), the
scale is halved, and training goes on. After ``growth_interval`` clean steps the scale
doubles again. The overflow test is global: one rank's inf skips the step on every rank.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch

from outcore.config import LossScaleConfig
from outcore.errors import user_stacklevel

STUCK = 10
"""Overflows in a row at the minimum scale that are named: torch's GradScaler skips on in
silence, and DeepSpeed raises; a warning says it once and the run goes on, as it would."""


class LossScaler:
    """The current loss scale and its update rule."""

    def __init__(self, cfg: LossScaleConfig, enabled: bool) -> None:
        self.enabled = enabled
        self.scale = float(2**cfg.initial_scale_power) if enabled else 1.0
        self.min_scale = cfg.min_scale
        self.growth_interval = cfg.growth_interval
        self.good_steps = 0
        self.skipped_steps = 0
        self.at_floor = 0  # overflows in a row with the scale already at its minimum

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            at_floor = self.scale <= self.min_scale
            self.scale = max(self.scale / 2.0, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            self.at_floor = self.at_floor + 1 if at_floor else 0
            if self.at_floor == STUCK:
                warnings.warn(
                    f"fp16: {STUCK} steps in a row skipped at the minimum loss scale "
                    f"({self.min_scale:g}): the gradients overflow at any scale (a NaN or "
                    "inf loss, a diverged run?), so nothing trains; look at the loss, or "
                    "lower loss_scale.min_scale", stacklevel=user_stacklevel())
            return
        self.good_steps, self.at_floor = self.good_steps + 1, 0
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2.0

    def unscale(self, grads: Iterable[tuple[torch.Tensor, bool]], every: bool) -> None:
        """Divide the ``(gradient, tentative)`` pairs' gradients by the scale, in place. A
        tentative update (speculation.py) unscaled its gradient as it read it, into its slot's
        buffer, and left the gradient scaled (staging.py's [Note: the gradient an update
        reads]): those are divided only where ``every``, because the norm or a redo of the
        update reads them again (a clip, or a hyper-parameter that moved: hyperparams.py)."""
        for grad, tentative in grads:
            if every or not tentative:
                grad.mul_(1.0 / self.scale)

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
