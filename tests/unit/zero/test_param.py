"""One parameter under sharding (zero/param.py): its fp32 master shard holds this rank's
slice of the values (zero padding) in the state tier; the user's parameter object is kept,
its ``.data`` a shape-true full tensor whose storage is freed on release and refilled on
fetch ([Note: free the storage, keep the tensor]), so views taken of it see the bytes go and
come back; stored shards are listed once each ([Note: fp32 shards are shared, not copied]);
gradients accumulate in fp32, held without a copy where the plan allows and in a kept
buffer where the state is in memory ([Note: gradient buffers], [Note: gradients are held,
not copied]), and the ledger's ``<tier>.grads`` follows what is held."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.offload.tier import Tier
from outcore.runtime.comm import Comm
from outcore.runtime.context import Runtime
from outcore.zero.access import raw_data
from outcore.zero.param import ShardedParam
from outcore.zero.registry import managed, register, storage_key, unregister
from outcore.zero.sharding import ShardLayout
from outcore.zero.state import ParamState

pytestmark = pytest.mark.cpu_only(
    "shards are compared with references built on the CPU, and the gradient paths pinned "
    "here (held raw, kept buffers) are the CPU device's plans")

FP32 = {"dtype": "fp32", "offload": {"params": "cpu", "optimizer": "cpu"}}
BF16 = {"dtype": "bf16", "offload": {"params": "cpu", "optimizer": "cpu"}}


def _runtime(cfg: dict) -> Runtime:
    return Runtime(outcore.Config.from_dict(cfg))


@pytest.fixture
def nvme_rt(tmp_path: Path) -> Iterator[Runtime]:
    """bf16 with parameters and optimizer state on NVMe: one rank on the CPU holds raw
    gradients and keeps no gradient buffers."""
    rt = _runtime({"dtype": "bf16", "offload": {
        "params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path),
        "host_buffer_bytes": 1 << 20}})
    assert rt.plan.holds_raw_grads and not rt.plan.keeps_grad_buffers
    yield rt
    rt.close()


def _values(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share one storage. Asserts compare its result in a local: pytest
    would print a failing call's arguments, and printing a tensor whose storage is freed
    reads freed memory."""
    return bool(storage_key(a) == storage_key(b))


def _sharded(values: torch.Tensor, rt: Runtime, requires_grad: bool = True
             ) -> tuple[nn.Parameter, ShardedParam]:
    param = nn.Parameter(values.clone(), requires_grad=requires_grad)
    sp = ShardedParam(param, rt)
    register(param, sp)
    return param, sp


def test_the_master_shard_holds_this_ranks_values_and_the_parameter_stays() -> None:
    rt = _runtime(FP32)
    ref = _values((3, 5))
    param, sp = _sharded(ref, rt)
    assert managed(param) is sp and sp.state is ParamState.SHARDED
    assert isinstance(param, nn.Parameter) and type(param).__name__ == "ShardedParameter"
    assert param.shape == (3, 5) and param.numel() == 15 and param.dtype == torch.float32
    shown = _same_storage(raw_data(param), sp.full)
    assert shown and sp.full.untyped_storage().nbytes() == 0
    assert sp.master_shard is not None and sp.master_shard.tier is Tier.HOST
    assert rt.ledger.snapshot()["host.master"] == 15 * 4
    assert torch.equal(sp.values_shard(), ref.reshape(-1))
    assert torch.equal(sp.gather_values(), ref)
    assert torch.equal(sp.read_value(), ref)
    unregister(param)


@pytest.mark.parametrize(("rank", "world"), [(0, 2), (1, 2), (0, 3), (2, 3), (3, 4)])
def test_each_rank_keeps_its_own_padded_slice(rank: int, world: int) -> None:
    """A runtime that says it is ``rank`` of ``world`` (nothing here runs a collective):
    the shard is that rank's slice of the flattened values, padded with zeros."""
    rt = _runtime(FP32)
    rt.comm = Comm(rank=rank, world_size=world)
    ref = _values((3, 5), seed=rank)
    param, sp = _sharded(ref, rt)
    layout = ShardLayout(15, world, rank)
    assert sp.layout == layout and sp.shard_numel == layout.shard_numel
    shard = sp.values_shard()
    assert shard.shape == (layout.shard_numel,)
    assert torch.equal(shard[: layout.valid_numel],
                       ref.reshape(-1)[layout.start : layout.start + layout.valid_numel])
    assert not shard[layout.valid_numel :].any()
    local = sp.local_values()  # this rank's slice in place, zeros elsewhere
    expected = torch.zeros(15)
    expected[layout.start : layout.start + layout.valid_numel] = shard[: layout.valid_numel]
    assert torch.equal(local.reshape(-1), expected)
    unregister(param)


