"""Two runs, one path: a second run on a folder in use is refused at once, naming the holder;
a killed holder frees it at once; ranks of one torchrun job share it; runs sharing one
``nvme_path`` never touch each other's swap (guard/lock.py, offload/stale.py)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import outcore
from outcore.guard.lock import LOCK_NAME
from outcore.offload.nvme import MADE_MARK
from outcore.offload.stale import remove_stale_swap
from tests.distributed import require_world, run_world, world_env
from tests.fault.processes import kill_job, signal_job

HOLDER_STEPS = 100_000  # the holder never finishes: the test stops it, then kills it


def _train(out: Path, data: Path, steps: int, world: int = 1, nvme: Path | None = None,
           launcher: tuple[str, ...] = ()) -> list[str]:
    job = ["train", "--model", "tiny", "--dtype", "fp32", "--data", str(data), "--out",
           str(out), "--steps", str(steps), "--save-every", "1", "--batch", "2", "--seq", "32",
           "--offload", "nvme"] + (["--nvme-path", str(nvme)] if nvme else [])
    if world == 1:
        return [sys.executable, "-m", "outcore", *job]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={world}", *launcher, "-m", "outcore", *job]


_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _env(cmd: list[str]) -> dict[str, str]:
    world = next((int(a.split("=")[1]) for a in cmd if a.startswith("--nproc_per_node=")), 1)
    return {**_ENV, **world_env(world)}


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as err:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=_env(cmd),
                                start_new_session=True)


def _finish(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(cmd), timeout=timeout)


def _wait_until(what: str, ready, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_job(proc)
            pytest.fail(f"waiting for {what}: the holder ended or took too long:\n"
                        + log.read_text()[-2000:])
        time.sleep(0.1)


def _steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(x)["step"] for x in lines if x.endswith("}")), default=0)


def _holder_pid(folder: Path) -> int:
    return json.loads((folder / LOCK_NAME).read_text())["pid"]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    data = tmp_path / "corpus.txt"
    data.write_text(Path(outcore.__file__).read_text() * 3)
    return data


def test_second_run_is_refused_at_once_and_a_killed_holder_frees_the_folder(
        tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "run"
    holder = _start(_train(out, corpus, HOLDER_STEPS), tmp_path / "holder.log")
    _wait_until("step 1", lambda: _steps(out) >= 1, holder, tmp_path / "holder.log")
    signal_job(holder, signal.SIGSTOP)  # keeps its lock and swap; frees the cores
    try:
        second = _finish(_train(out, corpus, 1))
        swap_after = sorted(p.name for p in (out / "swap").iterdir() if p.name != MADE_MARK)
    finally:
        kill_job(holder)
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 1 and len(lines) == 1, second.stderr
    assert lines[0].startswith("outcore train: error: ")
    assert f"{out} is in use by another run: pid {holder.pid} on host {socket.gethostname()} " \
           "(outcore train, since " in lines[0]
    assert "give another --out" in lines[0]
    # refused before building the model: only the holder's swap folder was there
    assert [n.split("-")[1] for n in swap_after] == [str(holder.pid)]
    # SIGKILL dropped the lock with the process: the folder is usable at once (its
    # checkpoints are the killed run's, so going on there means resuming it)
    third = _finish([*_train(out, corpus, 1), "--resume"])
    assert third.returncode == 0, third.stderr[-2000:]
    assert "removed" in third.stderr and str(holder.pid) in third.stderr  # the dead run's swap
    assert not (out / "swap").exists() and not (out / LOCK_NAME).exists()  # made, emptied


def test_ranks_of_one_torchrun_job_share_the_folder_and_a_second_job_is_refused_on_every_rank(
        tmp_path: Path, corpus: Path) -> None:
    out, logs = tmp_path / "run", tmp_path / "logs"
    holder = _start(_train(out, corpus, HOLDER_STEPS, world=2), tmp_path / "holder.log")
    # both ranks of the holder train and write checkpoints into the folder they share
    _wait_until("a checkpoint", lambda: outcore.latest_checkpoint(out / "checkpoints"),
                holder, tmp_path / "holder.log")
    signal_job(holder, signal.SIGSTOP)
    try:
        pid = _holder_pid(out)
        second = _finish(_train(out, corpus, 1, world=2,
                                launcher=("--redirects", "2", "--log-dir", str(logs))))
    finally:
        kill_job(holder)
    assert second.returncode != 0
    # each rank refused by itself: none was left waiting in a collective (the launcher may
    # still SIGTERM a rank that is slower to exit after its refusal than the other)
    for rank in (0, 1):
        (err,) = logs.glob(f"*/attempt_0/{rank}/stderr.log")
        text = err.read_text()
        assert text.count(f"{out} is in use by another run: pid {pid} on host ") == 1, text
        assert "rank 0 of 2" in text


def _second_engine(root: str) -> list[str]:
    """A rank of another job: refused on save and on load while the test's engine holds the
    root; saves once the holder has closed its engine."""
    rank, root_p = int(os.environ["RANK"]), Path(root)
    torch.manual_seed(0)  # the same model on every rank, as initialize requires
    engine = outcore.initialize(torch.nn.Linear(4, 4), outcore.Config(dtype="fp32"))
    refusals = []
    for act in (lambda: engine.save_checkpoint(root_p / "step-2"),
                lambda: engine.load_checkpoint(root_p / "step-1")):
        with pytest.raises(outcore.FolderInUseError) as err:
            act()
        refusals.append(str(err.value))
    (root_p.parent / f"refused-{rank}").touch()
    deadline = time.monotonic() + 60
    while not (root_p.parent / "released").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    engine.save_checkpoint(root_p / "step-2")
    engine.close()
    return refusals


def test_engines_of_two_processes_cannot_share_a_checkpoint_root(tmp_path: Path) -> None:
    require_world(2)  # here: a skip inside the thread below would read as a failed job
    root = tmp_path / "ckpt"
    engine = outcore.initialize(torch.nn.Linear(4, 4), outcore.Config(dtype="fp32"))
    engine.save_checkpoint(root / "step-1")
    result: list = []
    world = threading.Thread(target=lambda: result.append(run_world(_second_engine, 2,
                                                                    str(root), timeout=90)))
    world.start()
    deadline = time.monotonic() + 90
    while not all((tmp_path / f"refused-{r}").exists() for r in (0, 1)):
        assert world.is_alive() and time.monotonic() < deadline, "the second job failed"
        time.sleep(0.05)
    engine.close()  # gives the root back
    (tmp_path / "released").touch()
    world.join()
    assert result, "the second job failed (its traceback is above)"
    for refusals in result[0]:
        for text in refusals:
            assert text.startswith(f"{root} is in use by another run: pid {os.getpid()} on ")
            assert "(checkpoints of an outcore Engine, since " in text
            assert text.endswith("wait for it to finish, or save somewhere else")
    assert outcore.latest_checkpoint(root) == root / "step-2"
    assert json.loads((root / "step-2" / "manifest.json").read_text())["world_size"] == 2
    assert not (root / LOCK_NAME).exists()


def test_runs_sharing_an_nvme_path_keep_to_their_own_swap(tmp_path: Path, corpus: Path) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    # a live run whose pid looks dead here (another pid namespace, another host): its swap
    # file is locked; and a run that has just made its folder and not yet its file
    hidden = nvme / "outcore-999999999-0123abcd"
    hidden.mkdir()
    swap = os.open(hidden / "rank0.swap", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(swap, fcntl.LOCK_EX)
    starting = nvme / "outcore-999999998-0123abcd"
    starting.mkdir()
    first_log = tmp_path / "first.log"
    first = _start(_train(tmp_path / "a", corpus, 3, nvme=nvme), first_log)
    mine = f"outcore-{first.pid}-"
    _wait_until("the first run's swap", lambda: _steps(tmp_path / "a") >= 1, first, first_log)
    signal_job(first, signal.SIGSTOP)  # mid-run, its swap in use
    try:
        second = _finish(_train(tmp_path / "b", corpus, 1, nvme=nvme))
        during = sorted(p.name for p in nvme.iterdir())
    finally:
        signal_job(first, signal.SIGCONT)
    assert first.wait(timeout=120) == 0, first_log.read_text()[-2000:]
    assert second.returncode == 0, second.stderr[-2000:]
    assert len(during) == 3 and any(n.startswith(mine) for n in during), during
    for log in (first_log.read_text(), second.stderr):
        assert "removed" not in log and "could not remove" not in log
    assert sorted(p.name for p in nvme.iterdir()) == [starting.name, hidden.name]
    os.close(swap)  # that run ends; the next sweep takes its swap (and the old empty folder)
    os.utime(starting, (time.time() - 3600, time.time() - 3600))
    assert sorted(remove_stale_swap(nvme)) == [starting, hidden]


def test_a_lock_whose_holder_note_cannot_be_written_still_serves_its_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a full filesystem the note of who holds a checkpoint root failed after the lock was
    taken: the descriptor stayed locked and unrecorded, so this engine's next save, once
    space was freed, was refused as "in use by another run" (a probe on a full tmpfs)."""
    from outcore.guard import lock

    def full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lock, "_write_holder", full)
    engine = outcore.initialize(torch.nn.Linear(4, 4), {"dtype": "fp32"})
    engine.save_checkpoint(tmp_path / "ck" / "step-1")
    monkeypatch.undo()
    engine.save_checkpoint(tmp_path / "ck" / "step-2")  # was FolderInUseError
    engine.close()
    fd = os.open(tmp_path / "ck" / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:  # nothing of this process holds it any more
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
