"""A model in outcore's hands is still a model: every user action, every lifecycle state.

tests/touch_cases.py lists the actions (reads, calls, writes, ``state_dict``, ``repr``,
``pickle``, ``deepcopy``, a penalty term outside the forward ...) and the lifecycle states
(fresh, mid-step, trained, after a forward and after a backward that raised, taken over by a
second engine, reopened after close, inside ``gathered_parameters``, closed). Each
combination runs on outcore's model and on a plain PyTorch copy and must give the same
result and leave the same values
(also one training step later), or be refused with outcore's own error where the table says
so (zero/surface.py's [Note: a sharded parameter answers every call]). The cases of one
(offload, world size) run in one subprocess; a crash loses only the case it was in, which
fails here, and the run continues after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from outcore.device.accel import DEVICE_ENV
from tests.common import REPO
from tests.distributed import WORLDS as STARTED
from tests.distributed import rank_device
from tests.integration import touch_cases

WORLDS = {"none": (1, 2), "cpu": (1, 2), "nvme": (1, 2), "nvme-params": (1,)}
CASE_TIMEOUT_S = 120  # no case takes a second; a hung world is killed after this
ROOT = REPO


def _run_batch(offload: str, world: int, folder: Path, **env: str) -> dict[int, dict]:
    """Run every case, restarting after a crashed one; index -> result row."""
    total = len(touch_cases.cases(world))
    results: dict[int, dict] = {}
    start = 0
    while start < total:
        out = folder / f"part-{start}.jsonl"
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.touch_cases", offload, str(world), str(start),
             str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", DEVICE_ENV: rank_device(world), **env})
        seen, last = 0, time.monotonic()
        while proc.poll() is None:
            time.sleep(0.2)
            n = len(out.read_text().splitlines()) if out.exists() else 0
            if n != seen:
                seen, last = n, time.monotonic()
            elif time.monotonic() - last > CASE_TIMEOUT_S:
                os.killpg(proc.pid, 9)
                proc.wait()
        tail = proc.stdout.read().decode(errors="replace")[-3000:]
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        for row in rows:
            results[row["index"]] = row
        done = max((row["index"] for row in rows), default=start - 1)
        if done + 1 >= total:
            break
        crashed = done + 1
        state, action, want = touch_cases.cases(world)[crashed]
        results[crashed] = {"state": state, "action": action, "want": want,
                            "verdict": f"the process died (exit {proc.returncode}):\n{tail}"}
        start = crashed + 1
    return results


_BATCHES: dict[tuple[str, int], Future] = {}


@pytest.fixture(scope="module")
def batches(tmp_path_factory: pytest.TempPathFactory):
    """Every (offload, world size) batch, two at a time in the background (each is one or
    two single-threaded processes), started when the first case asks."""
    pool = ThreadPoolExecutor(max_workers=2)

    def start(offload: str, world: int) -> Future:
        device = rank_device(world)
        STARTED[(f"tests/integration/test_model_touch.py ({offload})", world, device)] += 1
        return pool.submit(_run_batch, offload, world,
                           tmp_path_factory.mktemp(f"touch-{offload}-{world}"))

    def get(offload: str, world: int) -> dict[int, dict]:
        device = rank_device(world)
        if (device != os.environ.get(DEVICE_ENV, "cpu")
                and os.environ.get("OUTCORE_TEST_CPU_WORLDS") == "skip"):
            pytest.skip(f"world {world} would run on gloo/CPU under --device cuda; the CPU "
                        "suite runs it (OUTCORE_TEST_CPU_WORLDS=skip)")
        if not _BATCHES:
            for key in [(o, w) for o, worlds in WORLDS.items() for w in worlds]:
                if not (rank_device(key[1]) != os.environ.get(DEVICE_ENV, "cpu")
                        and os.environ.get("OUTCORE_TEST_CPU_WORLDS") == "skip"):
                    _BATCHES[key] = start(*key)
        return _BATCHES[(offload, world)].result()

    yield get
    pool.shutdown(wait=True)


def _params():
    for offload, worlds in WORLDS.items():
        for world in worlds:
            for index, (state, action, want) in enumerate(touch_cases.cases(world)):
                yield pytest.param(offload, world, index,
                                   id=f"{offload}-w{world}-{state}-{action}-{want}")


@pytest.mark.parametrize(("offload", "world", "index"), list(_params()))
def test_action_in_state(batches, offload: str, world: int, index: int) -> None:
    row = batches(offload, world)[index]
    assert row["verdict"] == "ok", (
        f"{row['action']} in state {row['state']} (want {row['want']}): {row['verdict']}\n"
        f"  outcore: {row.get('mine')}\n  plain:   {row.get('theirs')}")


def test_a_crash_fails_its_case_only(tmp_path: Path) -> None:
    """The harness itself: a case that kills its process is reported as such, and every
    case after it still runs."""
    todo = touch_cases.cases(1)
    crash = next(i for i, (state, action, _) in enumerate(todo)
                 if (state, action) == ("trained", "sum"))
    rows = _run_batch("none", 1, tmp_path, OUTCORE_TOUCH_CRASH="trained:sum")
    assert sorted(rows) == list(range(len(todo)))
    assert "the process died (exit -11)" in rows[crash]["verdict"]
    assert all(row["verdict"] == "ok" for i, row in rows.items() if i != crash)