def test_an_integer_parameter_is_refused_by_name() -> None:
    param = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    with pytest.raises(outcore.ConfigError, match=r"cannot shard a torch.int64 parameter"):
        ShardedParam(param, _runtime(FP32))


def test_release_frees_the_storage_in_place_and_fetch_refills_it() -> None:
    rt = _runtime(FP32)
    ref = _values((4, 6))
    param, sp = _sharded(ref, rt)
    full = sp.alloc_full()
    assert sp.state is ParamState.FETCHING and full is sp.full
    assert full.untyped_storage().nbytes() == 24 * 4
    assert sp.master_shard is not None
    sp.master_shard.load(full.view(-1)).result()
    sp.mark_gathered()
    assert sp.state is ParamState.GATHERED
    saved = full.t()  # what autograd saves of a weight for backward
    assert torch.equal(raw_data(param), ref) and torch.equal(saved, ref.t())
    sp.release()
    assert sp.state is ParamState.SHARDED
    assert sp.full.untyped_storage().nbytes() == 0
    assert saved.untyped_storage().nbytes() == 0, "the saved view pins nothing"
    shown = _same_storage(raw_data(param), full)
    assert shown, ".data is the same tensor, its storage gone"
    assert param.shape == (4, 6)
    sp.release()  # releasing a released parameter: nothing to do
    assert sp.state is ParamState.SHARDED
    sp.alloc_full()  # the next fetch: the view sees the bytes come back
    sp.master_shard.load(sp.full.view(-1)).result()
    assert torch.equal(saved, ref.t())
    sp.mark_gathered()
    sp.release()
    unregister(param)


def test_a_parameter_is_held_weakly() -> None:
    rt = _runtime(FP32)
    sp = ShardedParam(nn.Parameter(torch.ones(3)), rt)  # not registered: nothing else holds it
    gc.collect()
    assert not sp.alive


@pytest.mark.parametrize(("cfg", "frozen", "kinds"), [
    (FP32, False, {"host.master": 40 * 4}),
    (BF16, False, {"host.master": 40 * 4, "host.params": 40 * 2}),
    (BF16, True, {"host.master": 0, "host.params": 40 * 2}),
], ids=["fp32: one shard serves both", "bf16: master and params", "bf16 frozen: params only"])
def test_stored_shards_lists_each_shard_once(cfg: dict, frozen: bool,
                                             kinds: dict[str, int]) -> None:
    rt = _runtime(cfg)
    ref = _values((5, 8))
    param, sp = _sharded(ref, rt)
    param.requires_grad_(not frozen)
    sp.prepare_for_training()
    shards = sp.stored_shards()
    assert len({id(s) for s in shards}) == len(shards) == len(kinds) - frozen
    if cfg is FP32:
        assert sp.compute_shard is sp.master_shard
    else:
        assert sp.compute_shard is not None and sp.compute_shard.dtype == torch.bfloat16
        assert (sp.master_shard is None) is frozen
    assert sp.dtype == rt.compute_dtype == raw_data(param).dtype
    snap = rt.ledger.snapshot()
    assert {k: snap.get(k, 0) for k in kinds} == kinds
    assert torch.equal(sp.read_value(), ref.to(rt.compute_dtype))
    sp.free_storage()
    assert sp.stored_shards() == []
    assert not any(rt.ledger.snapshot().get(k, 0) for k in kinds), "every shard's bytes given back"
    unregister(param)


def test_written_values_reach_the_master_exactly_and_the_params_rounded() -> None:
    rt = _runtime(BF16)
    param, sp = _sharded(torch.zeros(2, 3), rt)
    sp.prepare_for_training()
    new = torch.tensor([[1.0 + 2**-10, 2.0, 3.0], [4.0, 5.0, -6.0 - 2**-12]])
    sp.write_values(new)
    assert torch.equal(sp.read_value(exact=True), new)
    assert torch.equal(sp.read_value(), new.to(torch.bfloat16))
    assert torch.equal(sp.values_shard(), new.reshape(-1))
    unregister(param)


