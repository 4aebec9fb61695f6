"""Preemption: real SIGTERM, SIGUSR1 and SIGINT, sent by the OS to real ``outcore train`` runs
(one rank and two) and to the library context. A preempted run saves its step, removes its
swap, exits 75, and ``--resume`` reproduces the uninterrupted losses bit for bit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import outcore
from outcore.guard.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED
from tests.distributed import _free_port, world_env

STEPS = 8
_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# -- `outcore train` in subprocesses ---------------------------------------------------------
def _start(world: int, out: Path, data: Path, resume: bool = False,
           nohup: bool = False) -> list[subprocess.Popen]:
    """One ``python -m outcore train`` per rank, each given the environment torchrun gives
    (so each rank's own exit code is seen), each in its own session (signals reach one)."""
    argv = [sys.executable, "-m", "outcore", "train", "--model", "tiny", "--dtype", "fp32",
            "--data", str(data), "--out", str(out), "--steps", str(STEPS), "--save-every", "4",
            "--batch", "2", "--seq", "32", "--offload", "nvme", "--seed", "3"]
    argv += ["--resume"] if resume else []
    out.mkdir(parents=True, exist_ok=True)
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = {**_ENV, **world_env(world), **({} if world == 1 else {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
            "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})}
        with (out / f"stderr-rank{rank}.txt").open("ab") as err:
            procs.append(subprocess.Popen(
                argv, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True,
                # what nohup does: the run starts with SIGHUP ignored
                preexec_fn=(lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if nohup
                else None))
    return procs


def _wait(procs: list[subprocess.Popen], timeout: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"outcore train did not finish in {timeout} s")


def _losses(out: Path) -> dict[int, float]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {r["step"]: r["loss"] for r in map(json.loads, filter(None, lines))}


def _wait_for_step(out: Path, step: int, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 120
    while max(_losses(out), default=0) < step:
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            pytest.fail(f"the run ended or stalled before step {step}: "
                        + (out / "stderr-rank0.txt").read_text()[-2000:])
        time.sleep(0.02)


def _last_line(out: Path, rank: int = 0) -> str:
    return (out / f"stderr-rank{rank}.txt").read_text().replace("\r", "\n").splitlines()[-1]


def _stop_saved(out: Path) -> bool:
    latest = outcore.latest_checkpoint(out / "checkpoints")
    return latest is not None and latest.name == f"step-{max(_losses(out)):08d}"


def _check_stopped_cleanly(out: Path, world: int, codes: list[int], code: int = EXIT_PREEMPTED,
                           why: str = "preempted (SIGTERM)") -> int:
    """Every rank exited with ``code`` at one step, whose complete checkpoint is the latest;
    nothing half-written or swapped is left. Returns that step."""
    assert codes == [code] * world, (codes, _last_line(out))
    step = max(_losses(out))
    assert 2 <= step < STEPS
    latest = outcore.latest_checkpoint(out / "checkpoints")
    assert latest == out / "checkpoints" / f"step-{step:08d}"
    man = json.loads((latest / "manifest.json").read_text())
    assert man["global_steps"] == step and man["client_state"]["step"] == step
    assert sorted(man["files"]) == [f"rank{r:05d}-of-{world:05d}.safetensors"
                                    for r in range(world)]
    assert [p.name for p in (out / "checkpoints").iterdir()
            if not p.name.startswith("step-0") or p.name.endswith(".partial")] == []
    assert not list((out / "swap").glob("outcore-*")), "engine.close() removes the swap"
    line = _last_line(out)
    assert line.startswith(f"outcore train: {why} after step {step};"), line
    assert str(latest) in line and "--resume" in line
    return step


def _corpus(tmp_path: Path) -> Path:
    data = tmp_path / "corpus.txt"
    data.write_text(Path(outcore.__file__).read_text() * 3)
    return data


def test_sigterm_to_one_rank_stops_both_at_one_step_and_resume_is_bit_exact(
        tmp_path: Path) -> None:
    data = _corpus(tmp_path)
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    ref_procs, procs = _start(2, ref, data), _start(2, cut, data)
    _wait_for_step(cut, 2, procs)
    # The scheduler's SIGTERM reaches rank 1 only; rank 0 hears of it at the step boundary.
    # Then more, to the same rank: one Ctrl-C (delivered first, as the lower number, yet
    # SIGTERM outranks it: still 75), and SIGTERM every 5 ms until a save is seen under way.
    # None of them may change the outcome. (Signals
    # inside the save itself are sent in-process below: from out here, one sent as the save
    # ends could land after the run restored the default handlers, and kill it.)
    rank1 = procs[1].pid
    os.kill(rank1, signal.SIGTERM)
    os.kill(rank1, signal.SIGINT)
    while not (list((cut / "checkpoints").glob("*.partial")) or _stop_saved(cut)
               or procs[1].poll() is not None):
        os.kill(rank1, signal.SIGTERM)
        time.sleep(0.005)
    step = _check_stopped_cleanly(cut, 2, _wait(procs))
    assert _wait(ref_procs) == [0, 0]
    assert _wait(_start(2, cut, data, resume=True)) == [0, 0]
    assert _losses(cut) == _losses(ref) and sorted(_losses(ref)) == list(range(1, STEPS + 1))
    assert f"resuming at step {step}" in (cut / "stderr-rank0.txt").read_text()


@pytest.mark.parametrize(("sig", "code", "why"), [
    (signal.SIGINT, EXIT_INTERRUPTED, "interrupted (SIGINT)"),
    # SLURM's --signal=USR1@<seconds>: by default SIGUSR1 ends a process at once (no
    # checkpoint, the swap left behind); outcore train saves and exits 75 as for SIGTERM
    (signal.SIGUSR1, EXIT_PREEMPTED, "preempted (SIGUSR1)"),
    # the terminal or SSH session closed: the default action ended the run mid-step, with no
    # checkpoint, its swap and both lock files left behind (found by a user-style probe)
    (signal.SIGHUP, EXIT_PREEMPTED, "preempted (SIGHUP)"),
], ids=["ctrl-c", "sigusr1", "sighup"])
def test_one_signal_finishes_the_step_saves_and_exits(tmp_path: Path, sig: signal.Signals,
                                                      code: int, why: str) -> None:
    out = tmp_path / "run"
    procs = _start(1, out, _corpus(tmp_path))
    _wait_for_step(out, 2, procs)
    os.kill(procs[0].pid, sig)
    _check_stopped_cleanly(out, 1, _wait(procs), code, why)
    said = "press Ctrl-C again to stop at once" in (out / "stderr-rank0.txt").read_text()
    assert said == (sig == signal.SIGINT)


def test_a_run_started_under_nohup_goes_on_through_a_hangup(tmp_path: Path) -> None:
    """``nohup outcore train ...``: the run is meant to outlive its terminal, so SIGHUP stays
    ignored and the run trains to its last step."""
    out = tmp_path / "run"
    procs = _start(1, out, _corpus(tmp_path), nohup=True)
    _wait_for_step(out, 2, procs)
    os.kill(procs[0].pid, signal.SIGHUP)
    assert _wait(procs) == [0]
    assert max(_losses(out)) == STEPS


@pytest.mark.parametrize("command", ["train", "probe"])
def test_sigterm_before_the_loop_removes_the_swap_and_exits_75(tmp_path: Path,
                                                               command: str) -> None:
    """SIGTERM once the swap file exists but before training (the model still building), or
    during ``outcore probe``'s measurement: the default action killed the process there,
    leaving the swap file (623 MB for gpt-125m, 512 MiB for the probe) and the run's lock."""
    out, probe = tmp_path / "run", tmp_path / "probe"
    probe.mkdir()
    argv = ([sys.executable, "-m", "outcore", "train", "--model", "gpt-125m", "--dtype", "fp32",
             "--data", str(_corpus(tmp_path)), "--out", str(out), "--steps", "2", "--batch",
             "1", "--seq", "32", "--offload", "nvme"] if command == "train" else
            [sys.executable, "-m", "outcore", "probe", "--path", str(probe)])
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_ENV,
                            start_new_session=True)
    swap = out / "swap" if command == "train" else probe
    deadline = time.monotonic() + 120
    while not list(swap.glob("outcore-*/*")) and proc.poll() is None:
        assert time.monotonic() < deadline, "no swap file appeared"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.005)
    with contextlib.suppress(ProcessLookupError):  # a repeat, as torchrun forwards one: it
        os.kill(proc.pid, signal.SIGTERM)  # must not cut the clean-up short
    _, err = proc.communicate(timeout=120)
    said = err.decode().strip().splitlines()[-1]
    assert proc.returncode == EXIT_PREEMPTED, said
    assert said == f"outcore {command}: stopped by SIGTERM; nothing more was saved", said
    assert not list(swap.glob("outcore-*")) and not (out / ".outcore-lock").exists()


# -- the library context ---------------------------------------------------------------------
def _deliver(stop: outcore.Preemption, sig: signal.Signals) -> None:
    """Send ``sig`` to this process and wait until the context's handler has run."""
    seen = stop.received
    os.kill(os.getpid(), sig)
    deadline = time.monotonic() + 5
    while stop.received == seen and time.monotonic() < deadline:
        time.sleep(0.001)  # the handler runs in the main thread between bytecodes
    assert stop.received == seen + 1


def _engine() -> outcore.Engine:
    from tests.common import Quirky

    torch.manual_seed(0)
    return outcore.initialize(Quirky(), outcore.Config(dtype="fp32"))


def _train_step(engine: outcore.Engine) -> None:
    from tests.common import VOCAB

    idx = torch.randint(0, VOCAB, (2, 8)).to(engine.device)
    engine.backward(engine(idx, idx))
    engine.step()


def test_context_stops_at_the_boundary_and_lets_the_save_complete(tmp_path: Path) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    engine = _engine()
    with engine, outcore.preemption() as stop:
        _train_step(engine)
        assert not stop.stop_requested(engine) and stop.exit_code == 0
        engine.save_checkpoint(tmp_path / "step-1")
        _train_step(engine)
        _deliver(stop, signal.SIGINT)  # the first Ctrl-C is a request, not an exception
        assert stop.requested and stop.stop_requested(engine)
        assert stop.signal == signal.SIGINT and stop.exit_code == EXIT_INTERRUPTED
        # a second Ctrl-C and a SIGTERM arrive in the middle of the stop's save: both are
        # counted, neither interrupts it (the signals are real; the profiler only times them)
        during_save: list[int] = []

        def in_the_save(frame, event, arg) -> None:  # noqa: ANN001
            if frame.f_code.co_name == "_write_rank_file":
                if event == "call":
                    os.kill(os.getpid(), signal.SIGINT)
                    os.kill(os.getpid(), signal.SIGTERM)
                elif event == "return":
                    during_save.append(stop.received)

        sys.setprofile(in_the_save)
        try:
            engine.save_checkpoint(tmp_path / "step-2")
        finally:
            sys.setprofile(None)
        assert during_save == [3]
        assert stop.stop_requested(engine) and stop.exit_code == EXIT_INTERRUPTED
    assert {s: signal.getsignal(s) for s in before} == before
    assert outcore.latest_checkpoint(tmp_path) == tmp_path / "step-2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]


def test_second_ctrl_c_before_the_boundary_interrupts_at_once() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with pytest.raises(KeyboardInterrupt), outcore.preemption() as stop:
        _deliver(stop, signal.SIGTERM)
        _deliver(stop, signal.SIGTERM)  # a repeated SIGTERM is only counted
        assert stop.signal == signal.SIGTERM and stop.exit_code == EXIT_PREEMPTED
        _deliver(stop, signal.SIGINT)  # the first Ctrl-C: still a request
        os.kill(os.getpid(), signal.SIGINT)  # the second: out at once
        time.sleep(5)
    assert {s: signal.getsignal(s) for s in before} == before
    # SIGTERM only: Ctrl-C stays Python's own
    with outcore.preemption(signals=[signal.SIGTERM]) as stop:
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
        assert not stop.stop_requested()


def test_context_refuses_other_threads() -> None:
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            with outcore.preemption():
                pass
        except RuntimeError as err:
            errors.append(err)

    thread = threading.Thread(target=enter, name="loader")
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in str(errors[0]) and "loader" in str(errors[0])
