"""Writes into a parameter's temporary full tensor during a forward or backward, found after.

[Note: a write the shards never see is refused after the fact]
In the engine's forward and backward a parameter shows a full tensor gathered for compute:
a temporary, or a training copy beside its fp32 master. A write through the parameter itself
is refused as it happens (access.py's ``_check_writable``), but two ways past it reach the
temporary directly: ``p.detach()`` and ``p.data``, plain tensors over the same storage. Torch
writes through the first in ``nn.Embedding(max_norm=...)`` (it renormalizes the rows it looks
up, in place, in every forward), and users write through the second (``w.data.clamp_(-c, c)``
in a forward, WGAN-style). The shards never saw those writes: the next update started from
the master and the write was gone, so the weights trained away from PyTorch's without a word
(a user's probe: max_norm's rows at norms 1.7-2.6 after one step where torch keeps 1.0).

Every write bumps a version counter: ``p.detach()`` and views share the parameter's, and a
``p.data`` handed out here has its own, which ``data`` keeps. So the hooks record the
versions when a forward or backward begins and compare them when it ends without error; a
parameter written meanwhile is refused by name, with the way that works (a write between
steps, or inside ``gathered_parameters(modify=True)``, whose values are the user's, so they
are not watched and its writes are taken as the new baseline). At more ranks the ranks agree
first, in one small collective at the end of each forward, so a write on one rank only
(``if rank == 0: p.data...``) is refused on every rank instead of leaving the others in a
collective that rank never joins. A forward or backward that raises ends the watch
unchecked. Where the full tensor is the fp32 master itself (one rank, the state in memory: a
zero-copy group whose training copy is the master), the write reached the values and trains
as in PyTorch, so those are not watched.
Cost: one read of a version counter per watched parameter at each forward's start and end
(2,000 parameters: about 2 ms on a loaded 2-core host, measured by a reviewer, before the
watched ones were sorted out once instead of at every start).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch._C import DisableTorchFunctionSubclass

from outcore.errors import ParamAccessError
from outcore.zero.state import USER_OWNED
from outcore.zero.untraced import tracer_active, untraced

if TYPE_CHECKING:
    from outcore.zero.param import ShardedParam


def _lost(sp: ShardedParam) -> bool:
    """Whether a write into ``sp``'s shown tensor misses its values (see the note)."""
    g = sp.group
    return not (g is not None and g.zero_copy
                and (sp.master_shard is None or sp.compute_shard is sp.master_shard))


def data(sp: ShardedParam, param: torch.Tensor) -> torch.Tensor:
    """``param.data`` as torch keeps it, for the caller; remembered by the runtime's watch
    while a forward or backward runs (see the note)."""
    watch: WriteWatch | None = sp.rt.write_watch
    if watch is not None:
        return watch.data(sp, param)
    with DisableTorchFunctionSubclass():
        return param.data


# [Note: a forward on some ranks only]
# ``if rank == 0: model(x)`` (samples, a metric: what DDP allows) pairs that rank's gathers
# with the other ranks' next forward, which gather the same layers, so nothing failed where
# it happened: the ranks ran on out of step until two collectives of different sizes met (a
# hang, or gloo's error about sizes, far from the cause). The collective that ends every
# forward (see the note above) also carries what ended and the grad mode: a forward under
# no_grad on one rank against a training forward, or a backward, on another is refused on
# every rank at once, naming the cause. A forward on some ranks only that meets a forward of
# the same kind on the others is not found here.
_ENDS = {"forward": 1, "backward": 2, "gathered": 3}


def _said(where: int, grad: int) -> str:
    what = {1: "a forward", 2: "a backward", 3: "gathered_parameters()"}[where]
    return what + (" with gradients" if grad else " under torch.no_grad()") * (where == 1)


