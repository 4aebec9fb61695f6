"""A parameter's named states and who moves it (zero/state.py, zero/param.py, zero/surface.py,
engine/lifetime.py): the states a test can ask for, the moves that are refused, and what the
model is after ``close()``, a hand-over and a failed forward."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.engine import lifetime
from outcore.runtime.phase import Phase
from outcore.zero.registry import managed
from outcore.zero.state import ParamState


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _cfg(tmp: Path, **over) -> dict:
    return {"dtype": "fp32", "offload": {"params": "nvme", "optimizer": "nvme",
                                         "nvme_path": str(tmp)},
            "zero": {"persistence_threshold_bytes": 0}, **over}


def test_states_through_a_life(tmp_path: Path) -> None:
    model = _model()
    engine = outcore.initialize(model, _cfg(tmp_path))
    sp = managed(model[0].weight)
    assert sp.state is ParamState.SHARDED and engine.rt.phase is Phase.IDLE
    assert type(model[0].weight).__name__ == "ShardedParameter"
    seen = []
    model[0].register_forward_pre_hook(lambda *a: seen.append((sp.state, engine.rt.phase)))
    engine.backward(engine(torch.randn(2, 16)).sum())
    assert seen == [(ParamState.GATHERED, Phase.FORWARD)]
    engine.step()  # and starts reading the next forward's first layer (schedule.py's note)
    assert sp.state is ParamState.FETCHING and engine.rt.phase is Phase.IDLE
    assert torch.isfinite(model[0].weight.sum())  # a read finishes the fetch
    assert sp.state is ParamState.GATHERED
    with engine.gathered_parameters([model[0].weight]):
        assert sp.state is ParamState.SHOWN
    assert sp.state is ParamState.SHARDED
    with pytest.raises(AssertionError, match="gathered -> fetching"):
        sp.state = ParamState.SHARDED
        sp._move(ParamState.GATHERED)
        sp._move(ParamState.FETCHING)  # GATHERED may only go back to SHARDED
    sp.state = ParamState.SHARDED
    engine.close()
    assert sp.state is ParamState.HANDED_BACK
    assert type(model[0].weight) is nn.Parameter and managed(model[0].weight) is None


def test_close_hands_back_a_plain_model_in_its_own_dtypes(tmp_path: Path) -> None:
    """A bf16 engine: the model comes back fp32, buffers included, with the trained values,
    and calls it as plain PyTorch would."""
    model = _model()
    model.register_buffer("scale", torch.ones(4))
    engine = outcore.initialize(model, _cfg(tmp_path, dtype="bf16"))
    assert model[0].weight.dtype == torch.bfloat16 and model.scale.dtype == torch.bfloat16
    engine.backward(engine(torch.randn(2, 16)).float().sum())
    engine.step()
    with engine.gathered_parameters():
        trained = {n: p.data.clone() for n, p in model.named_parameters()}
    engine.close()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.scale.dtype == torch.float32
    for name, p in model.named_parameters():  # back on the device it came on
        assert torch.equal(p.detach(), trained[name].cpu()), name
    x = torch.randn(3, 16)
    assert model(x).dtype == torch.float32
    assert not list(tmp_path.rglob("*.swap")), "close() deletes the swap"


def test_an_fp32_run_keeps_a_float64_buffer_and_its_precision(tmp_path: Path) -> None:
    """A float64 buffer was cast to fp32 in an fp32 run and came back float64 at close with
    its low bits gone (a user's probe); plain PyTorch keeps it as it is, and so does the
    engine now. A 16-bit buffer (a model loaded in bf16) is still computed with in fp32, as
    its parameters are: a reviewer found BatchNorm's bf16 running stats refused by torch."""
    model = _model()
    model.register_buffer("fine", torch.tensor([1 + 1e-12], dtype=torch.float64))
    model.register_buffer("low", torch.ones(4, dtype=torch.bfloat16))
    engine = outcore.initialize(model, _cfg(tmp_path, dtype="fp32"))
    assert (model.fine.dtype, model.low.dtype) == (torch.float64, torch.float32)
    assert model.state_dict()["fine"].dtype == torch.float64
    engine.backward(engine(torch.randn(2, 16)).sum())
    engine.step()
    engine.close()
    assert model.fine.dtype == torch.float64 and float(model.fine - 1) > 0
    assert model.low.dtype == torch.bfloat16  # back as it came


def test_a_model_loaded_in_bf16_trains_in_an_fp32_run(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to(torch.bfloat16)
    engine = outcore.initialize(model, _cfg(tmp_path, dtype="fp32"))
    engine.backward(engine(torch.randn(4, 8)).float().sum())
    engine.step()
    engine.close()
    assert model[1].running_mean.dtype == torch.bfloat16


def test_model_call_casts_inputs_as_the_engine_does(tmp_path: Path) -> None:
    """``model(x)`` with fp32 inputs on a bf16 engine: what ``engine(x)`` computes."""
    model = _model()
    engine = outcore.initialize(model, _cfg(tmp_path, dtype="bf16"))
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(model(x), engine(x))
        model.eval()
        assert torch.equal(model(x), engine(x))
    engine.close()


def test_a_model_too_large_to_hand_back_is_dropped_and_says_how(tmp_path: Path,
                                                                monkeypatch) -> None:
    model = _model()
    engine = outcore.initialize(model, _cfg(tmp_path))
    engine.backward(engine(torch.randn(2, 16)).sum())
    engine.step()
    with engine.gathered_parameters():
        trained = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(lifetime, "available_memory", lambda: type("A", (), {"bytes": 1000})())
    engine.close()
    w = model[0].weight
    assert managed(w).state is ParamState.DROPPED
    assert w.shape == (16, 16) and w.dtype == torch.float32  # metadata still answers
    for read in (lambda: w.sum(), lambda: model.state_dict(), lambda: w.data.norm(),
                 lambda: model(torch.randn(2, 16))):
        with pytest.raises(outcore.ParamAccessError, match="keep_values=True"):
            read()
    assert "values dropped" in repr(w)
    with pytest.raises(outcore.ParamAccessError, match="no values"):
        outcore.initialize(model, _cfg(tmp_path))
    model.load_state_dict(trained)  # whole writes make the parameters plain again
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert torch.equal(model[0].weight.detach(), trained["0.weight"])


def test_a_second_engine_with_another_placement_moves_the_shards(tmp_path: Path) -> None:
    """The first engine is detached and refuses use; its swap is deleted; values carry."""
    model = _model()
    first = outcore.initialize(model, _cfg(tmp_path / "a"))
    first.backward(first(torch.randn(2, 16)).sum())
    first.step()
    with first.gathered_parameters():
        trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert list((tmp_path / "a").rglob("*.swap"))
    second = outcore.initialize(model, _cfg(tmp_path / "b"))
    assert not list((tmp_path / "a").rglob("*.swap")) and list((tmp_path / "b").rglob("*.swap"))
    with pytest.raises(outcore.EngineClosedError, match="handed its model to a newer engine"):
        first(torch.randn(2, 16))
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained[name]), name
    second.backward(second(torch.randn(2, 16)).sum())
    assert second.step()
    second.close()
    first.close()  # a no-op now


def test_writes_inside_the_forward_are_refused(tmp_path: Path) -> None:
    class Renorm(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.weight.div_(self.weight.norm())
            return super().forward(x)

    torch.manual_seed(0)
    model = nn.Sequential(Renorm(8, 8))
    engine = outcore.initialize(model, _cfg(tmp_path))
    with pytest.raises(outcore.ParamAccessError, match="inside the engine's forward"):
        engine(torch.randn(2, 8))
    assert engine.rt.phase is Phase.IDLE
    assert managed(model[0].weight).state is ParamState.SHARDED
    engine.close()


def test_gathered_parameters_refuses_discarded_writes_and_training(tmp_path: Path) -> None:
    model = _model()
    engine = outcore.initialize(model, _cfg(tmp_path))
    with engine.gathered_parameters([model[0].weight]), torch.no_grad(), pytest.raises(
            outcore.ParamAccessError, match="modify=True"):
        model[0].weight.fill_(1.0)
    with engine.gathered_parameters(modify=True):
        with torch.no_grad():
            model[0].weight.fill_(1.0)
        out = model(torch.ones(1, 16))  # the model runs on the shown values
        with pytest.raises(outcore.ParamAccessError, match="call it outside the context"):
            engine.backward(out.sum())
    assert torch.equal(model[0].weight.detach(), torch.ones(16, 16, device=engine.device))
    engine.close()


def test_the_optimizer_in_backward_has_updated_the_values_before_step(tmp_path: Path) -> None:
    """With updates during backward (state on NVMe, no clipping), a read between a boundary
    backward and step() sees the new values: the documented exception to plain PyTorch."""
    model = _model()
    engine = outcore.initialize(model, _cfg(tmp_path))
    assert engine.overlaps_optimizer
    before = model[2].bias.detach()
    engine.backward(engine(torch.randn(2, 16)).sum())
    assert not torch.equal(model[2].bias.detach(), before)
    engine.step()
    engine.close()


def test_bf16_reads_show_the_training_dtype_and_writes_keep_fp32(tmp_path: Path) -> None:
    """A bf16 engine: a read gives the bf16 values forward uses; a write lands in the fp32
    master exactly (what gathered_parameters and the next step see)."""
    model = _model()
    engine = outcore.initialize(model, _cfg(tmp_path, dtype="bf16"))
    exact = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model[2].weight.copy_(exact)
    assert model[2].weight.dtype == torch.bfloat16
    exact = exact.to(engine.device)  # reads show values where the engine computes
    assert torch.equal(model[2].weight.detach(), exact.to(torch.bfloat16))
    with engine.gathered_parameters([model[2].weight]):
        assert torch.equal(model[2].weight.data, exact)
    engine.close()


def test_a_bf16_forward_inside_gathered_parameters_is_refused_in_words(tmp_path: Path) -> None:
    """The context shows fp32 values that cannot meet bf16 activations: calling the model
    there is refused by outcore, not by a kernel's dtype mismatch, and leaves it usable."""
    model = _model()
    engine = outcore.initialize(model, _cfg(tmp_path, dtype="bf16"))
    x = torch.randn(2, 16)
    with engine.gathered_parameters([model[0].weight]), pytest.raises(
            outcore.ParamAccessError, match="inside gathered_parameters.*torch.float32"):
        model(x)
    assert engine.rt.phase is Phase.IDLE
    sp = managed(model[0].weight)  # as before the context: a copy kept in memory is shown
    assert sp.state is (ParamState.GATHERED if sp.group.zero_copy else ParamState.SHARDED)
    assert engine(x).dtype == torch.bfloat16
    engine.close()


VIEW_DATA_SET = """
import sys, torch, outcore
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16))
engine = outcore.initialize(model, {"dtype": "fp32", "zero": {"persistence_threshold_bytes": 0},
    "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": sys.argv[1]}})
before = model[0].weight.detach().clone()
for view in (model[0].weight.data[0], model[0].weight.data.t()[1:3]):
    try:
        view.data = torch.zeros(view.shape)
    except outcore.ParamAccessError as e:
        assert "view of parameter 0.weight" in str(e), e
    else:
        raise AssertionError("view.data = t was not refused")
assert torch.equal(model[0].weight.detach(), before)
engine.close()
print("refused, values kept")
"""


def test_assigning_data_of_a_view_is_refused_not_lost(tmp_path: Path) -> None:
    """``view.data = t`` rebinds only the view in plain PyTorch; a view of a sharded
    parameter holds no bytes to rebind, so the assignment is refused rather than dropped,
    and the parameter keeps its values. In a subprocess: before the refusal the call rebound
    a view onto a zero-byte storage, which took the test process down."""
    proc = subprocess.run([sys.executable, "-c", VIEW_DATA_SET, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "refused, values kept" in proc.stdout


def test_a_build_that_fails_leaves_the_model_as_it_came(tmp_path: Path) -> None:
    """initialize refusing before it shards (a bad param group, Adafactor with its state on
    NVMe) or after (the optimizer's own check) leaves the parameters plain, with their
    values, and no swap file."""
    transformers = pytest.importorskip("transformers")
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(outcore.ConfigError, match="Adafactor needs offload.optimizer"):
        outcore.initialize(model, {**_cfg(tmp_path), "optimizer": {"type": "adafactor"}})
    with pytest.raises(outcore.ConfigError, match="param_groups"):
        outcore.initialize(model, _cfg(tmp_path), [{"params": list(model.parameters()),
                                                     "amsgrad": True}])
    opt = transformers.optimization.Adafactor(model.parameters(), lr=None)
    opt.param_groups[0]["relative_step"] = False  # checked once the shards exist
    with pytest.raises(outcore.ConfigError, match="lr=None needs relative_step"):
        outcore.initialize(model, {"dtype": "fp32", "offload": {"optimizer": "cpu"}},
                           optimizer=opt)
    assert all(type(p) is nn.Parameter and managed(p) is None for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    assert not list(tmp_path.rglob("*.swap"))
