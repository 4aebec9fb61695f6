"""A group of parameters gathered, released and reduced together (zero/group.py's [Note:
group states and moves], [Note: one collective per group], [Note: zero-copy at world size
one]): ``unshard()`` issues the shard reads (FETCHING), ``wait_unshard()`` finishes them,
all-gathers and shows the full values (UNSHARDED, its parameters GATHERED), ``reshard()``
frees the full tensors' storage (SHARDED); each call in the state it leads to is a no-op.
The ledger's ``device.unsharded`` counts the full bytes from the moment a fetch starts and
drops to 0 on reshard. A prefetch resharded before use is cancelled without a collective
(and a read that failed is raised once the group is released). At one rank with resident
parameters the group shows the shards themselves and never reshards. Gradients are reduced
in one reduce-scatter whose mean lands in each parameter's gradient shard."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass

import outcore
from outcore.errors import StorageError
from outcore.runtime.context import Runtime
from outcore.zero.access import raw_data
from outcore.zero.build import shard_params
from outcore.zero.group import GatherGroup
from outcore.zero.param import ShardedParam
from outcore.zero.registry import storage_key, unregister
from outcore.zero.sharding import ShardLayout
from outcore.zero.state import GroupState, ParamState
from tests.distributed import run_world

pytestmark = pytest.mark.cpu_only(
    "the plans pinned here (zero-copy at one rank with parameters in host memory) are the "
    "CPU device's, and values are compared with references built on the CPU")

CPU = {"dtype": "fp32", "offload": {"params": "cpu", "optimizer": "cpu"}}


def _linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(6, 5)


def _group(module: nn.Module, rt: Runtime, threshold: int = 0) -> GatherGroup:
    """``module``'s own parameters sharded in ``rt`` and gathered as one group."""
    return GatherGroup(0, "fc", shard_params(module, rt), rt,
                      persistence_threshold_bytes=threshold)


def _forget(group: GatherGroup) -> None:
    for sp in group.params:
        sp.free_storage()
        unregister(sp.param)


def _unsharded(rt: Runtime) -> int:
    return rt.ledger.snapshot().get("device.unsharded", 0)


def _freed(sp: ShardedParam) -> bool:
    """Whether the parameter shows its placeholder with no bytes (checked without printing
    a freed tensor, which would read freed memory)."""
    return (sp.full.untyped_storage().nbytes() == 0
            and storage_key(raw_data(sp.param)) == storage_key(sp.full))


@pytest.fixture
def nvme_rt(tmp_path: Path) -> Iterator[Runtime]:
    """One rank with parameters on NVMe: full tensors are read and released per use."""
    rt = Runtime(outcore.Config.from_dict({"dtype": "fp32", "offload": {
        "params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path),
        "host_buffer_bytes": 1 << 20}}))
    assert not rt.plan.zero_copy
    yield rt
    rt.close()


def test_unshard_wait_reshard_move_the_group_and_its_parameters(nvme_rt: Runtime) -> None:
    ref = {k: v.clone() for k, v in _linear().state_dict().items()}
    fc = _linear()
    group = _group(fc, nvme_rt)
    assert group.full_bytes == (30 + 5) * 4 and not group.persistent
    assert group.state is GroupState.SHARDED and _unsharded(nvme_rt) == 0
    assert all(_freed(sp) for sp in group.params)

    group.unshard()
    assert group.state is GroupState.FETCHING
    assert [sp.state for sp in group.params] == [ParamState.FETCHING] * 2
    assert _unsharded(nvme_rt) == group.full_bytes, "counted from the fetch's start"
    group.unshard()  # already fetching: nothing more
    assert group.state is GroupState.FETCHING

    group.wait_unshard()
    assert group.state is GroupState.UNSHARDED
    assert [sp.state for sp in group.params] == [ParamState.GATHERED] * 2
    assert torch.equal(raw_data(fc.weight), ref["weight"])
    assert torch.equal(raw_data(fc.bias), ref["bias"])
    assert _unsharded(nvme_rt) == group.full_bytes
    group.wait_unshard()  # already unsharded: nothing more
    assert group.state is GroupState.UNSHARDED

    group.reshard()
    assert group.state is GroupState.SHARDED
    assert [sp.state for sp in group.params] == [ParamState.SHARDED] * 2
    assert all(_freed(sp) for sp in group.params)
    assert _unsharded(nvme_rt) == 0
    group.reshard()  # already sharded: nothing more
    assert group.state is GroupState.SHARDED

    group.wait_unshard()  # on demand, from SHARDED: unshard and wait in one
    assert group.state is GroupState.UNSHARDED
    assert torch.equal(raw_data(fc.weight), ref["weight"])
    group.reshard()
    assert _unsharded(nvme_rt) == 0
    _forget(group)


