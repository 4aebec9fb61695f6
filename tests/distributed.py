"""Run a function on W gloo ranks in fresh processes and collect what each returns.

Each rank is a spawned process with the environment ``torchrun`` would give it, so outcore
joins the process group exactly as in a real run. A rank that raises fails the test with its
traceback; a world that does not finish within ``timeout`` is killed and fails (never hangs).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plain(value: Any) -> Any:
    """Tensors cross the queue as numpy copies (torch would send shared-memory handles that
    die with the rank's process)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().float().numpy().copy()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, queue: mp.Queue,
           args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        queue.put((rank, True, _plain(fn(*args))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180) -> list[Any]:
    """Return ``[fn(*args) on rank 0, ..., on rank world-1]``; world 1 runs in-process too."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, queue, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, ok, value = queue.get(timeout=timeout)
            (results.__setitem__(rank, value) if ok else errors.append(f"rank {rank}:\n{value}"))
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
