"""Hyper-parameters changed between backward and ``step()``, and the updates that overlap it.

[Note: hyper-parameters set after backward]
torch's optimizer reads a group's ``lr`` (and ``betas``, ``eps``, ``weight_decay``,
``momentum``, ``nesterov``) in ``step()``. An update that overlaps backward (optimizer.py's
[Note: updating during backward]) reads them earlier, when backward submits it. A loop
that sets them between ``backward`` and ``step()`` (build-nanogpt's "backward, clip, set
lr, step", or a warm-up written that way) would then update with the previous step's
values: its first step with the constructor's learning rate, not the warm-up's. So each
boundary backward records the groups' values as it ends, and ``step()`` compares. When one
moved, tentative updates (speculation.py's [Note: a speculative step]) are redone with the
new values; updates that were applied for good cannot be, and a warning says that this
step used the earlier values for them. From then on every update waits for ``step()``:
exact, at the cost of the overlap, since a loop that set them late once sets them there
every step; the room for tentative writes goes back to the disk. The warning names the key
and both values, and says that setting them before backward (or after ``step()``, as
torch's LR schedulers do) keeps the overlap.

The first step cannot know where the loop sets them, and waiting in it would hold every
gradient until ``step()``: the memory the overlap saves, as large as the model's 16-bit
weights or twice that. So it overlaps. With clipping or fp16 it waits anyway (speculation
starts with the second step) and is exact. Without either, the first step in which a value
moves after backward keeps its overlapped updates at the earlier value (the run's first
step, for a loop that sets the learning rate after every backward), and the warning says so.

fp16's tentative updates unscale their gradients as they read them and leave them scaled;
a redo reads them again, so ``step()`` unscales every gradient when a value moved
(precision.py's ``LossScaler.unscale``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from outcore.optim.param_groups import HP_KEYS

log = logging.getLogger("outcore")


def _plain(value: Any) -> Any:
    """``value`` comparable with ``!=``: a tensor (torch allows a tensor ``lr``) as numbers."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else tuple(value.tolist())
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    return value


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    return tuple(_copy(v) for v in value) if isinstance(value, tuple) else value


def frozen(group: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``group`` for an update submitted now, which later changes do not reach:
    torch's LR schedulers change a tensor ``lr`` in place (``fill_``), and a queued update
    must use the value it was submitted with, as the note's comparison assumes."""
    return {k: _copy(v) for k, v in group.items()}


def _shown(value: Any) -> str:
    """A value as the warning names it: a float32 tensor's 0.003 as 0.003, not its 17 digits."""
    if isinstance(value, float):
        return format(value, ".6g")
    return f"({', '.join(map(_shown, value))})" if isinstance(value, tuple) else repr(value)


def snapshot(groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The values an update reads from each of ``groups``, copied."""
    return [{k: _plain(g[k]) for k in HP_KEYS if k in g} for g in groups]


class HyperParamWatch:
    """Whether updates may overlap backward, as far as hyper-parameters go (the note)."""

    def __init__(self) -> None:
        self._at_backward: list[dict[str, Any]] | None = None  # as the boundary backward ended
        self.late = False  # a step found them moved: updates wait for ``step()`` from then on

    def backward_ended(self, groups: Sequence[dict[str, Any]]) -> None:
        """A boundary backward ended: ``step()`` compares against these values."""
        if not self.late:  # nothing overlaps any more
            self._at_backward = snapshot(groups)

    def moved(self, groups: Sequence[dict[str, Any]], tentative: bool,
              applied: Callable[[], int]) -> bool:
        """At ``step()``: whether a value an update reads moved since the boundary backward
        ended. ``tentative``: this step's overlapped updates are tentative (the caller redoes
        them); ``applied()``: how many parameters were updated for good during backward."""
        before, self._at_backward = self._at_backward, None
        if before is None:
            return False
        # a group added since (add_param_group) had no update overlap: nothing to compare
        pairs = enumerate(zip(before, snapshot(groups), strict=False))
        changes = [(i, k, was, now[k]) for i, (old, now) in pairs
                   for k, was in old.items() if k in now and now[k] != was]
        if not changes:
            return False
        i, key, was, now = changes[0]
        if tentative:
            this_step = "This step's updates made during backward are redone with the new values."
        elif n := applied():
            this_step = (f"This step's updates of {n} parameters made during backward used "
                         "the earlier values.")
        else:
            this_step = "This step used the new values."
        log.warning(
            "outcore: param_groups[%d][%r] changed between backward and step() (%s -> %s). "
            "%s From now on every update waits for step(), which gives up overlapping the "
            "optimizer with backward; set hyper-parameters before backward or after step() "
            "(as torch's LR schedulers do) to keep it.", i, key, _shown(was), _shown(now),
            this_step)
        self.late = True
        return True
