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
             steps: int = 3, match: str = r"converting the model to torch\.float",
             ) -> tuple[list[float], list[torch.Tensor]]:
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
            params = list(model.parameters())
            with pytest.raises(ParamAccessError, match=match):
                convert(model)
            assert all(p.dtype == torch.float32 for p in model.parameters())
            assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
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


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_a_move_to_the_meta_device_is_refused_and_training_goes_on(offload: str,
                                                                   tmp_path: Path) -> None:
    """``model.to("meta")`` replaced every parameter with an empty one at fp32 in memory (the
    model could no longer compute) and did nothing at all elsewhere."""
    want = _trained(offload, tmp_path / "a", None)
    got = _trained(offload, tmp_path / "b", lambda m: m.to("meta"),
                   match=r"model.to\('meta'\) on parameter 0.weight")
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


FUTURE_FLAGS = {
    "overwrite": torch.__future__.set_overwrite_module_params_on_conversion,
    "swap": torch.__future__.set_swap_module_params_on_conversion,
}


def _under(flag: str, convert: Callable[[nn.Module], object]) -> Callable[[nn.Module], object]:
    """``convert`` with one of torch's ``torch.__future__`` conversion flags set, and unset
    after (they are process-wide)."""
    def run(model: nn.Module) -> object:
        FUTURE_FLAGS[flag](True)
        try:
            return convert(model)
        finally:
            FUTURE_FLAGS[flag](False)
    return run


@pytest.mark.parametrize("offload", ["none", "nvme"])
@pytest.mark.parametrize("flag", list(FUTURE_FLAGS))
@pytest.mark.parametrize("name", ["half", "float", "to_device"])
def test_a_conversion_that_would_replace_parameters_is_refused(offload: str, flag: str,
                                                               name: str, tmp_path: Path) -> None:
    """With torch's flags a conversion puts new parameters in the model (or swaps their
    contents); the engine would train the old ones, silently. Even a conversion to the
    dtype the model already has (``.float()``) or to its own device would replace them."""
    convert = {"half": lambda m: m.half(), "float": lambda m: m.float(),
               "to_device": lambda m: m.to(default_device())}[name]
    want = _trained(offload, tmp_path / "a", None)
    got = _trained(offload, tmp_path / "b", _under(flag, convert),
                   match=rf"torch\.__future__\.set_{flag}_module_params_on_conversion\(True\)"
                         r": torch would replace parameter 0\.weight")
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))


@pytest.mark.parametrize("flag", list(FUTURE_FLAGS))
def test_after_close_the_flags_convert_as_in_torch(flag: str, tmp_path: Path) -> None:
    """Handed back, the parameters are plain: nothing of outcore's (a weak reference, which
    torch's swap refuses) stays on them, and the conversion happens as it would in torch."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(default_device())
    engine = outcore.initialize(model, {"dtype": "fp32", "offload": {
        "params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)}})
    engine.close()
    values = [p.detach().clone() for p in model.parameters()]
    _under(flag, lambda m: m.double())(model)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert all(torch.equal(a.double(), p.detach())
               for a, p in zip(values, model.parameters(), strict=True))


def test_a_replacing_conversion_under_init_says_to_set_the_dtype(tmp_path: Path) -> None:
    with outcore.init({"dtype": "fp32"}):
        model = nn.Linear(4, 4)
    with pytest.raises(ParamAccessError, match=r"overwrite_module_params_on_conversion\(False\) "
                                               "while outcore holds the model; outcore.initialize "
                                               "takes the model as it is; set dtype"):
        _under("overwrite", lambda m: m.float())(model)
    weight = model.weight
    engine = outcore.initialize(model, {"dtype": "fp32", "optimizer": {"lr": 0.1}})
    before = weight.detach().clone()
    engine.backward(engine(torch.ones(2, 4, device=default_device())).sum())
    engine.step()
    assert model.weight is weight and not torch.equal(before, weight.detach())
    engine.close()


@pytest.mark.parametrize("flag", list(FUTURE_FLAGS))
def test_after_a_close_that_dropped_the_values_the_flags_say_so(flag: str,
                                                                 tmp_path: Path) -> None:
    model = nn.Linear(4, 4).to(default_device())
    outcore.initialize(model, {"dtype": "fp32"}).close(keep_values=False)
    with pytest.raises(ParamAccessError, match="has no values: its engine closed without "
                                               "keeping them"):
        _under(flag, lambda m: m.half())(model)
    with pytest.raises(ParamAccessError, match="has no values"):  # as weight_norm makes one
        nn.Parameter(model.weight)


def test_share_memory_is_refused_as_the_call_the_user_made(tmp_path: Path) -> None:
    """``model.share_memory()`` (Hogwild training) calls ``share_memory_`` on every
    parameter; the refusal says so, names torchrun, and training goes on as a twin's."""
    want = _trained("nvme", tmp_path / "a", None)
    got = _trained("nvme", tmp_path / "b", lambda m: m.share_memory(),
                   match=r"model\.share_memory\(\): outcore keeps parameter 0\.weight in shards "
                         r".*torchrun")
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    model = nn.Linear(4, 4).to(default_device())
    engine = outcore.initialize(model, {"dtype": "fp32"})
    with pytest.raises(ParamAccessError, match=r"share_memory_ on parameter weight: it would "
                                               "change the storage"):
        model.weight.share_memory_()  # the tensor's own call keeps its own words
    engine.close()


def _conv_losses(nvme: str, convert: bool) -> list[float]:
    """A conv net trained 3 steps, ``model.to(memory_format=torch.channels_last)`` after
    ``initialize`` (``convert``), inputs in channels_last either way; each rank on the same
    batch, so any world size trains as one process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 4, 3),
                          nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    place = "nvme" if nvme else "none"
    engine = outcore.initialize(model, {
        "dtype": "fp32", "optimizer": {"type": "adamw", "lr": 1e-2},
        "offload": {"params": place, "optimizer": place, "nvme_path": nvme or "."}})
    if convert:
        assert model.to(memory_format=torch.channels_last) is model
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last)
        loss = engine(x.to(engine.device)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses


@pytest.mark.parametrize(("world", "offload"), [(1, "none"), (1, "nvme"), (2, "none")])
def test_a_memory_format_conversion_keeps_the_values(tmp_path: Path, world: int,
                                                     offload: str) -> None:
    """The layout is outcore's (it computes with full tensors gathered from flat shards), so
    ``model.to(memory_format=...)`` changes nothing and training is the same; at more ranks
    it was refused as a read of one rank's values, naming gathered_parameters."""
    from tests.distributed import run_world

    nvme = str(tmp_path) if offload == "nvme" else ""
    want = _conv_losses(nvme, convert=False)
    got = ([_conv_losses(nvme, True)] if world == 1
           else run_world(_conv_losses, world, nvme, True))
    for losses in got:
        assert losses == pytest.approx(want, rel=1e-6, abs=1e-7)
