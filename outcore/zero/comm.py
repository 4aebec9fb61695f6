"""Collectives over ``torch.distributed``, with world size 1 as a first-class case.

[Note: why all-gather, not broadcast]
ZeRO-Infinity's bandwidth-centric partitioning splits *every* parameter across all ranks
and rebuilds it with an all-gather, so each rank moves 1/W of the bytes over its own link to
its own tier, in parallel. Broadcasting each parameter from an owner rank would funnel every
byte through one link. So this module offers all-gather and reduce-scatter, never broadcast.

A world of one needs no process group: the collectives become copies and the engine runs
without ``torchrun``.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from outcore.errors import CommError, ConfigError


class _Failed:
    """Turns a collective's failure into one clear error naming the likely cause."""

    def __init__(self, comm: Comm, what: str) -> None:
        self.comm, self.what = comm, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, tb) -> None:
        if err is not None:
            self.comm.failed = True
        if err is not None and isinstance(err, RuntimeError) and not isinstance(err, CommError):
            raise CommError(
                f"rank {self.comm.rank}/{self.comm.world_size}: {self.what} failed; another rank "
                f"probably died or stopped answering (comm.timeout_s={self.comm.timeout_s:g}). "
                f"Cause: {str(err).splitlines()[0][:300]}") from None


class _Work:
    """An async collective whose ``wait()`` reports failure as a CommError."""

    def __init__(self, comm: Comm, work, what: str) -> None:
        self._comm, self._work, self._what = comm, work, what

    def wait(self) -> bool:
        with _Failed(self._comm, self._what):
            return self._work.wait()


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

    @classmethod
    def from_env(cls, backend: str, timeout_s: float) -> Comm:
        """Join the process group ``torchrun`` describes, or run alone without one."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), timeout_s)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls(0, 1, timeout_s)
        for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
            if key not in os.environ:
                raise ConfigError(f"WORLD_SIZE={world} but {key} is not set; start with torchrun")
        comm = cls(int(os.environ["RANK"]), world, timeout_s)
        with _Failed(comm, "joining the process group"):
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        return cls(dist.get_rank(), dist.get_world_size(), timeout_s)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """``out`` (W*n) receives every rank's ``shard`` (n), rank-major."""
        if self.world_size == 1:
            out.copy_(shard)
            return _Done()
        with _Failed(self, "all-gather"):
            work = dist.all_gather_single(out, shard, async_op=async_op)
        return _Work(self, work, "all-gather") if async_op else _Done()

    def reduce_scatter_sum(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        """``out`` (n) receives the sum over ranks of this rank's slice of ``full`` (W*n)."""
        if self.world_size == 1:
            out.copy_(full)
            return _Done()
        with _Failed(self, "reduce-scatter"):
            work = dist.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, async_op=async_op)
        return _Work(self, work, "reduce-scatter") if async_op else _Done()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks in place (a host tensor travels through the device on NCCL)."""
        return self._all_reduce(t, dist.ReduceOp.SUM)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """Maximum of ``t`` over ranks in place, as ``all_reduce_sum``."""
        return self._all_reduce(t, dist.ReduceOp.MAX)

    def _all_reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        if self.world_size == 1:
            return t
        # NCCL reduces device memory only; the small host flags and norms outcore reduces
        # (overflow, gradient norm, loss for the log) take a round trip through the device
        wire = t
        if t.device.type == "cpu" and dist.get_backend() == "nccl":
            wire = t.to(torch.device("cuda", torch.cuda.current_device()))
        with _Failed(self, "all-reduce"):
            dist.all_reduce(wire, op=op)
        if wire is not t:
            t.copy_(wire)
        return t

    def barrier(self) -> None:
        if self.world_size > 1:
            with _Failed(self, "barrier"):
                dist.barrier()
