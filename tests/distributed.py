"""Run a function on W ranks (gloo on the CPU) in fresh processes and collect what each returns.

Each rank is a new process with the environment ``torchrun`` would give it, so outcore
joins the process group exactly as in a real run. A rank that raises fails the test with its
traceback; a world that does not finish within ``timeout`` is killed and fails (never hangs).

[Note: ranks forked from a server that imported torch]
A spawned rank imports torch and outcore anew: about 3 s of CPU per rank on these 2-core
machines, for every world of every test that starts one. The ranks are forked instead from a
``forkserver`` that imported them once and did nothing else (no CUDA), so each starts as a
fresh import would leave it, with two exceptions set right first: what a spawned rank would
inherit from the test at that moment (its environment and working directory) is handed over,
and torch's and Python's random generators, which every fork would share, are seeded anew
(so a rank that forgets to seed still differs from the others, as under torchrun). Python's
string hash seed stays the server's, the same on every rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

WORLDS: Counter[tuple[str, int, str]] = Counter()
"""(test id, world size, device) of every world started: conftest.py's summary reads it."""


def rank_device(world: int) -> str:
    """The compute device ranks of a ``world`` use: the switch's (conftest.py), except that
    a multi-rank world without a GPU per rank runs on the CPU (gloo), as one GPU cannot hold
    two NCCL ranks."""
    chosen = os.environ.get("OUTCORE_DEVICE", "cpu")
    if chosen == "cuda" and world > 1:
        import torch

        return "cuda" if torch.cuda.device_count() >= world else "cpu"
    return chosen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plain(value: Any) -> Any:
    """Tensors cross the queue as numpy copies (torch would send shared-memory handles that
    die with the rank's process)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().float().cpu().numpy().copy()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


_PRELOAD = ["torch", "torch.distributed", "outcore", "tests.distributed"]
_context: Any = None


def _ranks_context() -> Any:
    """The multiprocessing context ranks start from (see the note)."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, queue: mp.Queue,
           args: tuple, device: str, env: dict[str, str], cwd: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
                      OUTCORE_DEVICE=device)
    import random

    import torch
    import torch.distributed as dist

    random.seed()  # a fork shares its server's generators: seeded anew, as a new process
    torch.seed()
    torch.set_num_threads(1)
    if device == "cuda":  # as in this process (conftest.py's note)
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        queue.put((rank, True, _plain(fn(*args))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def require_world(world: int) -> None:
    """Skip the calling test where a ``world``-rank job would fall back to gloo/CPU under
    ``--device cuda`` and ``OUTCORE_TEST_CPU_WORLDS=skip`` asks to leave such worlds to the
    CPU suite. Call it in the test's own thread (a skip in a helper thread kills the thread)."""
    if (rank_device(world) != os.environ.get("OUTCORE_DEVICE", "cpu")
            and os.environ.get("OUTCORE_TEST_CPU_WORLDS") == "skip"):
        import pytest

        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        WORLDS[(test, world, "skipped")] += 1
        pytest.skip(f"world {world} would run on gloo/CPU under --device cuda; the CPU suite "
                    "runs it (OUTCORE_TEST_CPU_WORLDS=skip)")


def world_env(world: int) -> dict[str, str]:
    """Environment additions for a job of ``world`` processes launched by a test (torchrun,
    ``python -m outcore`` per rank): on the CPU where the GPUs are fewer than the ranks, as
    ``run_world`` does. Skips the test as ``require_world`` does."""
    require_world(world)
    if rank_device(world) == "cpu" and os.environ.get("OUTCORE_DEVICE") == "cuda":
        return {"OUTCORE_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    return {}


def run_world(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180) -> list[Any]:
    """Return ``[fn(*args) on rank 0, ..., on rank world-1]``; world 1 runs in-process too."""
    ctx = _ranks_context()
    queue = ctx.Queue()
    port = _free_port()
    device = rank_device(world)
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    require_world(world)
    WORLDS[(test, world, device)] += 1
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, queue, args, device,
                                                 dict(os.environ), os.getcwd()),
                         daemon=True) for r in range(world)]
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
