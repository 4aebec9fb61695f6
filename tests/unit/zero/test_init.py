"""``outcore.init`` (zero/init.py's [Note: the seam is parameter registration, not
``__init__`` patching], [Note: custom init sees the full tensor, and the same random
numbers]): every parameter registered inside the context is sharded as it appears, init
code runs on one materialized parameter at a time, and with the same seed the shards hold
exactly what plain construction makes (the same random numbers drawn, in the same order),
at one rank and at two. Leaving the context removes the hook; a body that raises closes
the runtime; ``frozen=True`` keeps only the training-dtype shard; ranks that enter with
different RNG states are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import outcore
from outcore.offload.tier import Tier
from outcore.zero.registry import managed
from outcore.zero.sharding import ShardLayout
from outcore.zero.state import ParamState
from tests.common import Quirky
from tests.distributed import run_world

pytestmark = pytest.mark.cpu_only(
    "the sharded model is compared with a plain one built on the CPU")

FP32 = {"dtype": "fp32"}


def _plain_and_sharded(build: Any, cfg: dict, seed: int = 0, **kw: Any
                       ) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    """The model built plainly and under ``outcore.init`` from the same seed, and one random
    draw after each build."""
    torch.manual_seed(seed)
    plain = build()
    after_plain = torch.rand(4)
    torch.manual_seed(seed)
    with outcore.init(cfg, **kw):
        sharded = build()
    after_sharded = torch.rand(4)
    return plain, sharded, after_plain, after_sharded


def test_a_model_built_under_init_equals_plain_construction() -> None:
    """Quirky draws normal_ and trunc_normal_ fills, rescales in place and ties weights."""
    plain, sharded, after_plain, after_sharded = _plain_and_sharded(Quirky, FP32)
    assert torch.equal(after_plain, after_sharded), "the same random numbers were drawn"
    assert sharded.head.weight is sharded.emb.weight, "the tie survives"
    for p in sharded.parameters():
        sp = managed(p)
        assert sp is not None and sp.state is ParamState.SHARDED
        assert sp.full.untyped_storage().nbytes() == 0, "no full parameter left behind"
    with outcore.gathered_parameters(sharded):
        got = {n: p.data.clone() for n, p in sharded.named_parameters()}
    want = dict(plain.named_parameters())
    assert got.keys() == want.keys()
    for name, value in got.items():
        assert torch.equal(value, want[name].detach()), name


class _Probe(nn.Module):
    """Records, after each construction step, how many parameters are open in full."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[int] = []
        self.a = nn.Linear(8, 8)
        self._record()
        self.b = nn.Linear(8, 8)
        self._record()
        nn.init.normal_(self.a.weight)  # a.weight again: b's last one is cut back first
        self._record()
        with torch.no_grad():
            self.b.weight.mul_(2.0)  # not an overwrite: gathered from the shards, then scaled
        self._record()

    def _record(self) -> None:
        sps = [managed(p) for p in self.parameters()]  # None for a plain build
        self.open.append(sum(sp is not None and sp.state is ParamState.BUILDING for sp in sps))


def test_at_most_one_parameter_is_full_at_a_time() -> None:
    plain, sharded, _, _ = _plain_and_sharded(_Probe, FP32)
    assert sharded.open == [1, 1, 1, 1]
    assert plain.open == [0, 0, 0, 0]
    with outcore.gathered_parameters(sharded):
        for name, p in sharded.named_parameters():
            assert torch.equal(p.data, dict(plain.named_parameters())[name].detach()), name


def test_a_dtype_change_during_construction_is_kept() -> None:
    """``.data`` may be a new tensor when the parameter is cut back (``model.to(dtype)``)."""
    def build() -> nn.Module:
        return nn.Linear(4, 3).to(torch.float64)

    plain, sharded, _, _ = _plain_and_sharded(build, FP32)
    for name, p in sharded.named_parameters():
        sp = managed(p)
        assert sp is not None and sp.user_dtype == torch.float64, name
        assert torch.equal(sp.read_value(exact=True),
                           dict(plain.named_parameters())[name].detach().float()), name


def test_leaving_the_context_removes_the_hook() -> None:
    with outcore.init(FP32):
        inside = nn.Linear(2, 2)
    outside = nn.Linear(2, 2)
    assert all(managed(p) is not None for p in inside.parameters())
    assert all(managed(p) is None for p in outside.parameters())
    assert all(type(p) is nn.Parameter for p in outside.parameters())


