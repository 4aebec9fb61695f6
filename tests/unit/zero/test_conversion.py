"""``model.half()``, ``.float()``, ``.double()``, ``.to(dtype)`` after ``outcore.initialize``.

torch converts a module by assigning each parameter's ``.data``; outcore computes in the
config's dtype and keeps fp32 masters, so a conversion is refused, said as the call the user
made (zero/calls.py's ``dtype_refusal``), before any parameter changed, and training goes
on exactly as if it had not been tried. An assignment to ``.data`` itself keeps its own words.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.device.accel import default_device
from outcore.errors import ParamAccessError

CONVERSIONS: dict[str, Callable[[nn.Module], object]] = {
    "half": lambda m: m.half(),
    "double": lambda m: m.double(),
    "to_float16": lambda m: m.to(torch.float16),
    "to_device_and_float64": lambda m: m.to(default_device(), torch.float64),
}


def _trained(offload: str, tmp: Path, convert: Callable[[nn.Module], object] | None,
             steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(default_device())
    engine = outcore.initialize(model, {
        "dtype": "fp32", "optimizer": {"type": "adamw", "lr": 1e-2},
        "offload": {"params": offload, "optimizer": offload, "nvme_path": str(tmp)}})
    losses = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).to(
            default_device())
        if step == 1 and convert is not None:
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(ParamAccessError, match=r"converting the model to torch\.float"):
                convert(model)
            assert all(p.dtype == torch.float32 for p in model.parameters())
            assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(),
                                                                   strict=True))
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = [p.detach().clone() for p in model.parameters()]
    engine.close()
    return losses, weights


@pytest.mark.parametrize("offload", ["none", "nvme"])
@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_a_conversion_is_refused_and_training_goes_on(offload: str, name: str,
                                                       tmp_path: Path) -> None:
    want = _trained(offload, tmp_path / "a", None)
    got = _trained(offload, tmp_path / "b", CONVERSIONS[name])
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))


def test_a_data_assignment_keeps_its_own_words(tmp_path: Path) -> None:
    model = nn.Linear(4, 4).to(default_device())
    engine = outcore.initialize(model, {"dtype": "fp32", "offload": {
        "params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)}})
    with pytest.raises(ParamAccessError, match=r"assigning a torch\.float16 tensor to "
                                               r"parameter weight\.data"):
        model.weight.data = torch.zeros(4, 4, dtype=torch.float16, device=default_device())
    model.float()  # the dtype it computes in: nothing to convert
    engine.close()


def test_a_conversion_under_init_says_to_set_the_dtype(tmp_path: Path) -> None:
    cfg = {"dtype": "fp32", "offload": {"params": "nvme", "optimizer": "nvme",
                                        "nvme_path": str(tmp_path)}}
    with outcore.init(cfg):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    with pytest.raises(ParamAccessError, match="built under outcore.init.*set dtype in the "
                                               "config instead"):
        model.half()
    engine = outcore.initialize(model, cfg)  # and it trains after
    loss = engine(torch.randn(2, 8, device=default_device())).sum()
    engine.backward(loss)
    engine.step()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    engine.close()
