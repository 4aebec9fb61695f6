"""Collectives over ``torch.distributed``, with world size 1 as a first-class case.

[Note: why all-gather, not broadcast]
ZeRO-Infinity's bandwidth-centric partitioning splits *every* parameter across all ranks
and rebuilds it with an all-gather, so each rank moves 1/W of the bytes over its own link to
its own tier, in parallel. Broadcasting each parameter from an owner rank would funnel every
byte through one link. So this module offers all-gather and reduce-scatter, never broadcast.

A world of one needs no process group: the collectives become copies and the engine runs
without ``torchrun``. Joining the process group is bootstrap.py's; packing a group's
parameters for these collectives is zero/collectives.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from outcore.errors import CommError


class Handle(Protocol):
    """A collective started with ``async_op=True``: ``wait()`` returns once it has finished."""

    def wait(self) -> bool: ...


class NamedFailure:
    """Turns a collective's failure into one clear error naming the likely cause, and runs
    the collective past torch function modes: outcore's collectives move its own data, and a
    mode that sees them (``torch.export``'s, tracing a forward inside ``gathered_parameters``)
    recorded one into its graph and waited there for ranks that never join."""

    def __init__(self, comm: Comm, what: str) -> None:
        self.comm, self.what = comm, what
        self._plain = torch._C.DisableTorchFunction()

    def __enter__(self) -> None:
        self._plain.__enter__()

    def __exit__(self, kind, err, tb) -> None:
        self._plain.__exit__(kind, err, tb)
        if err is not None:
            self.comm.failed = True
        if err is not None and isinstance(err, RuntimeError) and not isinstance(err, CommError):
            raise CommError(
                f"rank {self.comm.rank}/{self.comm.world_size}: {self.what} failed; another rank "
                f"probably died or stopped answering (comm.timeout_s={self.comm.timeout_s:g}), "
                "or is in another call: every rank must make the same outcore calls in the same "
                "order (each forward, backward, step, save/load_checkpoint, close). "
                f"Cause: {str(err).splitlines()[0][:300]}") from None


class _Work:
    """An async collective whose ``wait()`` reports failure as a CommError."""

    def __init__(self, comm: Comm, work, what: str) -> None:
        self._comm, self._work, self._what = comm, work, what

    def wait(self) -> bool:
        with NamedFailure(self._comm, self._what):
            return self._work.wait()


# torch 2.13 names the flat collectives ``*_single``; the torch 2.8 to 2.12 that pyproject.toml
# accepts have them only as ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (same
# arguments; 2.13 keeps those as aliases too)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_BITS_62 = (1 << 62) - 1


class _Done:
    """Handle of a collective that already finished (world size 1)."""

    def wait(self) -> bool:
        return True


@dataclass
class Comm:
    """Rank, world size and the collectives outcore uses."""

    rank: int = 0
    world_size: int = 1
    timeout_s: float = 600.0
    failed: bool = False  # a collective failed: the group cannot be trusted any more
    # which groups this rank gathered and reduced, in order, since the phase began (note)
    sequence: int = 0

    def note(self, key: int) -> None:
        """Fold a group's collective (``key``: which group, which kind) into ``sequence``.

        [Note: the ranks' collectives are compared]
        A group's all-gather and reduce-scatter carry no name: each rank runs them in the
        order its own forward and backward reach them. Where control flow differs between
        ranks (an expert chosen by each rank's own tokens, blocks in another order, a head on
        one rank only), two ranks on different groups of one size exchanged each other's
        shards: layers built from another layer's halves, gradients summed into the wrong
        parameters, silently (groups of different sizes made gloo abort; one with no partner
        waited for ``comm.timeout_s``). So each rank folds the groups it gathers and reduces
        into an ordered digest, and the collective that already ends every forward and
        backward (forward_writes.py's ``written_anywhere``) compares it: a difference is
        refused on every rank, before ``step()`` (updates that run during backward, with the
        state on NVMe, have been applied by then)."""
        if self.world_size > 1:
            self.sequence = (self.sequence * 1_000_003 + key + 1) & _BITS_62

    def take_sequence(self) -> int:
        """``sequence`` so far; it starts over."""
        value, self.sequence = self.sequence, 0
        return value

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor,
                   async_op: bool = False) -> Handle:
        """``out`` (W*n) receives every rank's ``shard`` (n), rank-major."""
        if self.world_size == 1:
            out.copy_(shard)
            return _Done()
        with NamedFailure(self, "all-gather"):
            work = _ALL_GATHER(out, shard, async_op=async_op)
        return _Work(self, work, "all-gather") if async_op else _Done()

    def reduce_scatter_sum(self, out: torch.Tensor, full: torch.Tensor,
                           async_op: bool = False) -> Handle:
        """``out`` (n) receives the sum over ranks of this rank's slice of ``full`` (W*n)."""
        if self.world_size == 1:
            out.copy_(full)
            return _Done()
        with NamedFailure(self, "reduce-scatter"):
            work = _REDUCE_SCATTER(out, full, op=dist.ReduceOp.SUM, async_op=async_op)
        return _Work(self, work, "reduce-scatter") if async_op else _Done()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks in place (a host tensor travels through the device on NCCL)."""
        return self._all_reduce(t, dist.ReduceOp.SUM)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """Maximum of ``t`` over ranks in place, as ``all_reduce_sum``."""
        return self._all_reduce(t, dist.ReduceOp.MAX)

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Rank ``src``'s ``t`` on every rank, in place, as ``all_reduce_sum``."""
        return self._collective(t, "broadcast", lambda wire: dist.broadcast(wire, src=src))

    def _all_reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        return self._collective(t, "all-reduce", lambda wire: dist.all_reduce(wire, op=op))

    def _collective(self, t: torch.Tensor, what: str,
                    run: Callable[[torch.Tensor], object]) -> torch.Tensor:
        if self.world_size == 1:
            return t
        # NCCL reduces device memory only; the small host flags and norms outcore reduces
        # (overflow, gradient norm, loss for the log) take a round trip through the device
        wire = t
        if t.device.type == "cpu" and dist.get_backend() == "nccl":
            wire = t.to(torch.device("cuda", torch.cuda.current_device()))
        with NamedFailure(self, what):
            run(wire)
        if wire is not t:
            t.copy_(wire)
        return t

    def alike(self, values: list[int]) -> list[bool]:
        """Whether each of ``values`` (digests, flags) is the same on every rank: the largest
        and the negated smallest over the ranks in one collective, so every rank gets the
        same answer and a refusal happens on all of them together. Values are cut to 62 bits
        (a digest's collisions stay negligible) so that they and their negation fit int64."""
        if self.world_size == 1:
            return [True] * len(values)
        mine = torch.tensor([v & _BITS_62 for v in values], dtype=torch.int64)
        spread = self.all_reduce_max(torch.cat([mine, -mine]))
        return (spread[:len(values)] == -spread[len(values):]).tolist()

    def any_failed(self, failed: bool) -> bool:
        """Whether ``failed`` holds on any rank (every rank gets the same answer, in one small
        collective): a refusal on one rank is then a refusal on all, and no rank waits alone
        in a later collective."""
        same = self.alike([int(failed)])[0]  # first: every rank joins the collective
        return failed or not same

    def raise_together(self, error: BaseException | None, elsewhere: BaseException) -> None:
        """Raise ``error`` on this rank, or ``elsewhere`` (saying another rank refused) where
        only another rank has one: every rank raises, or none does (``any_failed``)."""
        if self.any_failed(error is not None) and error is None:
            error = elsewhere
        if error is not None:
            raise error

    def barrier(self) -> None:
        if self.world_size > 1:
            with NamedFailure(self, "barrier"):
                dist.barrier()