def test_a_prefetch_resharded_before_use_is_cancelled(nvme_rt: Runtime) -> None:
    fc = _linear()
    group = _group(fc, nvme_rt)
    group.unshard()
    assert _unsharded(nvme_rt) == group.full_bytes
    group.reshard()
    assert group.state is GroupState.SHARDED
    assert [sp.state for sp in group.params] == [ParamState.SHARDED] * 2
    assert all(_freed(sp) for sp in group.params)
    assert _unsharded(nvme_rt) == 0
    _forget(group)


def test_disk_reads_staged_through_host_memory_reach_the_full_tensors(
        nvme_rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator's path (reads into host tensors, then a copy to the full tensors),
    forced on the CPU: the values arrive, a cancelled prefetch drops its staged copies."""
    monkeypatch.setattr(GatherGroup, "_stages", lambda self, shard: shard.resident() is None)
    ref = {k: v.clone() for k, v in _linear().state_dict().items()}
    fc = _linear()
    group = _group(fc, nvme_rt)
    group.unshard()
    assert len(group._staged) == 2
    assert all(host.data_ptr() != full.data_ptr() for full, host in group._staged)
    for full, _ in group._staged:
        full.fill_(float("nan"))  # only the staged copy can bring the values
    group.wait_unshard()
    assert group._staged == []
    assert torch.equal(raw_data(fc.weight), ref["weight"])
    assert torch.equal(raw_data(fc.bias), ref["bias"])
    group.reshard()
    group.unshard()
    group.reshard()  # a prefetch cancelled before use
    assert group._staged == [] and group.state is GroupState.SHARDED
    _forget(group)


class _FailedRead:
    def result(self, timeout: float | None = None) -> object:
        raise StorageError("checksum mismatch in swap at offset 0 (test)")

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return StorageError("checksum mismatch")


def test_a_failed_read_of_a_cancelled_prefetch_is_raised_after_release(
        nvme_rt: Runtime) -> None:
    fc = _linear()
    group = _group(fc, nvme_rt)
    shard = group.params[0].compute_shard
    assert shard is not None
    shard.load = lambda out: _FailedRead()  # type: ignore[method-assign]
    group.unshard()
    with pytest.raises(StorageError, match="checksum mismatch"):
        group.reshard()
    assert group.state is GroupState.SHARDED
    assert all(_freed(sp) for sp in group.params)
    assert _unsharded(nvme_rt) == 0
    del shard.load  # the class's own again
    _forget(group)


@pytest.mark.parametrize("when", ["issued", "waited"])
def test_a_fetch_that_raises_is_undone(nvme_rt: Runtime, when: str) -> None:
    """zero/group.py's [Note: a fetch that raises is undone]: a read refused as the reads
    are issued, or failing when they are waited for, leaves the group SHARDED with nothing
    allocated or counted, so the next fetch reads the values afresh (before, the group stayed
    FETCHING and the next fetch showed tensors the failed one never filled)."""
    ref = {k: v.clone() for k, v in _linear().state_dict().items()}
    fc = _linear()
    group = _group(fc, nvme_rt, threshold=1 << 20)  # persistent: never released by the schedule
    shard = group.params[1].compute_shard
    assert shard is not None and group.persistent

    def refused(out: torch.Tensor) -> object:
        raise StorageError("read refused (test)")

    shard.load = refused if when == "issued" else (  # type: ignore[method-assign]
        lambda out: _FailedRead())
    with pytest.raises(StorageError):
        group.wait_unshard()
    assert group.state is GroupState.SHARDED
    assert [sp.state for sp in group.params] == [ParamState.SHARDED] * 2
    assert all(_freed(sp) for sp in group.params)
    assert _unsharded(nvme_rt) == 0
    del shard.load  # the class's own again
    group.wait_unshard()
    assert torch.equal(raw_data(fc.weight), ref["weight"])
    assert torch.equal(raw_data(fc.bias), ref["bias"])
    group.reshard()
    _forget(group)


def test_at_one_rank_with_resident_params_the_group_shows_its_shards() -> None:
    rt = Runtime(outcore.Config.from_dict(CPU))
    assert rt.plan.zero_copy
    fc = _linear()
    ref = fc.weight.detach().clone()
    group = _group(fc, rt)
    assert group.persistent, "zero-copy groups are always persistent"
    group.wait_unshard()
    assert group.state is GroupState.UNSHARDED
    assert [sp.state for sp in group.params] == [ParamState.GATHERED] * 2
    sp = group.params[0]
    assert sp.compute_shard is not None
    resident = sp.compute_shard.resident()
    assert resident is not None
    shown = raw_data(fc.weight)
    assert storage_key(shown) == storage_key(resident), "a view of the shard, not a copy"
    assert torch.equal(shown, ref)
    assert _unsharded(rt) == 0, "nothing gathered, nothing counted"
    group.reshard()  # never reshards
    assert group.state is GroupState.UNSHARDED and sp.state is ParamState.GATHERED
    group.hide_resident()
    assert group.state is GroupState.SHARDED
    assert [p.state for p in group.params] == [ParamState.SHARDED] * 2
    assert all(_freed(p) for p in group.params)
    _forget(group)


def test_a_group_within_the_threshold_is_persistent(nvme_rt: Runtime) -> None:
    a, b = _linear(), _linear()
    big = _group(a, nvme_rt, threshold=35 * 4 - 1)
    small = _group(b, nvme_rt, threshold=35 * 4)
    assert not big.persistent and small.persistent
    _forget(big)
    _forget(small)


def test_gradients_at_one_rank_are_added_at_once(nvme_rt: Runtime) -> None:
    fc = _linear()
    group = _group(fc, nvme_rt)
    assert not group.grad_arrived(group.params[0]) and group.grad_arrived(group.params[1])
    with DisableTorchFunctionSubclass():  # as autograd leaves them (a user's write is refused)
        fc.weight.grad = torch.full((5, 6), 0.5)
        fc.bias.grad = torch.arange(5.0)
    assert group.has_pending_grads
    assert group.reduce_grads() is None
    assert fc.weight.grad is None and fc.bias.grad is None and not group.has_pending_grads
    w, b = group.params[0].grad, group.params[1].grad
    assert w is not None and torch.equal(w, torch.full((30,), 0.5))
    assert b is not None and torch.equal(b, torch.arange(5.0))
    assert not group.grad_arrived(group.params[0]), "reduce_grads starts a new count"
    _forget(group)


def _two_ranks() -> dict[str, Any]:
    """Both ranks shard the same Linear; count the all-gathers each group move runs."""
    rt = Runtime(outcore.Config.from_dict(CPU))
    ref = _linear()
    fc = _linear()
    group = _group(fc, rt)
    calls = []
    gather = rt.comm.all_gather

    def counted(out: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Any:
        calls.append(shard.numel())
        return gather(out, shard, async_op)

    rt.comm.all_gather = counted  # type: ignore[method-assign]
    got: dict[str, Any] = {"offsets": group.offsets, "shard_numel": group.shard_numel,
                           "zero_copy": group.zero_copy}
    group.unshard()
    got["prefetch"] = (group.state.value, _unsharded(rt), len(calls))
    group.reshard()
    got["cancelled"] = (group.state.value, _unsharded(rt), len(calls),
                        all(_freed(sp) for sp in group.params))
    group.unshard()
    group.wait_unshard()
    got["gathered"] = (group.state.value, _unsharded(rt), len(calls),
                       [sp.state.value for sp in group.params])
    got["weight"], got["bias"] = raw_data(fc.weight).clone(), raw_data(fc.bias).clone()
    got["ref_weight"], got["ref_bias"] = ref.weight.detach(), ref.bias.detach()
    group.reshard()
    got["resharded"] = (group.state.value, _unsharded(rt), all(_freed(sp) for sp in group.params))
    group.wait_unshard()  # on demand
    got["on_demand"] = (group.state.value, len(calls))
    group.reshard()
    # gradients: rank r holds (r + 1) times the same gradient; the shards get the mean
    rank = rt.rank
    gw, gb = torch.randn(5, 6, generator=torch.Generator().manual_seed(1)), torch.arange(5.0)
    with DisableTorchFunctionSubclass():  # as autograd leaves them
        fc.weight.grad, fc.bias.grad = (rank + 1) * gw, (rank + 1) * gb
    pending = group.reduce_grads()
    assert pending is not None and fc.weight.grad is None
    assert pending.finish() is group
    w, b = group.params[0].grad, group.params[1].grad
    assert w is not None and b is not None
    got["grad_weight"], got["grad_bias"] = w.clone(), b.clone()
    got["want_weight"] = ShardLayout(30, 2, rank).cut(1.5 * gw)
    got["want_bias"] = ShardLayout(5, 2, rank).cut(1.5 * gb)
    _forget(group)
    return got


def test_two_ranks_gather_once_per_use_and_never_for_a_cancelled_prefetch() -> None:
    for got in run_world(_two_ranks, 2):
        assert got["zero_copy"] is False
        assert got["offsets"] == [0, 15] and got["shard_numel"] == 15 + 3
        full = (30 + 5) * 4
        assert got["prefetch"] == ("fetching", full, 0), "unshard() only reads"
        assert got["cancelled"] == ("sharded", 0, 0, True), "no collective for a prefetch"
        assert got["gathered"] == ("unsharded", full, 1, ["gathered", "gathered"])
        assert (got["weight"] == got["ref_weight"]).all()
        assert (got["bias"] == got["ref_bias"]).all()
        assert got["resharded"] == ("sharded", 0, True)
        assert got["on_demand"] == ("unsharded", 2)
        assert got["grad_weight"].shape == (15,) and got["grad_bias"].shape == (3,)
        assert (got["grad_weight"] == got["want_weight"]).all()
        assert (got["grad_bias"] == got["want_bias"]).all()
