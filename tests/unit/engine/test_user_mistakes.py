"""A user's mistake at the public entry points is an ``OutcoreError`` naming what was given,
never an AttributeError or TypeError from deep inside (found by a user-style probe)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.errors import ConfigError, ParamAccessError


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))


@pytest.mark.parametrize(("model", "words"), [
    (None, "got NoneType"), ("model.pt", "got str"), ({"w": torch.zeros(2)}, "got dict")])
def test_initialize_needs_a_module(model: object, words: str) -> None:
    with pytest.raises(ConfigError, match=f"must be a torch.nn.Module, {words}"):
        outcore.initialize(model, {"dtype": "fp32"})  # type: ignore[arg-type]


def test_a_config_of_another_type_is_named() -> None:
    with pytest.raises(ConfigError, match="expected an outcore.Config, a dict.*got int 42"):
        outcore.initialize(_net(), 42)  # type: ignore[arg-type]


def test_engine_takes_what_initialize_takes() -> None:
    """``outcore.Engine(model, {...})`` raised "'dict' object has no attribute 'optimizer'"."""
    model = _net()
    with outcore.Engine(model, {"dtype": "fp32"}) as engine:
        engine.backward(model(torch.randn(4, 8)).pow(2).mean())
        engine.step()


@pytest.mark.parametrize("given", ["abc", None, True, -5])
def test_config_auto_needs_a_model_or_a_count(given: object) -> None:
    with pytest.raises(ConfigError, match="expected a model .* or a parameter count"):
        outcore.Config.auto(given)


def test_deleting_a_parameters_optimizer_state_is_refused_by_name(tmp_path: Path) -> None:
    model = _net()
    with outcore.initialize(model, {"dtype": "fp32"}) as engine:
        engine.backward(model(torch.randn(4, 8)).pow(2).mean())
        engine.step()
        with pytest.raises(ParamAccessError, match="optimizer state of parameter"):
            del engine.optimizer.state[model[0].weight]
        assert "exp_avg" in engine.optimizer.state[model[0].weight]


def test_tiling_mistakes_are_outcore_errors() -> None:
    with pytest.raises(ConfigError, match="cannot split 8 features into 9 tiles"):
        outcore.TiledLinear(8, 4, in_splits=9, out_splits=1)
    model = _net()
    with outcore.initialize(model, {"dtype": "fp32"}), \
            pytest.raises(ParamAccessError, match="tile layers before outcore.initialize"):
        outcore.tile_linears(model, min_params=1, in_splits=2, out_splits=2)


class _Odd(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        values = torch.randn(5, 3, dtype=dtype) if dtype.is_complex else torch.arange(3)
        self.freq_filter = nn.Parameter(values, requires_grad=dtype.is_complex)


@pytest.mark.parametrize(("dtype", "advice"), [
    (torch.complex64, r"torch.view_as_real\(t\)"), (torch.int64, "register it as a buffer")],
    ids=["complex", "integer"])
@pytest.mark.parametrize("path", ["initialize", "init"])
def test_a_parameter_that_is_not_floating_point_is_refused_by_name(
        dtype: torch.dtype, advice: str, path: str) -> None:
    """A complex or integer parameter was refused as "cannot shard a torch.complex64
    parameter of shape (5, 3)": neither which parameter nor what to do."""
    with pytest.raises(ConfigError, match=f"parameter freq_filter .*{advice}"):
        if path == "init":
            with outcore.init({"dtype": "fp32"}):
                _Odd(dtype)
        else:
            outcore.initialize(_Odd(dtype), {"dtype": "fp32"})
    with outcore.init({"dtype": "fp32"}):  # the refusal left nothing open
        _net()