class WriteWatch:
    """The version of each watched parameter when the engine's forward or backward began."""

    def __init__(self, params: Iterable[ShardedParam], every: bool = False) -> None:
        """``every``: watch each of ``params``, as ``gathered_parameters(modify=False)``
        does, whose shown copies are discarded whatever the tier."""
        self._params = [weakref.ref(sp) for sp in params]
        self._every = every
        self._watched: list[weakref.ref[ShardedParam]] | None = None  # those _lost, once
        self._begun: list[tuple[weakref.ref[ShardedParam], int]] = []
        # strongly: torch hands the caller another tensor object over the same storage and
        # version counter, so this one is held to the check (an alias; storage is freed apart)
        self._handed: list[tuple[weakref.ref[ShardedParam], torch.Tensor]] = []

    def begin(self) -> None:
        """A forward or backward starts: remember every watched parameter's version."""
        self._handed = []
        if self._watched is None:  # a group's tiers are fixed once built: sorted out once
            self._watched = [ref for ref in self._params
                             if (sp := ref()) is not None and self._lost(sp)]
        with DisableTorchFunctionSubclass():
            self._begun = [(ref, sp.param._version) for ref in self._watched
                           if (sp := ref()) is not None and sp.alive]

    def data(self, sp: ShardedParam, param: torch.Tensor) -> torch.Tensor:
        """``param.data`` as torch keeps it, for the caller; remembered while a forward or
        backward runs."""
        with DisableTorchFunctionSubclass():
            data = param.data
        if self._begun and self._lost(sp) and (self._every or sp.state not in USER_OWNED):
            self._handed.append((weakref.ref(sp), data))
        return data

    def rebase(self, params: Iterable[ShardedParam]) -> None:
        """``params`` were written by the user's own means (``gathered_parameters``, which
        writes them back or refuses): their versions now are the baseline."""
        mine = {id(sp) for sp in params}
        with DisableTorchFunctionSubclass():
            self._begun = [(ref, sp.param._version if id(sp) in mine else v)
                           for ref, v in self._begun if (sp := ref()) is not None]

    def _lost(self, sp: ShardedParam) -> bool:
        return self._every or _lost(sp)

    def written(self) -> list[ShardedParam]:
        """The watched parameters written since ``begin``; the watch ends."""
        begun, handed, self._begun, self._handed = self._begun, self._handed, [], []
        with DisableTorchFunctionSubclass():
            written = [sp for ref, v in begun if (sp := ref()) is not None
                       and sp.alive and sp.param._version != v]
            return written + [sp for ref, t in handed
                              if (sp := ref()) is not None and t._version > 0]

    def end(self) -> None:
        """A forward or backward ended without a check (it raised): the watch ends."""
        self._begun, self._handed = [], []

    def written_anywhere(self, comm: Any, where: str = "gathered") -> list[ShardedParam] | None:
        """``written()``, and whether any rank wrote (None: another rank did, this one not);
        at more ranks a collective, so every rank answers alike (see the note). The same
        collective checks that every rank ended the same ``where``, in the same grad mode
        ([Note: a forward on some ranks only])."""
        written = self.written()
        if comm.world_size == 1:
            return written
        ended = (_ENDS[where], int(torch.is_grad_enabled() and where == "forward"))
        # a forward torch.export traces (inside gathered_parameters at more ranks) agrees on
        # real numbers: outside the tracer, as the fetches run (untraced.py's note)
        with untraced() if tracer_active() else contextlib.nullcontext():
            wrote, *same, same_groups = comm.alike([int(bool(written)), *ended,
                                                    comm.take_sequence()])
        if not all(same):
            raise ParamAccessError(
                f"the ranks are out of step: this rank (rank {comm.rank}) ended "
                f"{_said(*ended)}, another rank something else at the same point. Every rank "
                "runs the same forwards and backwards, in the same order: each layer is "
                "gathered from every rank's shards. A forward on some ranks only (`if rank "
                "== 0: model(x)` for samples or a metric) must run on every rank; the others "
                "may discard its output")
        if not same_groups:  # comm.py's [Note: the ranks' collectives are compared]
            raise ParamAccessError(
                f"the ranks ran different modules in this {where}: each "
                "module's parameters are gathered (and its gradients reduced) with every rank in "
                "turn, so every rank must run the same modules, in the same order and number "
                "(an expert chosen by each rank's own tokens, blocks in another order, a head "
                "or loss on some ranks only break this). Run every module on every rank: call "
                "each expert even with no tokens, multiply a loss term by 0 where it is unwanted")
        return None if not wrote and not written else written

    def check(self, where: str, comm: Any) -> None:
        """The forward or backward ended: refuse a parameter written meanwhile."""
        written = self.written_anywhere(comm, where)
        if written is None:
            raise ParamAccessError(f"another rank wrote a parameter in place inside the "
                                   f"engine's {where}, through p.detach() or p.data; see "
                                   "its error")
        if written:
            raise ParamAccessError(
                f"parameter {written[0].label()} was written in place inside the engine's "
                f"{where}, through p.detach() or p.data (nn.Embedding(max_norm=...) "
                "renormalizes its weight this way): there its full tensor is a temporary "
                "gathered for compute, so the write never reached the fp32 master and would "
                "be lost at the next update. Write it between steps (outcore sends the "
                "values to the shards) or inside engine.gathered_parameters([p], "
                "modify=True); for max_norm, set it to None and renormalize between steps")
