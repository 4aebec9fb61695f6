"""``p.grad`` stays None on a sharded parameter, and code that reads it where torch would show a
gradient hears so once (zero/surface.py's [Note: p.grad stays None, and says so])."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import outcore
from outcore.device.accel import default_device


def _engine(tmp: Path, **cfg) -> tuple[nn.Module, outcore.Engine]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, outcore.initialize(model, {"dtype": "fp32", **cfg})


def _backward(engine: outcore.Engine) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).to(default_device())
    engine.backward(engine(x).pow(2).mean())


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_clip_grad_norm_after_backward_warns_once_at_the_users_line(tmp_path: Path,
                                                                     offload: str) -> None:
    """build-nanogpt's loop clips with torch.nn.utils.clip_grad_norm_ after backward: it
    finds no p.grad, clips nothing and returns 0. The first such read per engine says so,
    pointed at the user's line, and names the config that clips."""
    model, engine = _engine(tmp_path, offload={"params": offload, "optimizer": offload,
                                               "nvme_path": str(tmp_path)})
    _backward(engine)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # once per engine
        assert all(p.grad is None for p in model.parameters())
    assert float(norm) == 0.0
    mine = [w for w in got if issubclass(w.category, outcore.GradReadWarning)]
    assert len(mine) == 1, [str(w.message) for w in got]
    assert mine[0].filename == __file__
    message = str(mine[0].message)
    assert "p.grad is None (read here for parameter 0.weight)" in message
    assert "clip_grad_norm_ clips nothing" in message and "gradient_clipping" in message
    assert engine.step()
    engine.close()


