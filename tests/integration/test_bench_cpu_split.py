"""bench/cpu_split.py end to end with the tiny preset: the split names the I/O threads of an
offloaded row, its bytes are the steps' own (not the build's), and the threads' CPU adds up
to the process's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from outcore.app.models import build_model
from tests.common import REPO


def test_cpu_split_names_the_io_threads_and_counts_the_steps_bytes(tmp_path: Path) -> None:
    out = tmp_path / "split.json"
    cmd = [sys.executable, str(REPO / "bench" / "cpu_split.py"), "--row", "nvme+opt", "--model",
           "tiny", "--seq", "64", "--steps", "3", "--warmup", "1", "--dtype", "fp32",
           "--nvme-path", str(tmp_path), "--top", "3", "--phases", "--out", str(out),
           "--perf-ctl", str(tmp_path / "perf-ctl")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    split = json.loads(out.read_text())
    assert "outcore-aio" in split["threads"] and "main" in split["threads"]
    threads = sum(r["user_s"] + r["sys_s"] for r in split["threads"].values())
    assert abs(threads - split["cpu_s"]) <= 0.05 * split["cpu_s"] + 0.05
    # tiny in fp32 with params and optimizer on NVMe: each step writes every parameter's
    # master (which is also its training copy) and its two moments once (extents rounded to
    # 4 KiB); the build's and the warm-up's writes are not counted
    model = build_model("tiny")
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    slack = sum(4096 for _ in model.parameters())
    assert 3 * 3 * nbytes <= split["written_GB"] * 1e9 <= 3 * 3 * (nbytes + slack)
    assert "main thread (tottime" in proc.stdout
    # the three phases tile the measured steps
    phases = split["phases"]
    assert set(phases) == {"forward", "backward", "step"}
    assert abs(sum(d for d, _ in phases.values()) - split["wall_s"]) <= 0.05 * split["wall_s"]
    assert not list(tmp_path.glob("cpu-split-*")), "the swap folder is removed"
    # peak RSS over the measured steps only: at least the tiny model's parameters, far less
    # than the interpreter's peak with torch imported and the model built
    assert nbytes < split["peak_rss_bytes"] < 8 * 2**30
    # perf's control commands frame the measured steps (a FIFO under perf; a file here)
    assert (tmp_path / "perf-ctl").read_text() == "enable\ndisable\n"


def test_pipeline_trace_tiles_each_phase_without_the_main_profile(tmp_path: Path) -> None:
    """``--pipeline``: the update pipeline runs on one thread at a time, so its intervals
    inside a phase add up to no more than the phase; its updates are seen; ``--no-cprofile``
    leaves the main thread unprofiled."""
    out = tmp_path / "split.json"
    cmd = [sys.executable, str(REPO / "bench" / "cpu_split.py"), "--row", "nvme+opt", "--model",
           "tiny", "--seq", "64", "--steps", "3", "--warmup", "1", "--dtype", "fp32",
           "--nvme-path", str(tmp_path), "--pipeline", "--no-cprofile", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    split = json.loads(out.read_text())
    pipe, phases = split["pipeline"], split["phases"]
    assert set(pipe) == set(phases) == {"forward", "backward", "step"}
    one_thread = ("idle (no job)", "wait reads", "wait writes", "stage_in", "apply", "stage_out")
    for name, row in pipe.items():
        assert sum(row[k] for k in one_thread) <= phases[name][0] * 1.02 + 0.01, (name, row)
    total = {k: sum(row[k] for row in pipe.values()) for k in one_thread + ("submit",)}
    # every step reads, updates and writes back every sub-group, and the hooks submit
    for kind in ("wait reads", "wait writes", "stage_in", "apply", "stage_out", "submit"):
        assert total[kind] > 0, kind
    assert sum(row["wait_unshard"] for row in pipe.values()) > 0  # every forward fetches
    # a submit inside every measured backward
    firsts = next(ln for ln in proc.stdout.splitlines()
                  if ln.startswith("first submit after backward starts"))
    assert "-" not in firsts.split(":", 1)[1], firsts
    assert "main thread (tottime" not in proc.stdout


UNINSTALL = """
import sys
sys.path.insert(0, "bench")
from pipeline_trace import PipelineTrace
from outcore.optim import pipeline as pm
from outcore.zero.group import GatherGroup

class Pipeline:
    def submit(self, *a): pass

class Optimizer:
    def __init__(self): self.pipeline = Pipeline()
    def stage_in(self, *a): pass
    def stage_out(self, *a): pass
    def apply(self, *a): pass

class Engine:
    sharded_optimizer = Optimizer()

def snapshot(e):
    return (dict(vars(e.sharded_optimizer)), dict(vars(e.sharded_optimizer.pipeline)),
            pm.InFlight.wait, pm.JobQueue.next, GatherGroup.unshard, GatherGroup.wait_unshard,
            GatherGroup.await_update)

e = Engine()
before = snapshot(e)
trace = PipelineTrace(e)
trace.install()
assert snapshot(e) != before
trace.uninstall()
assert snapshot(e) == before, (snapshot(e), before)
print("restored")
"""


def test_pipeline_trace_uninstall_puts_every_method_back() -> None:
    """The tracer wraps the optimizer's own methods and the classes' (twice for a sub-group's
    wait); taking it off leaves neither an instance attribute nor a wrapper behind."""
    proc = subprocess.run([sys.executable, "-c", UNINSTALL], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0 and "restored" in proc.stdout, proc.stderr[-2000:]
