"""Joining the process group (bootstrap.py): without ``WORLD_SIZE`` (or with 1) a rank runs
alone, with no process group; with ``WORLD_SIZE`` > 1 each of ``torchrun``'s variables must be
set, and a missing one is a ``ConfigError`` naming it; a process group already joined is used
as it is. (Joining a real W = 2 group: tests/unit/runtime/test_comm.py.)"""

from __future__ import annotations

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

