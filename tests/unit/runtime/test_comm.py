"""The collectives (comm.py): at world size 1 they are copies (no process group needed) and
their handles are already done; at W = 2 on gloo, ``all_gather`` (rank-major),
``reduce_scatter_sum``, ``all_reduce_sum`` and ``all_reduce_max`` give the values computed by
hand; a collective's ``RuntimeError`` becomes one ``CommError`` naming rank and operation,
and marks the ``Comm`` failed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from outcore.errors import CommError
from outcore.runtime.bootstrap import join_world
from outcore.runtime.comm import Comm, NamedFailure
from tests.distributed import run_world


def test_world_one_all_gather_is_a_copy() -> None:
    comm = Comm()
    shard = torch.tensor([1.0, 2.0, 3.0])
    out = torch.zeros(3)
    handle = comm.all_gather(out, shard)
    assert handle.wait() is True
    assert out.tolist() == [1.0, 2.0, 3.0]
    assert out.data_ptr() != shard.data_ptr()  # copied, not aliased
    shard.zero_()
    assert out.tolist() == [1.0, 2.0, 3.0]


def test_world_one_reduce_scatter_is_a_copy_also_async() -> None:
    comm = Comm()
    full = torch.tensor([4.0, -1.0])
    out = torch.empty(2)
    handle = comm.reduce_scatter_sum(out, full, async_op=True)
    assert handle.wait() is True
    assert out.tolist() == [4.0, -1.0]
    gathered = torch.empty(2)
    assert comm.all_gather(gathered, full, async_op=True).wait() is True
    assert gathered.tolist() == [4.0, -1.0]


def test_world_one_all_reduce_returns_the_tensor_unchanged() -> None:
    comm = Comm()
    t = torch.tensor([1.5, -2.0])
    assert comm.all_reduce_sum(t) is t
    assert comm.all_reduce_max(t) is t
    assert t.tolist() == [1.5, -2.0]
    comm.barrier()  # no process group: nothing to wait for
    assert not comm.failed


def test_named_failure_turns_a_runtime_error_into_a_comm_error() -> None:
    comm = Comm(rank=1, world_size=4, timeout_s=30.0)
    with pytest.raises(CommError) as caught, NamedFailure(comm, "all-gather"):
        raise RuntimeError("Connection reset by peer\nmore lines")
    message = str(caught.value)
    assert "rank 1/4" in message and "all-gather failed" in message
    assert "comm.timeout_s=30" in message and "Connection reset by peer" in message
    assert "more lines" not in message
    assert comm.failed


def test_named_failure_lets_other_errors_through_but_marks_the_comm_failed() -> None:
    comm = Comm()
    with pytest.raises(KeyError), NamedFailure(comm, "barrier"):
        raise KeyError("x")
    assert comm.failed
    ok = Comm()
    with NamedFailure(ok, "barrier"):
        pass
    assert not ok.failed


def _collectives() -> dict[str, Any]:
    comm = join_world("gloo", 60.0)
    r = comm.rank
    shard = torch.tensor([10.0 * r, 10.0 * r + 1, 10.0 * r + 2])
    gathered = torch.empty(6)
    comm.all_gather(gathered, shard)
    async_gathered = torch.empty(6)
    comm.all_gather(async_gathered, shard + 0.5, async_op=True).wait()
    full = torch.arange(4, dtype=torch.float32) + 100.0 * r
    scattered = torch.empty(2)
    comm.reduce_scatter_sum(scattered, full, async_op=True).wait()
    summed = comm.all_reduce_sum(torch.tensor([r + 1.0, 2.0 * r]))
    peak = comm.all_reduce_max(torch.tensor([float(r), -float(r), 3.0]))
    comm.barrier()
    return {"rank": r, "world": comm.world_size, "gathered": gathered.tolist(),
            "async_gathered": async_gathered.tolist(), "scattered": scattered.tolist(),
            "summed": summed.tolist(), "peak": peak.tolist(), "failed": comm.failed}


def test_world_two_collectives_equal_hand_computed_values() -> None:
    results = run_world(_collectives, 2, timeout=120)
    for r, got in enumerate(results):
        assert (got["rank"], got["world"], got["failed"]) == (r, 2, False)
        assert got["gathered"] == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
        assert got["async_gathered"] == [0.5, 1.5, 2.5, 10.5, 11.5, 12.5]
        # full on rank q is [0, 1, 2, 3] + 100 q; rank r keeps the sum of slice r
        assert got["scattered"] == [[100.0, 102.0], [104.0, 106.0]][r]
        assert got["summed"] == [3.0, 2.0]
        assert got["peak"] == [1.0, 0.0, 3.0]
