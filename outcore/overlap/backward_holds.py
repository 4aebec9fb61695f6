"""When backward lets go of groups that no gradient hook releases: frozen and recomputed ones.

[Note: frozen groups in backward]
A group with no trainable parameter gets no gradient hook, yet backward may fetch it (a
frozen layer between the loss and a trainable one: its weight is needed for the input's
gradient). Such a group is released once backward has moved on: when a *later* autograd
node unpacks a saved parameter on the same thread. Nodes on one thread run one after
another, and a node unpacks everything it saved before it computes, so by then no node is
still reading the group; if a later node needs it again, the unpack fetches it again (the
schedule keeps it instead when its trace says so). Without this, fine-tuning a mostly frozen
model would hold every frozen layer gathered until backward ends.

A group a recomputation (activation checkpointing) fetched during backward is different:
checkpoint keeps raw views of its weights, which no unpack of ours would see, so it stays
("pinned") while that block's backward runs. It is released when the next recomputation
begins: a forward hook in backward under another autograd node than the one whose unpack
started the recomputation before (a recomputation runs whole inside that one unpack).
Autograd runs a block's nodes only once every node that needs its output's gradient has run,
so the block recomputed before is done, and its saved views are gone with its nodes. Holding
every pinned group until backward ends instead kept a LoRA run's whole frozen base gathered:
for a 30B model, more memory than the host has (measured: bench/results, 'LoRA at 13B and
30B').
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from outcore.zero.group import GatherGroup
from outcore.zero.state import GroupState


class BackwardHolds:
    """The frozen groups backward fetched and the groups recomputations pinned, for one
    engine's hooks; ``done(group)`` hands a group back to the schedule (see the note)."""

    def __init__(self, groups: list[GatherGroup], done: Callable[[GatherGroup], None]) -> None:
        self._groups = groups
        self._done = done
        # (group, node that last unpacked it, thread)
        self._frozen: list[tuple[GatherGroup, object, int | None]] = []
        self._pinned: set[int] = set()  # groups a recomputation fetched in this backward
        # per thread, the autograd node whose unpack recomputes now
        self._recomputing: dict[int, object] = {}

    def recompute(self, groups: list[GatherGroup]) -> None:
        """A module's forward hook in backward: a recomputation fetches ``groups``. A new one
        (under another autograd node) means the one before is done."""
        node = torch._C._current_autograd_node()
        mark = self._recomputing.get(threading.get_ident())
        if node is not mark:
            self._release_pinned(keep=groups)
            self._recomputing[threading.get_ident()] = node
        self._pinned.update(g.index for g in groups)

    def pin(self, g: GatherGroup) -> None:
        """A recomputation reads ``g`` through a function, not its module's call."""
        self._pinned.add(g.index)

    def frozen(self, g: GatherGroup) -> bool:
        """Whether unpacking ``g`` leaves it for a later node to release (see the note)."""
        return not g.trainable and not g.persistent and g.index not in self._pinned

    def unpacking(self, g: GatherGroup, frozen: bool) -> Callable[[], None]:
        """Backward unpacks a saved parameter of ``g``: release the frozen groups earlier
        nodes of this thread unpacked. The returned call records ``g`` when ``frozen``, once
        its fetch is asked for (so a fetch that raises leaves nothing recorded)."""
        # which node and thread unpack only matters while frozen groups are involved; the
        # common case (every group trainable) skips both calls
        if not frozen and not self._frozen:
            return _nothing
        node, thread = torch._C._current_autograd_node(), threading.get_ident()
        if self._frozen:
            self._release_frozen(node, thread, g)

        def record() -> None:
            if frozen:
                held = [h for h in self._frozen if h[0] is not g]
                self._frozen = [*held, (g, node, thread)]

        return record

    def clear(self) -> None:
        """Backward ended or was dropped: nothing is held for it any more."""
        self._frozen, self._pinned, self._recomputing = [], set(), {}

    def _release_frozen(self, node: object, thread: int | None, unpacking: GatherGroup) -> None:
        """Release frozen groups that earlier nodes of this thread unpacked, except
        ``unpacking``, which the current node is about to use again."""
        still = []
        for g, used_by, on in self._frozen:
            if g.index in self._pinned:
                continue  # a recomputation's: stays until backward ends
            if g is unpacking or used_by is node or on != thread or g.holds > 0:
                still.append((g, used_by, on))
            else:
                self._done(g)
        self._frozen = still

    def _release_pinned(self, keep: list[GatherGroup]) -> None:
        """Release the frozen groups the previous recomputation fetched."""
        for index in self._pinned:
            g = self._groups[index]
            if g in keep or g.trainable or g.persistent or g.holds > 0:
                continue
            if g.state is not GroupState.SHARDED:
                self._done(g)
        self._pinned = set()


def _nothing() -> None:
    pass