# -- gradients --------------------------------------------------------------------------------
ONE = torch.ones(6, dtype=torch.bfloat16)
TINY = torch.full((6,), 2.0**-9, dtype=torch.bfloat16)  # 1 + 2**-9 rounds to 1 in bf16


def test_gradients_accumulate_in_fp32_in_a_kept_buffer() -> None:
    """State in memory: the first gradient is cast into an fp32 buffer that stays from step
    to step; a second one is added in fp32; the ledger counts the buffer until it is let go."""
    rt = _runtime(FP32)
    assert rt.plan.keeps_grad_buffers and rt.plan.grad_tier is Tier.HOST
    param, sp = _sharded(torch.zeros(2, 3), rt)
    assert "host.grads" not in rt.ledger.snapshot()
    sp.add_grad(ONE, owned=True)
    assert sp.grad is not None and sp.grad.dtype == torch.float32 and sp.has_grad
    sp.add_grad(TINY)
    assert torch.equal(sp.grad, torch.full((6,), 1.0 + 2.0**-9))
    assert (ONE + TINY).tolist() == ONE.tolist(), "the same sum in bf16 would lose it"
    assert rt.ledger.snapshot()["host.grads"] == 6 * 4
    buffer = sp.grad
    sp.drop_grad()  # the update consumed it: the buffer stays, and stays counted
    assert sp.grad is None and not sp.has_grad
    assert rt.ledger.snapshot()["host.grads"] == 6 * 4
    fresh = torch.arange(6.0)
    sp.add_grad(fresh, owned=True)
    assert sp.grad is buffer and torch.equal(sp.grad, fresh), "the next step reuses it"
    fresh.fill_(0.0)
    assert torch.equal(sp.grad, torch.arange(6.0)), "copied into the buffer, not held"
    sp.release_grads()
    assert sp.grad is None and rt.ledger.snapshot()["host.grads"] == 0
    unregister(param)


def test_a_gradient_not_owned_is_copied() -> None:
    rt = _runtime(FP32)
    param, sp = _sharded(torch.zeros(6), rt)
    g = torch.arange(6.0)
    sp.add_grad(g)
    g.fill_(-1.0)
    assert sp.grad is not None and torch.equal(sp.grad, torch.arange(6.0))
    unregister(param)


def test_an_owned_gradient_is_held_raw_until_a_second_one_arrives(nvme_rt: Runtime) -> None:
    """State on NVMe at one rank on the CPU: the first owned bf16 gradient is the shard
    itself; accumulation turns it into fp32 first; each drop takes its bytes off."""
    param, sp = _sharded(torch.zeros(2, 3), nvme_rt)
    sp.prepare_for_training()
    g = ONE.clone()
    sp.add_grad(g, owned=True)
    assert sp.grad is g and sp.grad.dtype == torch.bfloat16
    assert nvme_rt.ledger.snapshot()["host.grads"] == 6 * 2
    sp.add_grad(TINY)
    assert sp.grad.dtype == torch.float32
    assert torch.equal(sp.grad, torch.full((6,), 1.0 + 2.0**-9))
    assert nvme_rt.ledger.snapshot()["host.grads"] == 6 * 4
    sp.drop_grad()  # no kept buffer: the bytes are gone
    assert sp.grad is None and nvme_rt.ledger.snapshot()["host.grads"] == 0
    sp.add_grad(ONE.clone())  # not owned: cast into a new fp32 tensor
    assert sp.grad.dtype == torch.float32 and nvme_rt.ledger.snapshot()["host.grads"] == 6 * 4
    sp.release_grads()
    assert nvme_rt.ledger.snapshot()["host.grads"] == 0
    sp.free_storage()
    unregister(param)


def test_a_dropped_parameter_refuses_reads_and_holds_nothing() -> None:
    rt = _runtime(FP32)
    param, sp = _sharded(torch.ones(4, 4), rt)
    sp.name = "fc.weight"
    sp.add_grad(torch.ones(16))
    sp.drop()
    assert sp.state is ParamState.DROPPED and sp.stored_shards() == []
    assert rt.ledger.snapshot()["host.master"] == 0 and rt.ledger.snapshot()["host.grads"] == 0
    with pytest.raises(outcore.ParamAccessError, match="fc.weight"):
        sp.values_shard()
    unregister(param)
