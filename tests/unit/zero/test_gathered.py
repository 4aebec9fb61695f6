"""``gathered_parameters`` (zero/gathered.py): inside the context each chosen parameter's
``.data`` is its full value in fp32, read from the master shard (nothing rounded, at more
ranks assembled by all-gather); with ``modify=True`` what the body leaves there is cut back
into every rank's shards (fp32 master and training copy), unless the body raises; with
``modify=False`` a write is refused, not silently discarded (docs/python.md's table). A
group the parameters belong to is released first and, if zero-copy, shows its (updated)
shards again afterwards."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import outcore
from outcore.runtime.context import Runtime
from outcore.zero.build import shard_params
from outcore.zero.gathered import gathered_parameters
from outcore.zero.group import GatherGroup
from outcore.zero.param import ShardedParam
from outcore.zero.registry import managed
from outcore.zero.sharding import ShardLayout
from outcore.zero.state import GroupState, ParamState
from tests.distributed import run_world

pytestmark = pytest.mark.cpu_only(
    "shown values are compared with references built on the CPU, and the zero-copy group "
    "is the CPU device's plan")

BF16 = {"dtype": "bf16", "offload": {"params": "cpu", "optimizer": "cpu"}}
FP32 = {"dtype": "fp32", "offload": {"params": "cpu", "optimizer": "cpu"}}
# not representable in bf16: what the context shows must be the exact fp32 master
EXACT = torch.tensor([[1.0 + 2**-10, -3.0 - 2**-12, 0.1], [7.0, 2**-20, -0.3]])


def _shard(module: nn.Module, rt: Runtime) -> list[ShardedParam]:
    return shard_params(module, rt)


def _linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    fc = nn.Linear(3, 2)
    with torch.no_grad():
        fc.weight.copy_(EXACT)
    return fc


def test_the_context_shows_the_exact_fp32_values() -> None:
    rt = Runtime(outcore.Config.from_dict(BF16))
    fc = _linear()
    bias = fc.bias.detach().clone()
    sps = _shard(fc, rt)
    assert fc.weight.dtype == torch.bfloat16, "outside, the parameter is in the compute dtype"
    with gathered_parameters([fc.weight, fc.bias]) as shown:
        assert shown[0] is fc.weight and shown[1] is fc.bias
        assert [sp.state for sp in sps] == [ParamState.SHOWN] * 2 and rt.shown == 2
        assert fc.weight.data.dtype == torch.float32
        assert torch.equal(fc.weight.data, EXACT) and torch.equal(fc.bias.data, bias)
        assert torch.equal(fc.weight.sum(), EXACT.sum()), "reads run as in plain PyTorch"
    assert [sp.state for sp in sps] == [ParamState.SHARDED] * 2 and rt.shown == 0
    assert torch.equal(sps[0].read_value(exact=True), EXACT)


def test_modify_true_writes_back_to_master_and_training_copy() -> None:
    rt = Runtime(outcore.Config.from_dict(BF16))
    fc = _linear()
    sps = _shard(fc, rt)
    with gathered_parameters(fc, modify=True):
        fc.weight.data.mul_(0.5)  # the documented way: full fp32 values, written back
        with torch.no_grad():
            fc.bias.copy_(torch.tensor([2**-11, 3.0]))
    assert torch.equal(sps[0].read_value(exact=True), EXACT * 0.5)
    assert torch.equal(sps[0].read_value(), (EXACT * 0.5).to(torch.bfloat16))
    assert torch.equal(sps[1].read_value(exact=True), torch.tensor([2**-11, 3.0]))
    assert [sp.state for sp in sps] == [ParamState.SHARDED] * 2 and rt.shown == 0


def test_a_body_that_raises_writes_nothing() -> None:
    rt = Runtime(outcore.Config.from_dict(FP32))
    fc = _linear()
    sps = _shard(fc, rt)
    with pytest.raises(KeyError), gathered_parameters(fc, modify=True):
        with torch.no_grad():
            fc.weight.fill_(0.0)
        raise KeyError("the body failed")
    assert torch.equal(sps[0].read_value(exact=True), EXACT)
    assert [sp.state for sp in sps] == [ParamState.SHARDED] * 2 and rt.shown == 0


@pytest.mark.parametrize("write", [
    lambda p: p.add_(1.0), lambda p: p.copy_(torch.zeros(2, 3)), lambda p: p.__setitem__(0, 9.0),
    lambda p: setattr(p, "data", torch.zeros(2, 3)),
], ids=["add_", "copy_", "setitem", "data ="])
def test_modify_false_refuses_a_write_by_name(write: Any) -> None:
    rt = Runtime(outcore.Config.from_dict(FP32))
    fc = _linear()
    sps = _shard(fc, rt)
    with pytest.raises(outcore.ParamAccessError, match=r"weight.*modify=True"), \
            gathered_parameters([fc.weight]), torch.no_grad():
        write(fc.weight)
    assert sps[0].state is ParamState.SHARDED and rt.shown == 0
    assert torch.equal(sps[0].read_value(exact=True), EXACT)


@pytest.mark.parametrize("write", [lambda p: p.data.mul_(0.0), lambda p: p.data[0].zero_(),
                                   lambda p: p.detach().mul_(0.0)],
                         ids=["data.mul_", "data[0].zero_", "detach().mul_"])
def test_modify_false_refuses_a_write_through_data(write: Any) -> None:
    """Past the refusals as it happens (a ``.data`` tensor has a version counter of its
    own), so it is found by its version on exit: refused by name, the shards unchanged (it
    was a known limitation until zero/forward_writes.py)."""
    rt = Runtime(outcore.Config.from_dict(FP32))
    fc = _linear()
    sps = _shard(fc, rt)
    with pytest.raises(outcore.ParamAccessError, match=r"parameter weight was written inside "
                       r"gathered_parameters\(modify=False\).*modify=True"), \
            gathered_parameters([fc.weight]):
        write(fc.weight)
    assert torch.equal(sps[0].read_value(exact=True), EXACT)
    with gathered_parameters([fc.weight]):  # reads through them are not refused
        fc.weight.data.sum()
        fc.weight.detach().abs()


def test_a_module_shows_each_parameter_once_tied_ones_included() -> None:
    rt = Runtime(outcore.Config.from_dict(FP32))
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # tied
    _shard(model, rt)
    with gathered_parameters(model) as shown:
        assert shown == list(model.parameters()) and len(shown) == 1
        assert rt.shown == 1
    assert rt.shown == 0


def test_a_zero_copy_group_shows_its_updated_shards_again_afterwards() -> None:
    rt = Runtime(outcore.Config.from_dict(FP32))
    fc = _linear()
    sps = _shard(fc, rt)
    group = GatherGroup(0, "fc", sps, rt, persistence_threshold_bytes=0)
    assert group.zero_copy
    group.wait_unshard()
    with gathered_parameters([fc.weight], modify=True):
        assert sps[0].state is ParamState.SHOWN and group.state is GroupState.SHARDED
        assert sps[1].state is ParamState.SHARDED, "only the chosen parameter is shown"
        fc.weight.data.fill_(4.0)
    assert group.state is GroupState.UNSHARDED
    assert [sp.state for sp in sps] == [ParamState.GATHERED] * 2
    with torch.no_grad():
        assert torch.equal(fc.weight.detach(), torch.full((2, 3), 4.0))


def _two_ranks() -> dict[str, Any]:
    rt = Runtime(outcore.Config.from_dict(FP32))
    fc = _linear()
    ref_w, ref_b = fc.weight.detach().clone(), fc.bias.detach().clone()
    _shard(fc, rt)
    got: dict[str, Any] = {}
    try:
        fc.weight.sum()
    except outcore.ParamAccessError as e:
        got["refused"] = str(e)
    with gathered_parameters(fc) as shown:
        got["shown_weight"], got["shown_bias"] = shown[0].data.clone(), shown[1].data.clone()
    with gathered_parameters(fc, modify=True), torch.no_grad():
        fc.weight.mul_(2.0)
        fc.bias.copy_(torch.tensor([5.0, 6.0]))
    w, b = managed(fc.weight), managed(fc.bias)
    assert w is not None and b is not None
    got["shard_weight"], got["shard_bias"] = w.values_shard(), b.values_shard()
    got["want_weight"] = ShardLayout(6, 2, rt.rank).cut(2.0 * ref_w)
    got["want_bias"] = ShardLayout(2, 2, rt.rank).cut(torch.tensor([5.0, 6.0]))
    with gathered_parameters([fc.weight]):
        got["after"] = fc.weight.data.clone()
    got["ref_weight"], got["ref_bias"] = ref_w, ref_b
    return got


def test_two_ranks_see_the_full_values_and_write_back_their_own_slices() -> None:
    for got in run_world(_two_ranks, 2):
        assert "gathered_parameters" in got["refused"], "a read outside is refused at W=2"
        assert (got["shown_weight"] == got["ref_weight"]).all()
        assert (got["shown_bias"] == got["ref_bias"]).all()
        assert got["shard_weight"].shape == (3,) and got["shard_bias"].shape == (1,)
        assert (got["shard_weight"] == got["want_weight"]).all()
        assert (got["shard_bias"] == got["want_bias"]).all()
        assert (got["after"] == 2.0 * got["ref_weight"]).all()


def _ask(which: str) -> dict:
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    engine = outcore.initialize(model, {"dtype": "fp32"})
    mine = [model[0].bias if which == "same" or rank == 0 else model[2].bias]
    try:
        with engine.gathered_parameters(mine) as shown:
            got = shown[0].detach().clone()
        said = None
    except outcore.ParamAccessError as e:
        got, said = None, str(e)
    with engine.gathered_parameters([model[2].bias]):  # the ranks still work together
        after = model[2].bias.detach().clone()
    engine.close()
    return {"said": said, "right": got is not None and torch.equal(got, expected["0.bias"]),
            "after": torch.equal(after, expected["2.bias"])}


@pytest.mark.parametrize("which", ["same", "different"])
def test_ranks_asking_for_different_parameters_are_refused_together(which: str) -> None:
    """Rank 0 gathers one bias, rank 1 another of the same size: each rank got wrong values,
    silently (of other sizes, gloo killed a rank). Now every rank refuses, naming what it
    asked for, and the ranks go on in step."""
    for rank, got in enumerate(run_world(_ask, 2, which)):
        assert got["after"], got
        if which == "same":
            assert got["said"] is None and got["right"], got
        else:
            assert "the ranks asked for different parameters" in got["said"], got
            assert ("0.bias (32)" if rank == 0 else "2.bias (32)") in got["said"]


def _fill_ones(kwargs: dict, fills: bool, raises: bool) -> list[Any]:
    """A 2-rank block that writes ones on the ranks ``fills`` says, and raises where
    ``raises``; the error said here, and how many of the weight's values are ones after."""
    torch.manual_seed(0)
    model = nn.Linear(8, 16)
    engine = outcore.initialize(model, {"dtype": "fp32"})
    said = None
    try:
        with engine.gathered_parameters([model.weight], **kwargs):
            if fills:
                model.weight.data.fill_(1.0)
            if raises:
                raise ValueError(f"the body failed on rank {os.environ['RANK']}")
    except (ValueError, outcore.ParamAccessError) as e:
        said = str(e)
    with engine.gathered_parameters([model.weight]):  # the ranks are still in step
        ones = int((model.weight.data == 1.0).sum())
    engine.close()
    return [said, ones]


