"""Joining the process group: where a rank learns its rank and world size.

Kept apart from the collectives (comm.py) because it runs once per process, before any
engine exists (``outcore train`` joins to take its folder lock), and because its failures
are about the launch (``torchrun``'s variables), not about a collective in flight.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os

import torch.distributed as dist

from outcore.errors import ConfigError
from outcore.runtime.comm import Comm, NamedFailure


def ranks_on_this_host() -> int:
    """How many ranks share this host's memory (torchrun's ``LOCAL_WORLD_SIZE``; 1 alone)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def join_world(backend: str, timeout_s: float) -> Comm:
    """Join the process group ``torchrun`` describes (or the one already joined), or run
    alone without one when ``WORLD_SIZE`` is absent or 1."""
    if dist.is_available() and dist.is_initialized():
        return Comm(dist.get_rank(), dist.get_world_size(), timeout_s)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Comm(0, 1, timeout_s)
    for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise ConfigError(f"WORLD_SIZE={world} but {key} is not set; start with torchrun")
    comm = Comm(int(os.environ["RANK"]), world, timeout_s)
    with NamedFailure(comm, "joining the process group"):
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    atexit.register(_leave_world, dist.GroupMember.WORLD)
    return Comm(dist.get_rank(), dist.get_world_size(), timeout_s)


def _leave_world(made: object) -> None:
    """[Note: the process group outcore joined is left at exit]
    A script that trains under ``torchrun`` and ends without ``destroy_process_group()``
    (nothing told it to: outcore joined the group) left gloo's threads to the interpreter's
    teardown, and most 2-rank runs then died with "terminate called without an active
    exception" (SIGABRT, 6 of 8 runs; 0 of 8 with the group destroyed). So the group this
    module made is destroyed at exit, unless the script destroyed it, or replaced it, first."""
    if dist.is_initialized() and dist.GroupMember.WORLD is made:
        with contextlib.suppress(Exception):  # at exit: nothing left to report to
            dist.destroy_process_group()
