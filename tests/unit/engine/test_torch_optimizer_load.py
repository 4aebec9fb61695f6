"""``engine.optimizer.load_state_dict`` and ``state_dict`` as torch's optimizers have them:
a state dict without a parameter's state leaves it without state, SGD's round trip with
``torch.optim.SGD`` both ways, and hyper-parameters no config would take are refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore


def _data(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 4, generator=g) for _ in range(n)]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _pair(tmp_path: Path, kind: str, **hp: float) -> tuple[nn.Module, outcore.Engine,
                                                              nn.Module, torch.optim.Optimizer]:
    """An engine over a model and plain torch over its twin, the same hyper-parameters."""
    torch.manual_seed(0)
    model, twin = nn.Linear(4, 1), nn.Linear(4, 1)
    twin.load_state_dict(model.state_dict())
    cfg = {"dtype": "fp32", "optimizer": {"type": kind, "lr": 0.1, **hp},
           "offload": {"optimizer": "nvme", "nvme_path": str(tmp_path / "swap")}}
    plain = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[kind]
    return model, outcore.initialize(model, cfg), twin, plain(twin.parameters(), lr=0.1, **hp)


def _train(model: nn.Module, step: object, backward: object, data: list[torch.Tensor]
           ) -> list[float]:
    out = []
    for x in data:
        loss = _loss(model, x)
        backward(loss)  # type: ignore[operator]
        step()  # type: ignore[operator]
        out.append(loss.item())
    return out


def test_a_fresh_optimizers_state_dict_restarts_the_moments(tmp_path: Path) -> None:
    """Loading a fresh AdamW's state dict (empty ``state``) to restart the moments kept the
    old ones and the step count; torch's load leaves the parameters without state."""
    model, engine, twin, plain = _pair(tmp_path, "adamw", weight_decay=0.01)
    data = _data(4)

    def plain_step() -> None:
        plain.step()
        plain.zero_grad()

    _train(model, engine.step, engine.backward, data[:2])
    _train(twin, plain_step, lambda loss: loss.backward(), data[:2])
    fresh = torch.optim.AdamW(nn.Linear(4, 1).parameters(), lr=0.1,
                              weight_decay=0.01).state_dict()
    engine.optimizer.load_state_dict(fresh)
    plain.load_state_dict(fresh)
    assert len(engine.optimizer.state) == 0 == len(plain.state)
    assert engine.optimizer.state_dict()["state"] == {}
    got = _train(model, engine.step, engine.backward, data[2:])
    want = _train(twin, plain_step, lambda loss: loss.backward(), data[2:])
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
    engine.close()


def test_sgd_state_dicts_round_trip_with_torchs_sgd(tmp_path: Path) -> None:
    """The engine's SGD state dict had no ``dampening``: torch's SGD loaded it and then
    failed in ``step()`` with a KeyError. A torch SGD state dict (no ``step``) loaded into
    the engine trained with its momentum but ``state_dict()`` then gave none back."""
    model, engine, twin, plain = _pair(tmp_path, "sgd", momentum=0.9)
    data = _data(4)
    _train(model, engine.step, engine.backward, data[:2])
    saved = engine.optimizer.state_dict()
    assert saved["param_groups"][0]["dampening"] == 0
    plain.load_state_dict(saved)
    twin.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    plain.zero_grad()
    _loss(twin, data[2]).backward()
    plain.step()  # torch's own SGD steps on it

    engine.close()

    model, engine, twin, plain = _pair(tmp_path, "sgd", momentum=0.9)  # torch's own state
    for x in data[:2]:
        plain.zero_grad()
        _loss(twin, x).backward()
        plain.step()
    theirs = plain.state_dict()
    assert all("step" not in entry for entry in theirs["state"].values())
    engine.optimizer.load_state_dict(theirs)
    back = engine.optimizer.state_dict()["state"]
    assert sorted(back) == sorted(theirs["state"])
    for i, entry in theirs["state"].items():
        assert torch.equal(back[i]["momentum_buffer"], entry["momentum_buffer"])
    engine.close()


@pytest.mark.parametrize("key,value", [("lr", math.nan), ("lr", -1e-3), ("eps", 0.0),
                                       ("weight_decay", -0.1), ("betas", (0.9, 1.0)),
                                       ("betas", (math.nan, 0.999)), ("lr", "fast")])
def test_hyper_parameters_no_config_takes_are_refused_by_a_load(
        tmp_path: Path, key: str, value: object) -> None:
    """A NaN learning rate trained every weight to NaN; negative ones and betas outside
    [0, 1) were taken too, though the config refuses them."""
    model, engine, _, _ = _pair(tmp_path, "adamw")
    _train(model, engine.step, engine.backward, _data(1))
    sd = engine.optimizer.state_dict()
    sd["param_groups"][0][key] = value
    before = [dict(g) for g in engine.param_groups]
    with pytest.raises(outcore.ConfigError, match=rf"param group 0: {key}="):
        engine.optimizer.load_state_dict(sd)
    assert [dict(g) for g in engine.param_groups] == before
    sd["param_groups"][0]["lr"] = 0.0  # a warm-up's first learning rate is a number
    sd["param_groups"][0]["betas"] = (0.9, 0.999)
    sd["param_groups"][0]["eps"] = 1e-8
    sd["param_groups"][0]["weight_decay"] = 0.0
    engine.optimizer.load_state_dict(sd)
    assert engine.param_groups[0]["lr"] == 0.0
    engine.close()


def test_param_groups_with_a_nan_learning_rate_are_refused_by_initialize(
        tmp_path: Path) -> None:
    model = nn.Linear(4, 1)
    with pytest.raises(outcore.ConfigError, match=r"param_groups\[0\]: lr=nan is not finite"):
        outcore.initialize(model, {"dtype": "fp32"},
                           param_groups=[{"params": list(model.parameters()), "lr": math.nan}])


def test_numpy_numbers_are_numbers_to_a_load_and_to_initialize(tmp_path: Path) -> None:
    """A schedule computed with NumPy gives ``np.float32`` and ``np.float64`` learning rates:
    torch takes them, and a load refused them as "not a finite number"."""
    np = pytest.importorskip("numpy")
    model, engine, twin, plain = _pair(tmp_path, "adamw")
    data = _data(3)

    def plain_step() -> None:
        plain.step()
        plain.zero_grad()

    sd = engine.optimizer.state_dict()
    for group in (sd["param_groups"][0], plain.param_groups[0]):
        group.update(lr=np.float32(0.05), weight_decay=np.float64(0.01), eps=np.float32(1e-6))
    engine.optimizer.load_state_dict(sd)
    got = _train(model, engine.step, engine.backward, data)
    want = _train(twin, plain_step, lambda loss: loss.backward(), data)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
    engine.close()
    model = nn.Linear(4, 1)
    engine = outcore.initialize(model, {"dtype": "fp32"}, param_groups=[
        {"params": list(model.parameters()), "lr": np.float64(0.01)}])
    assert engine.param_groups[0]["lr"] == 0.01
    engine.close()
    for bad, said in ((True, "lr=True is not a number"), (np.float32("inf"), "is not finite"),
                      (np.float64(-1.0), "lr=.*-1.0.* must be at least 0")):
        with pytest.raises(outcore.ConfigError, match=said):
            outcore.initialize(model, {"dtype": "fp32"}, param_groups=[
                {"params": list(model.parameters()), "lr": bad}])
