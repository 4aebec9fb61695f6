"""Joining the process group: where a rank learns its rank and world size.

Kept apart from the collectives (comm.py) because it runs once per process, before any
engine exists (``outcore train`` joins to take its folder lock), and because its failures
are about the launch (``torchrun``'s variables), not about a collective in flight.
"""

from __future__ import annotations

import atexit
import datetime
import os
import time

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
        comm = Comm(dist.get_rank(), dist.get_world_size(), timeout_s)
        _settle_at_exit(comm)
        return comm
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Comm(0, 1, timeout_s)
    for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise ConfigError(f"WORLD_SIZE={world} but {key} is not set; start with torchrun")
    comm = Comm(int(os.environ["RANK"]), world, timeout_s)
    with NamedFailure(comm, "joining the process group"):
        _init_group(backend, datetime.timedelta(seconds=timeout_s))
    comm = Comm(dist.get_rank(), dist.get_world_size(), timeout_s)
    _settle_at_exit(comm)
    return comm


_joins = 0  # process groups this process made: each rendezvous gets keys of its own


def _init_group(backend: str, timeout: datetime.timedelta) -> None:
    """``init_process_group`` from torchrun's variables, under a store prefix of its own.

    [Note: a process group made again after the user destroyed one]
    A script that makes its own process group, trains, calls ``destroy_process_group()`` and
    then starts another engine has outcore make the group again. Under torchrun the store
    is the launcher's and outlives the group, and torch names the new default group as it
    named the first, so the new rendezvous finds the first one's keys: a user's probe at 2
    ranks hung in 2 of 6 runs (rank 0 through the rendezvous and waiting in the first
    collective, rank 1 still connecting), and 2 of 6 again here. So every group outcore makes
    rendezvouses under a prefix that counts the groups this process made; every rank makes
    the same groups in the same order (each is a collective), so the ranks' prefixes agree."""
    global _joins
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    _joins += 1
    dist.init_process_group(backend, store=dist.PrefixStore(f"outcore-join-{_joins}", store),
                            rank=rank, world_size=world, timeout=timeout)


# how long the interpreter waits at exit, without the GIL, for gloo's workers
SETTLE_S = 0.05
_settling = False


def _settle_at_exit(comm: Comm) -> None:
    """[Note: gloo's workers need the GIL once more after the last collective]
    A 2-rank torchrun script that trained, closed its engine and ended died at interpreter
    exit in about half of the runs: SIGABRT, "terminate called without an active exception",
    torchrun exiting 1 after the script had printed its last line. Under gdb (2026-11-28) the
    aborting thread is gloo's ``pt_gloo_runloop``: a collective has finished, the rank's
    ``wait()`` has returned and dropped its handle, and the worker then drops the last
    reference to the finished work. Its tensors have Python objects, so their release takes
    the GIL; by then the main thread is finalizing the interpreter, which ends any thread
    that asks for the GIL with ``pthread_exit``, and that forced unwind through a destructor
    is ``std::terminate``. Destroying the process group does not help (the worker still
    holds the work: with an atexit ``destroy_process_group`` the script aborted 3 in 8), and a
    collective at exit could hang on a rank that died. What helps is giving the GIL away
    while the interpreter is still whole: at exit the main thread sleeps ``SETTLE_S``, the
    worker takes the GIL, releases the tensors and returns to its queue. 12 runs of the
    script aborted 0 times with a 20 ms sleep, against 4 of 8 without (the same machine, the
    same hour); 50 ms leaves room for a loaded host, though not a guarantee: a worker kept
    off the CPU longer than that still loses the race. (Holding the tensors in Python would
    not help: it is the worker's reference to them that needs the GIL.) Registered once a
    process, at more than one rank only, so a single-rank run never waits."""
    global _settling
    if comm.world_size > 1 and not _settling:
        _settling = True
        atexit.register(time.sleep, SETTLE_S)
