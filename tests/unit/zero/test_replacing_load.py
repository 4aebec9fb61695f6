"""A ``load_state_dict`` that would put new tensors in place of sharded parameters
(``assign=True``, or torch's swap flag) is refused before anything loads (zero/surface.py's
``refuse_replacing_load``): the engine would go on training the parameters it sharded while
the model computed with the new ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.device.accel import default_device
from outcore.errors import ParamAccessError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(),
                         nn.Linear(8, 2)).to(default_device())


def _engine(model: nn.Module, offload: str, tmp: Path) -> outcore.Engine:
    return outcore.initialize(model, {
        "dtype": "fp32", "optimizer": {"type": "adamw", "lr": 1e-2},
        "offload": {"params": offload, "optimizer": offload, "nvme_path": str(tmp)}})


def _train(engine: outcore.Engine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step)).to(
            default_device())
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


LOADS = {
    "assign": lambda module, sd: module.load_state_dict(sd, assign=True),
    "swap_flag": lambda module, sd: _swapping(lambda: module.load_state_dict(sd)),
}


def _swapping(load) -> object:
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return load()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


@pytest.mark.parametrize("offload", ["none", "nvme"])
@pytest.mark.parametrize("how", list(LOADS))
@pytest.mark.parametrize("on", ["root", "submodule"])
def test_a_replacing_load_is_refused_and_nothing_loads(offload: str, how: str, on: str,
                                                       tmp_path: Path) -> None:
    twin = _model()
    twin_engine = _engine(twin, offload, tmp_path / "twin")
    want = _train(twin_engine, range(4))
    twin_engine.close()

    model = _model()
    engine = _engine(model, offload, tmp_path / "run")
    got = _train(engine, range(2))
    before, params = _state(model), list(model.parameters())
    target = model if on == "root" else model[0]
    new = {k: torch.full_like(v, 0.5) for k, v in _state(target).items()}
    with pytest.raises(ParamAccessError, match=r"parameter 0\.weight, which outcore shards: the "
                                               r"engine would neither fetch nor train it.*"
                                               "Nothing of this model was loaded$"):
        LOADS[how](target, new)
    after = _state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # buffers too
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    got += _train(engine, range(2, 4))
    assert got == want
    engine.close()


def test_a_plain_load_still_writes_the_shards(tmp_path: Path) -> None:
    """Without assign, the values go into the shards and training starts from them."""
    model = _model()
    engine = _engine(model, "nvme", tmp_path)
    new = {k: torch.full_like(v, 0.25) for k, v in _state(model).items()}
    model.load_state_dict(new)
    assert all(torch.equal(new[k], v) for k, v in _state(model).items())
    _train(engine, range(1))
    assert not torch.equal(model[0].weight.detach(), new["0.weight"])
    engine.close()


def test_after_close_assign_loads_as_in_torch(tmp_path: Path) -> None:
    model = _model()
    _engine(model, "nvme", tmp_path).close()
    new = {k: torch.full_like(v, 0.5) for k, v in _state(model).items()}
    model.load_state_dict(new, assign=True)
    assert all(torch.equal(new[k], v) for k, v in _state(model).items())
    assert model[0].weight is not None and type(model[0].weight) is nn.Parameter


def test_a_refusal_below_the_called_module_says_what_may_have_loaded(tmp_path: Path) -> None:
    """The engine holds a model inside a bigger one; torch loads the modules ahead of it
    first, so the refusal cannot say that nothing was loaded."""
    model = _model()
    engine = _engine(model, "none", tmp_path)
    head = nn.Linear(2, 2).to(default_device())
    wrapper = nn.Sequential(head, model)
    new = {k: torch.full_like(v, 0.5) for k, v in _state(wrapper).items()}
    with pytest.raises(ParamAccessError, match=r"Nothing of this model was loaded \(modules "
                                               r"ahead of '1' in the one load_state_dict was "
                                               r"called on may have been\)"):
        wrapper.load_state_dict(new, assign=True)
    engine.close()
