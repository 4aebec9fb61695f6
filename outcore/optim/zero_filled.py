"""``zero_grad(set_to_none=False)``: a parameter that gets no gradient in a step still updates.

[Note: zero-filled gradients still update]
torch's ``zero_grad(set_to_none=False)`` fills each existing ``p.grad`` with zeros instead of
dropping it, and its optimizers step every parameter whose ``grad`` is not None. So a
parameter that had a gradient once (since the last ``zero_grad`` that set them to None) and
gets none in this step (an expert no token reached, a branch this batch skipped) is still
updated: AdamW moves it by its momentum and decays it, SGD applies momentum and weight decay.
outcore keeps gradients in its shards and updated only what got one, so with that flag such
parameters stood still where PyTorch moved them, silently. Here the optimizer remembers which
parameters got a gradient since the last ``set_to_none=True``, and while the flag holds gives
the ones without a gradient at a step a zero gradient shard, updated with the rest. Where every
parameter gets a gradient every step (most models) nothing is filled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from outcore.zero.param import ShardedParam


class ZeroFilledGrads:
    """Which parameters torch would still show a zero ``grad`` for (see the note)."""

    def __init__(self) -> None:
        self._on = False  # the last user zero_grad() kept gradients as zeros
        self._had: set[ShardedParam] = set()  # got a gradient since gradients were None

    def zero_grad(self, set_to_none: bool) -> None:
        """A user's ``zero_grad(set_to_none=...)`` (not the engine's own after a step)."""
        self._on = not set_to_none
        if set_to_none:
            self._had = set()

    def fill(self, params: Iterable[ShardedParam], updated: Callable[[ShardedParam], bool],
             device: torch.device) -> None:
        """At ``step()``: note who has a gradient now (``updated``: applied during backward
        already), and, while the flag holds, give a zero one to those that had one before."""
        missing = []
        for sp in params:
            if sp.has_grad or updated(sp):
                self._had.add(sp)
            elif self._on and sp in self._had:
                missing.append(sp)
        for sp in missing:
            sp.add_grad(torch.zeros(sp.shard_numel, device=device), owned=True)