def test_a_resize_under_init_is_refused_by_name_with_advice_that_works_there() -> None:
    """``resize_token_embeddings`` on a model built under ``outcore.init``, before any
    ``outcore.initialize``, was refused naming the parameter only "of shape [256, 32]" and
    telling the user to resize "before outcore.initialize", which is where they were."""
    with outcore.init(FP32):
        model = nn.Sequential(nn.Embedding(256, 32), nn.Sequential(nn.Linear(32, 4)))
    assert managed(model[1][0].weight).label() == "1.0.weight"
    with pytest.raises(outcore.ParamAccessError,
                       match=r"parameter 0.weight.data \(shape \[256, 32\]\).*build the model "
                             r"without outcore.init, resize it, then pass it to outcore.initi"):
        model[0].weight.data = torch.zeros(264, 32)
    with outcore.initialize(model, FP32), pytest.raises(
            outcore.ParamAccessError, match=r"0.weight.data .* before outcore.initialize or "
                                            r"after engine.close\(\)"):
        model[0].weight.data = torch.zeros(264, 32)  # with an engine: that advice holds


def test_a_body_that_raises_closes_the_runtime_and_removes_the_hook(tmp_path: Any) -> None:
    ctx = outcore.init({"dtype": "fp32", "offload": {"params": "nvme", "optimizer": "nvme",
                                                     "nvme_path": str(tmp_path),
                                                     "host_buffer_bytes": 1 << 20}})
    with pytest.raises(ZeroDivisionError), ctx:
        nn.Linear(4, 4)
        assert list(tmp_path.rglob("*.swap")), "the shards went to the swap file"
        raise ZeroDivisionError
    assert ctx.runtime is not None and ctx.runtime.closed
    assert not list(tmp_path.rglob("*.swap")), "the half-built model's swap is gone"
    assert all(managed(p) is None for p in nn.Linear(2, 2).parameters())


def test_frozen_init_keeps_only_the_training_dtype_shard() -> None:
    cfg = {"dtype": "bf16", "offload": {"params": "cpu", "optimizer": "cpu"}}
    plain, sharded, _, _ = _plain_and_sharded(lambda: nn.Linear(6, 4), cfg, frozen=True)
    ledger = None
    for name, p in sharded.named_parameters():
        sp = managed(p)
        assert sp is not None and not p.requires_grad, name
        assert sp.master_shard is None, "no fp32 master for a parameter born frozen"
        assert sp.compute_shard is not None and sp.compute_shard.dtype == torch.bfloat16
        assert sp.compute_shard.tier is Tier.HOST
        want = dict(plain.named_parameters())[name].detach().to(torch.bfloat16)
        assert torch.equal(sp.read_value(), want), name
        ledger = sp.rt.ledger
    assert ledger is not None
    snap = ledger.snapshot()
    assert snap.get("host.master", 0) == 0 and snap["host.params"] == (24 + 4) * 2


# -- two ranks ----------------------------------------------------------------------------------
def _two_ranks() -> dict[str, Any]:
    plain, sharded, after_plain, after_sharded = _plain_and_sharded(Quirky, FP32)
    first = managed(sharded.scale)
    assert first is not None and first.rt.world_size == 2
    rank = first.rt.rank
    got: dict[str, Any] = {"same_draws": bool(torch.equal(after_plain, after_sharded))}
    want = dict(plain.named_parameters())
    got["shards"] = {}
    for name, p in sharded.named_parameters():
        sp = managed(p)
        assert sp is not None
        layout = ShardLayout(p.numel(), 2, rank)
        got["shards"][name] = bool(torch.equal(sp.values_shard(), layout.cut(want[name])))
    with outcore.gathered_parameters(sharded):
        got["full"] = {n: bool(torch.equal(p.data, want[n].detach()))
                       for n, p in sharded.named_parameters()}
    torch.manual_seed(100 + rank)  # a launch script that seeds by rank
    try:
        with outcore.init(FP32):
            nn.Linear(2, 2)
        got["different_rng"] = "built"
    except outcore.ConfigError as e:
        got["different_rng"] = str(e)
    return got


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_world(_two_ranks, 2)


def test_two_ranks_each_hold_their_slice_of_the_plain_model(two_ranks: list) -> None:
    for got in two_ranks:
        assert got["same_draws"]
        assert got["shards"] and all(got["shards"].values()), got["shards"]
        assert got["full"] and all(got["full"].values()), got["full"]


def test_a_rank_with_another_rng_state_is_refused_by_name(two_ranks: list) -> None:
    refused = [got["different_rng"] for got in two_ranks if got["different_rng"] != "built"]
    assert refused and all("torch.manual_seed" in msg for msg in refused)


def test_every_rank_refuses_when_rng_states_differ(two_ranks: list) -> None:
    assert [got["different_rng"] == "built" for got in two_ranks] == [False, False]


def _teacher_without_engine() -> str:
    torch.manual_seed(0)
    with outcore.init({"dtype": "fp32"}):
        teacher = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    try:
        with torch.no_grad():
            teacher(torch.randn(2, 4))
    except outcore.ParamAccessError as e:
        return str(e)
    return "ran"


def test_a_model_no_engine_holds_says_to_initialize_it_at_two_ranks() -> None:
    """A teacher built under outcore.init and called without outcore.initialize: at more ranks
    its forward was refused as a read to make inside gathered_parameters of an engine there
    was none of."""
    for said in run_world(_teacher_without_engine, 2):
        assert "no engine holds yet" in said and "outcore.initialize" in said, said