def test_reads_where_torch_shows_none_too_stay_quiet(tmp_path: Path) -> None:
    """Before the first backward, after step(), after zero_grad(), and the reads of
    model.zero_grad() between accumulated backwards: torch's p.grad is None there too (or
    the read is torch's own clean-up), so nothing is said."""
    model, engine = _engine(tmp_path, gradient_accumulation_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", outcore.GradReadWarning)
        assert model[0].weight.grad is None  # nothing ran yet
        _backward(engine)  # the first of two micro-batches
        model.zero_grad()  # drops it; torch's own zero_grad reads every p.grad
        assert [p.grad for p in model.parameters()] == [None] * 4
        _backward(engine)
        model.to(default_device())  # Module._apply moves each p.grad along: not a use of it
        _backward(engine)
        assert engine.step()
        assert model[0].weight.grad is None  # after step(), as torch after zero_grad
        _backward(engine)
        engine.optimizer.zero_grad()
        assert model[2].bias.grad is None
    _backward(engine)  # a gradient held again: the read warns
    with pytest.warns(outcore.GradReadWarning, match="parameter 2.bias"):
        assert model[2].bias.grad is None
    engine.close()


def test_a_frozen_parameter_and_a_closed_engine_stay_quiet(tmp_path: Path) -> None:
    """A parameter that does not train has no gradient in torch either; after close() the
    model is plain torch, whose p.grad is its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    model[0].requires_grad_(False)
    engine = outcore.initialize(model, {"dtype": "fp32"})
    _backward(engine)
    with warnings.catch_warnings():
        warnings.simplefilter("error", outcore.GradReadWarning)
        assert model[0].weight.grad is None
        engine.close()
        model(torch.randn(2, 16)).sum().backward()
        assert model[2].weight.grad is not None


def test_a_second_engine_on_the_model_says_it_again(tmp_path: Path) -> None:
    """A new engine (a second trainer on the same model) is a new run: its first read is
    named too."""
    model, engine = _engine(tmp_path)
    for expected in (1, 1):
        _backward(engine)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert sum(issubclass(w.category, outcore.GradReadWarning) for w in got) == expected
        assert engine.step()
        engine = outcore.initialize(model, {"dtype": "fp32"})
    engine.close()


def test_an_optimizer_the_engine_did_not_adopt_is_named(tmp_path: Path) -> None:
    """A torch optimizer built over model.parameters() after initialize finds no p.grad and
    steps nothing; the notice says what to use instead."""
    model, engine = _engine(tmp_path)
    own = torch.optim.SGD(model.parameters(), lr=1.0)
    before = model[2].weight.detach().clone()
    _backward(engine)
    with pytest.warns(outcore.GradReadWarning, match="optimizer the engine did not adopt "
                      "steps nothing"):
        own.step()
    assert torch.equal(model[2].weight.detach(), before)
    engine.close()


@pytest.mark.parametrize("call", ["unscale_", "step"])
def test_a_grad_scaler_is_refused_in_words(tmp_path: Path, call: str) -> None:
    """An AMP loop ported as it is: ``GradScaler`` finds no ``p.grad`` to unscale or check,
    and torch's own error would be an ``AssertionError`` about inf checks. Said instead as
    what outcore does in its place (loss scaling with ``dtype: fp16``); the engine trains on
    after the scaler is dropped."""
    device = default_device()
    model, engine = _engine(tmp_path)
    scaler = torch.amp.GradScaler(device.type)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).to(device)
    engine.backward(scaler.scale(engine(x).pow(2).mean()))
    with pytest.raises(outcore.OutcoreError, match=r"torch\.amp\.GradScaler cannot unscale .*"
                                                   r"set dtype: fp16 in the config"):
        getattr(scaler, call)(engine.optimizer)
    engine.step()  # the user drops the scaler: the step goes on
    _backward(engine)
    assert engine.step()
    engine.close()


def test_fsdps_sharded_grad_scaler_is_refused_too(tmp_path: Path) -> None:
    """``ShardedGradScaler`` unscales in its own ``_unscale_grads_``; it would find no
    gradient, record no overflow, and step on gradients as large as its scale made them."""
    device = default_device()
    model, engine = _engine(tmp_path)
    scaler = ShardedGradScaler(device=device.type)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).to(device)
    engine.backward(scaler.scale(engine(x).pow(2).mean()))
    with pytest.raises(outcore.OutcoreError, match=r"torch\.amp\.GradScaler cannot unscale"):
        scaler.step(engine.optimizer)
    engine.close()


def _hooked_grads(tmp: Path, offload: str, when: str) -> dict[str, torch.Tensor]:
    """Each parameter's ``p.grad`` as a post-accumulate hook registered ``when`` ("before" or
    "after" ``initialize``, or "torch": no engine) sees it in one backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    seen: dict[str, torch.Tensor] = {}

    def register() -> None:
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda t, name=name: seen.__setitem__(name, t.grad.detach().clone().cpu()))

    if when in ("before", "torch"):
        register()
    engine = None if when == "torch" else outcore.initialize(model, {
        "dtype": "fp32", "offload": {"params": offload, "optimizer": offload,
                                     "nvme_path": str(tmp)}})
    if when == "after":
        register()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    if engine is None:
        model(x).pow(2).mean().backward()
    else:
        engine.backward(engine(x.to(engine.device)).pow(2).mean())
        engine.close()
    return seen


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_a_post_accumulate_hook_registered_after_initialize_sees_every_gradient(
        tmp_path: Path, offload: str) -> None:
    """It ran after the engine's own hook, which reduces a module's gradients once the last
    arrives, and saw None for that last one (each Linear's weight), silently; one registered
    before ``initialize`` saw them all (surface.py's [Note: hooks on a gradient run before
    its reduction])."""
    want = _hooked_grads(tmp_path, offload, "torch")
    for when in ("before", "after"):
        got = _hooked_grads(tmp_path, offload, when)
        assert got.keys() == want.keys(), (when, got.keys())
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, msg=f"{when}: {name}")


def test_a_post_accumulate_hook_at_two_ranks_sees_each_ranks_gradient(tmp_path: Path) -> None:
    """At more ranks the hook sees the rank's own gradient, before the average over ranks:
    each rank runs the same batch here, so that is torch's."""
    from tests.distributed import run_world

    want = _hooked_grads(tmp_path, "none", "torch")
    for got in run_world(_hooked_grads, 2, tmp_path, "none", "after"):
        assert got.keys() == want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(torch.as_tensor(got[name]), grad, msg=name)
