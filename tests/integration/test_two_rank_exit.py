"""A multi-rank run's end: the process exits 0, with nothing printed by its threads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_ENDS_WITHOUT_DESTROY = """
import torch, outcore
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
engine = outcore.initialize(model, {"dtype": "fp32"})
for _ in range(2):
    engine.backward(model(torch.randn(8, 16)).pow(2).mean())
    engine.step()
engine.close()
print("done", engine.rank, flush=True)
"""


def _torchrun(folder: Path, name: str, text: str) -> subprocess.CompletedProcess[str]:
    """``text`` as a script under torchrun at 2 ranks on the CPU, with this checkout's outcore."""
    script = Path(str(folder)) / name
    script.write_text(text)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OUTCORE_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH"))
                                         if p)}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(script)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=180)


def test_a_two_rank_script_exits_cleanly(tmp_path: Path) -> None:
    """A 2-rank torchrun script that trains, closes and ends used to abort at interpreter exit
    in about half of the runs (SIGABRT, "terminate called without an active exception":
    bootstrap.py's [Note: gloo's workers need the GIL once more after the last collective]);
    three runs, each must exit 0. A regression test by chance: without the fix 2 of 5 runs
    aborted here, so three clean runs miss a return of the bug about one time in five."""
    for _ in range(3):
        done = _torchrun(tmp_path, "plain.py", _ENDS_WITHOUT_DESTROY)
        output = done.stdout + done.stderr
        assert done.returncode == 0 and "terminate called" not in output, output[-3000:]
        assert done.stdout.count("done") == 2, output[-3000:]  # both ranks got to the end


_GROUP_MADE_AGAIN = """
import faulthandler, torch, torch.distributed as dist, outcore
faulthandler.dump_traceback_later(100, exit=True)  # a hang fails the run, not the suite
dist.init_process_group("gloo")  # the user's own group, as for DDP
for cycle in range(4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    engine = outcore.initialize(model, {"dtype": "fp32"})  # outcore makes the group after 0
    engine.backward(model(torch.randn(8, 16)).pow(2).mean())
    engine.step()
    engine.close()
    dist.destroy_process_group()
print("done", flush=True)
"""


def test_an_engine_after_the_user_destroyed_the_group(tmp_path: Path) -> None:
    """A script that destroys its process group and starts another engine has outcore make
    the group again; under torchrun that hung in about a third of the times (bootstrap.py's
    [Note: a process group made again after the user destroyed one]). Four times in one run:
    without the fix it hung in 2 of 6 single tries, so four pass by chance about one time in
    five."""
    done = _torchrun(tmp_path, "again.py", _GROUP_MADE_AGAIN)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and done.stdout.count("done") == 2, output[-3000:]
