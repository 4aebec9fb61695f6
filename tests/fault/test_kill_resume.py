"""`outcore train` killed with SIGKILL at any moment resumes with exactly the same losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import outcore
from outcore.offload.stale import remove_stale_swap
from tests.distributed import world_env
from tests.fault.processes import kill_job

STEPS = 8


def _cmd(world: int, out: Path, data: Path, resume: bool) -> list[str]:
    train = ["train", "--model", "tiny", "--dtype", "fp32", "--data", str(data), "--out",
             str(out), "--steps", str(STEPS), "--save-every", "2", "--batch", "2", "--seq", "32",
             "--offload", "nvme", "--seed", "3"] + (["--resume"] if resume else [])
    if world == 1:
        return [sys.executable, "-m", "outcore", *train]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={world}", "-m", "outcore", *train]


def _losses(out: Path) -> dict[int, float]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return {r["step"]: r["loss"] for r in rows}


def _run(cmd: list[str], kill_at_step: int | None, timeout: float = 240) -> int | None:
    """Run ``cmd``; with ``kill_at_step``, SIGKILL its whole process group once the metrics
    show that step (mid-run, often mid-checkpoint). Returns the exit code (None if killed)."""
    world = next((int(a.split("=")[1]) for a in cmd if a.startswith("--nproc_per_node=")), 1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **world_env(world)}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, env=env)
    out = Path(cmd[cmd.index("--out") + 1])
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if kill_at_step is not None and max(_losses(out), default=0) >= kill_at_step:
            kill_job(proc)  # torchrun's workers too: they live in sessions of their own
            return None
        time.sleep(0.05)
    if proc.poll() is None:
        kill_job(proc)
        pytest.fail(f"{cmd} did not finish in {timeout} s")
    if proc.returncode != 0:
        pytest.fail(f"{cmd} failed:\n{proc.stderr.read().decode()[-2000:]}")
    return proc.returncode


@pytest.mark.parametrize("world", [1, 2])
def test_sigkill_then_resume_reproduces_the_uninterrupted_losses(world: int,
                                                                 tmp_path: Path) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text(Path(outcore.__file__).read_text() * 3)
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    _run(_cmd(world, ref, data, False), None)
    expected = _losses(ref)
    assert sorted(expected) == list(range(1, STEPS + 1))
    # killed twice: once just after a checkpoint boundary, once later in the run
    assert _run(_cmd(world, cut, data, False), kill_at_step=3) is None
    assert _run(_cmd(world, cut, data, True), kill_at_step=6) is None
    latest = outcore.latest_checkpoint(cut / "checkpoints")
    assert latest is not None and not latest.name.endswith(".partial")
    _run(_cmd(world, cut, data, True), None)
    assert _losses(cut) == expected
    # the killed runs' swap folders were swept by the runs after them
    assert not list((cut / "swap").glob("outcore-*"))


def test_only_dead_runs_swap_folders_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / "outcore-999999999-0123abcd"
    dead.mkdir()
    (dead / "rank0.swap").write_bytes(b"x")
    alive = tmp_path / f"outcore-{os.getpid()}-0123abcd"
    alive.mkdir()
    (alive / "rank0.swap").write_bytes(b"x")
    foreign = tmp_path / "outcore-999999998-0123abcd"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a swap file")
    other = tmp_path / "mydata"
    other.mkdir()
    assert remove_stale_swap(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, foreign.name,
                                                                 "mydata"])