def _write_on_rank_zero(how: str) -> list[Any]:
    kwargs = {"modifier_rank": 0} if how == "modifier_rank" else {"modify": True}
    rank = int(os.environ["RANK"])
    return _fill_ones(kwargs, fills=rank == 0 or how == "every rank", raises=False)


@pytest.mark.parametrize(("how", "ones"), [("rank 0 alone", 0), ("modifier_rank", 128),
                                           ("every rank", 128)])
def test_writes_on_one_rank_are_refused_or_taken_from_modifier_rank(how: str,
                                                                    ones: int) -> None:
    """DeepSpeed's habit, a write on rank 0 alone: each rank wrote back its own slice, so
    the weight held 64 new values and 64 old ones, with no word. Now refused before anything
    is written, or taken from ``modifier_rank`` on every rank."""
    for said, got in run_world(_write_on_rank_zero, 2, how):
        assert got == ones
        if how == "rank 0 alone":
            assert said is not None and "the ranks wrote different values (compared bit " \
                "for bit) into parameter weight" in said and "modifier_rank=0" in said, said
        else:
            assert said is None, said


def _raise_on_rank_one(kwargs: dict) -> list[Any]:
    return _fill_ones(kwargs, fills=True, raises=os.environ["RANK"] == "1")


@pytest.mark.parametrize("kwargs", [{"modify": True}, {"modifier_rank": 0}, {}])
def test_a_block_that_raises_on_one_rank_writes_nothing_anywhere(kwargs: dict) -> None:
    """The exit's collectives (the digests, the broadcast, the write check) were joined by
    the ranks whose block finished only: paired with the other's next call, or a hang."""
    first, second = run_world(_raise_on_rank_one, 2, kwargs, timeout=120)
    assert first == ["gathered_parameters: the block raised on another rank (see its error); "
                     "nothing was written back on any rank", 0], first
    assert second == ["the body failed on rank 1", 0], second
