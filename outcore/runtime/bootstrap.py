"""Joining the process group: where a rank learns its rank and world size.

Kept apart from the collectives (comm.py) because it runs once per process, before any
engine exists (``outcore train`` joins to take its folder lock), and because its failures
are about the launch (``torchrun``'s variables), not about a collective in flight.
"""

from __future__ import annotations

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
    return Comm(dist.get_rank(), dist.get_world_size(), timeout_s)
