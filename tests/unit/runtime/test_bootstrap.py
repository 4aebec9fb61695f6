"""Joining the process group (bootstrap.py): without ``WORLD_SIZE`` (or with 1) a rank runs
alone, with no process group; with ``WORLD_SIZE`` > 1 each of ``torchrun``'s variables must be
set, and a missing one is a ``ConfigError`` naming it; a process group already joined is used
as it is. (Joining a real W = 2 group: tests/unit/runtime/test_comm.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from outcore.errors import ConfigError
from outcore.runtime.bootstrap import join_world
from outcore.runtime.comm import Comm

TORCHRUN = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No torchrun variables, and no process group joined."""
    assert not (dist.is_available() and dist.is_initialized())
    for key in TORCHRUN:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_without_world_size_a_rank_runs_alone(env: pytest.MonkeyPatch) -> None:
    comm = join_world("gloo", 12.0)
    assert comm == Comm(rank=0, world_size=1, timeout_s=12.0)
    assert not dist.is_initialized()


def test_world_size_one_runs_alone_whatever_else_is_set(env: pytest.MonkeyPatch) -> None:
    env.setenv("WORLD_SIZE", "1")
    env.setenv("RANK", "0")
    comm = join_world("gloo", 5.0)
    assert (comm.rank, comm.world_size, comm.timeout_s) == (0, 1, 5.0)
    assert not dist.is_initialized()


@pytest.mark.parametrize("missing", ["RANK", "MASTER_ADDR", "MASTER_PORT"])
def test_world_size_two_without_a_torchrun_variable_names_it(
        env: pytest.MonkeyPatch, missing: str) -> None:
    values = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for key, value in values.items():
        if key != missing:
            env.setenv(key, value)
    with pytest.raises(ConfigError, match=f"WORLD_SIZE=2 but {missing} is not set"):
        join_world("gloo", 5.0)
    assert not dist.is_initialized()


def test_a_process_group_already_joined_is_used(env: pytest.MonkeyPatch) -> None:
    env.setenv("WORLD_SIZE", "2")  # ignored: the joined group decides
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm = join_world("gloo", 7.0)
        assert (comm.rank, comm.world_size, comm.timeout_s) == (0, 1, 7.0)
    finally:
        dist.destroy_process_group()


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


def test_a_two_rank_script_exits_cleanly(tmp_path: Path) -> None:
    """A 2-rank torchrun script that trains, closes and ends used to abort at interpreter exit
    in about half of the runs (SIGABRT, "terminate called without an active exception":
    bootstrap.py's [Note: gloo's workers need the GIL once more after the last collective]);
    three runs, each must exit 0."""
    script = Path(str(tmp_path)) / "plain.py"
    script.write_text(_ENDS_WITHOUT_DESTROY)
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "OUTCORE_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH"))
                                         if p)}
    for _ in range(3):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node", "2", str(script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=180)
        output = done.stdout + done.stderr
        assert done.returncode == 0 and "terminate called" not in output, output[-3000:]
        assert done.stdout.count("done") == 2, output[-3000:]  # both ranks got to the end
