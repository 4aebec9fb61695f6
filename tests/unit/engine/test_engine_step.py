"""``engine.step()`` is the optimizer's step as torch code sees it: a scheduler bound to
``engine.optimizer`` (or to the optimizer the engine adopted) counts it, and step hooks run
once per update, as they do around ``optimizer.step()`` in a plain PyTorch loop."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler
from torch.optim.optimizer import register_optimizer_step_post_hook

import outcore
from outcore.device.accel import default_device


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).to(default_device())


def _backward(engine, step: int, boundary: bool = True) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(default_device())
    engine.backward(engine(x).pow(2).mean(), boundary=boundary)


@pytest.mark.parametrize("adopted", [False, True])
def test_a_scheduler_counts_engine_step_as_the_optimizers_step(adopted: bool) -> None:
    """torch warns "lr_scheduler.step() before optimizer.step()" (and would skip the first
    value of some schedules) when the optimizer it is bound to never stepped."""
    model = _model()
    if adopted:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine = outcore.initialize(model, {"dtype": "fp32"}, optimizer=opt)
    else:
        engine = outcore.initialize(model, {"dtype": "fp32", "optimizer": {"lr": 1e-2}})
        opt = engine.optimizer
    sched = lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's warning would fail the test
        for step in range(3):
            _backward(engine, step)
            assert engine.step()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([5e-3, 2.5e-3, 1.25e-3])
    engine.close()


@pytest.mark.parametrize("adopted", [False, True])
def test_step_hooks_run_once_per_update(adopted: bool) -> None:
    """Hooks on the optimizer a user holds, and torch's global ones, run around each update
    ``engine.step()`` makes; a micro-step that updates nothing runs none."""
    model = _model()
    if adopted:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        engine = outcore.initialize(model, {"dtype": "fp32", "gradient_accumulation_steps": 2},
                                    optimizer=opt)
    else:
        engine = outcore.initialize(model, {"dtype": "fp32", "gradient_accumulation_steps": 2})
        opt = engine.optimizer
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, args, kw: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kw: calls.append("post"))
    handle = register_optimizer_step_post_hook(lambda o, args, kw: calls.append("global"))
    try:
        _backward(engine, 0, boundary=False)
        assert not engine.step()  # accumulating: no update, no hook
        assert calls == []
        _backward(engine, 1)
        assert engine.step()
        assert calls == ["pre", "post", "global"]
    finally:
        handle.remove()
    engine.close()


def test_engine_step_and_optimizer_step_update_alike() -> None:
    """The same three steps through ``engine.step()`` and ``engine.optimizer.step()``."""
    weights = []
    for through_engine in (True, False):
        model = _model()
        engine = outcore.initialize(model, {"dtype": "fp32", "optimizer": {"lr": 1e-2}})
        for step in range(3):
            _backward(engine, step)
            if through_engine:
                engine.step()
            else:
                engine.optimizer.step()
        assert engine.global_steps == 3
        weights.append([p.detach().clone() for p in model.parameters()])
        engine.close()
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


@pytest.mark.parametrize("how", ["engine.step", "opt.step"])
def test_with_an_adopted_optimizer_engine_optimizer_hears_of_the_step_too(how: str) -> None:
    """Hooks and a scheduler on ``engine.optimizer`` count the step made through the optimizer
    the engine adopted, as they count one made through ``engine.optimizer`` itself."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = outcore.initialize(model, {"dtype": "fp32"}, optimizer=opt)
    calls: list[str] = []
    opt.register_step_post_hook(lambda o, args, kw: calls.append("adopted"))
    engine.optimizer.register_step_post_hook(lambda o, args, kw: calls.append("engine"))
    sched = lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(2):
            _backward(engine, step)
            engine.step() if how == "engine.step" else opt.step()
            sched.step()
    assert calls == ["engine", "adopted"] * 2
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-3)
    engine.close()


def test_a_step_skipped_for_an_fp16_overflow_runs_no_hook() -> None:
    """As with torch's GradScaler, which does not call ``optimizer.step()`` on an overflow."""
    model = _model()
    engine = outcore.initialize(model, {"dtype": "fp16", "loss_scale": {"initial_scale_power": 4}})
    calls: list[bool] = []
    engine.optimizer.register_step_post_hook(lambda o, args, kw: calls.append(True))
    sched = lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).to(default_device())
    engine.backward(engine(x).float().pow(2).mean() * 1e6)  # overflows fp16 at any scale
    assert not engine.step() and engine.optimizer.skipped and engine.global_steps == 0
    assert calls == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the step was made (and skipped): no torch warning
        sched.step()
    _backward(engine, 1)
    assert engine.step() and calls == [True] and engine.global_steps == 1
    engine.close()


def test_hooks_run_in_the_callers_grad_mode() -> None:
    model = _model()
    engine = outcore.initialize(model, {"dtype": "fp32"})
    seen: list[bool] = []
    engine.optimizer.register_step_pre_hook(lambda o, a, k: seen.append(torch.is_grad_enabled()))
    _backward(engine, 0)
    engine.step()
    _backward(engine, 1)
    with torch.no_grad():
        engine.step()
    assert seen == [True, False]
    engine.close()


@pytest.mark.parametrize("wrapper", ["calls_engine_step", "does_not_call_through"])
def test_a_wrapped_optimizer_step_still_updates_once(wrapper: str) -> None:
    """A user's wrapper on ``engine.optimizer.step`` that calls ``engine.step()`` (which runs
    through that very method) must not recurse; one that forgets to call through must not
    leave the update undone."""
    model = _model()
    engine = outcore.initialize(model, {"dtype": "fp32", "optimizer": {"lr": 1e-2}})
    engine.optimizer.step = (lambda *a, **k: engine.step()) if wrapper == "calls_engine_step" \
        else (lambda *a, **k: None)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(engine, 0)
    assert engine.step()
    assert engine.global_steps == 1 and not engine.is_accumulation_boundary
    after = list(model.parameters())
    assert all(not torch.equal(a, p.detach()) for a, p in zip(before, after, strict=True))
    engine.close()


def test_a_hook_that_runs_the_next_backward_leaves_its_update_to_the_next_step() -> None:
    """One ``engine.step()`` is one update, even when a post-hook has already run the next
    boundary backward (whose gradients the next ``step()`` applies)."""
    model = _model()
    engine = outcore.initialize(model, {"dtype": "fp32"})
    ran: list[int] = []

    def next_backward(opt, args, kwargs) -> None:
        if not ran:
            ran.append(1)
            _backward(engine, 1)

    engine.optimizer.register_step_post_hook(next_backward)
    _backward(engine, 0)
    assert engine.step() and engine.global_steps == 1 and engine.is_accumulation_boundary
    assert engine.step() and engine.global_steps == 2
    engine.close()