def test_a_lazy_module_not_yet_run_is_refused_by_name() -> None:
    """An ``nn.LazyLinear`` before its first forward failed inside initialize with torch's
    "Attempted to use an uninitialized parameter in <method 'numel' ...>", and under
    ``outcore.init`` with torch's advice about ``load_state_dict``."""
    model = nn.Sequential(nn.Linear(5, 5), nn.LazyLinear(3))
    with pytest.raises(ConfigError, match=r"parameters 1.weight, 1.bias are not materialised.*"
                                          r"Run the model once on a sample input"):
        outcore.initialize(model, {"dtype": "fp32"})
    model(torch.randn(2, 5))  # materialised: now it is sharded like any other
    with outcore.initialize(model, {"dtype": "fp32"}) as engine:
        engine.backward(engine(torch.randn(2, 5)).pow(2).mean())
        engine.step()
    with pytest.raises(ConfigError, match="outcore.init cannot shard parameter weight of "
                                          "LazyLinear: a lazy module"), \
            outcore.init({"dtype": "fp32"}):
        nn.LazyLinear(3)
    with outcore.init({"dtype": "fp32"}):  # the refusal left nothing open
        _net()


def test_nesting_is_refused_by_name_and_leaves_things_working() -> None:
    """Nested ``outcore.init`` and nested ``gathered_parameters`` on one parameter raised
    internal assertions ("building -> building", "shown -> shown")."""
    inner = outcore.init({"dtype": "fp32"})
    with outcore.init({"dtype": "fp32"}):
        with pytest.raises(ConfigError, match="outcore.init inside another outcore.init"):
            inner.__enter__()
        model = _net()
    with outcore.init({"dtype": "fp32"}):  # the refusal left nothing open
        _net()
    with outcore.initialize(model, {"dtype": "fp32"}) as engine:
        before = model[0].weight.detach().clone()
        with engine.gathered_parameters(), pytest.raises(
                ParamAccessError, match="parameter 0.weight, which an enclosing "
                                        "gathered_parameters shows"), \
                engine.gathered_parameters([model[0].weight], modify=True):
            pass
        assert torch.equal(model[0].weight.detach(), before)
        engine.backward(model(torch.randn(4, 8)).pow(2).mean())
        engine.step()


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_a_gradient_written_by_hand_is_refused(offload: str, tmp_path: Path) -> None:
    """``p.grad = g`` then ``step()``: torch applies ``g``; outcore's update never reads
    ``p.grad``, so the write was silently ignored. Now refused by name; ``= None`` is fine."""
    model = _net()
    with outcore.initialize(model, {"dtype": "fp32", "offload": {
            "params": offload, "optimizer": offload, "nvme_path": str(tmp_path)}}):
        with pytest.raises(ParamAccessError, match=r"assigning parameter 0.bias.grad"):
            model[0].bias.grad = torch.ones(16)
        model[0].bias.grad = None
        assert model[0].bias.grad is None


def _seeded(seed: int, load: bool) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    if load:  # the same weights loaded on every rank make any seed right
        torch.manual_seed(0)
        model.load_state_dict(nn.Sequential(nn.Linear(8, 16), nn.GELU(),
                                            nn.Linear(16, 4)).state_dict())
    try:
        engine = outcore.initialize(model, {"dtype": "fp32"})
    except ConfigError as e:
        return {"error": str(e)}
    engine.close()
    return {"error": None}


@pytest.mark.parametrize("load", [False, True])
def test_ranks_handing_initialize_different_weights_are_refused(load: bool) -> None:
    """A model built with another seed on each rank: every rank kept its slice of its own
    values, a mix equal to neither rank's model, and trained on silently. All ranks refuse
    together, naming parameters; the same weights loaded on each rank pass."""
    from tests.distributed import run_world

    said = run_world(_seeded_by_rank, 2, load)
    if load:
        assert said == [{"error": None}, {"error": None}]
    else:
        for got in said:
            assert got["error"] is not None
            assert "the ranks passed different values for 0.weight, 0.bias, 2.weight" in (
                got["error"]), got
            assert "and 1 more" in got["error"] and "torch.manual_seed" in got["error"]


def _seeded_by_rank(load: bool) -> dict:
    return _seeded(int(os.environ["RANK"]), load)
