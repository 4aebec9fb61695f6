"""SGD momentum set after ``initialize`` (param_groups.py's ``check_momentum_kept``): a
scheduler that cycles it over a run that keeps no momentum buffers is refused before any
update; with buffers kept, the cycled momentum trains as torch's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import outcore


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(5)]


def _cyclic(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.CyclicLR:
    return torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=2,
                                             base_momentum=0.8, max_momentum=0.9)


def _cfg(tmp_path: Path, where: str, momentum: float) -> dict:
    return {"dtype": "fp32", "optimizer": {"type": "sgd", "lr": 0.01, "momentum": momentum},
            "offload": {"optimizer": where, "nvme_path": str(tmp_path)}}


@pytest.mark.parametrize("where", ["none", "nvme"])
@pytest.mark.parametrize("adopted", [False, True])
def test_cycled_momentum_without_buffers_is_refused_before_any_update(
        tmp_path: Path, where: str, adopted: bool) -> None:
    """torch's SGD starts keeping a momentum buffer once CyclicLR sets the group's momentum;
    the run here plans none from a momentum of 0, so it would have trained as plain SGD."""
    model = _model()
    if adopted:
        sgd = torch.optim.SGD(model.parameters(), lr=0.01)
        engine = outcore.initialize(model, _cfg(tmp_path, where, 0.0), optimizer=sgd)
        _cyclic(sgd)
    else:
        engine = outcore.initialize(model, _cfg(tmp_path, where, 0.0))
        _cyclic(engine.optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batches()[0]
    with pytest.raises(outcore.ConfigError,
                       match=r"param group 0: momentum=0\.9 at this step.*cycle_momentum=False"):
        engine.backward(nn.functional.mse_loss(engine(x), y.to(engine.device)))
        engine.step()
    engine.close()
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach().cpu(), b.cpu())


@pytest.mark.parametrize("where", ["none", "nvme"])
def test_cycled_momentum_with_buffers_trains_as_torch(tmp_path: Path, where: str) -> None:
    plain = _model()
    opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    sched = _cyclic(opt)
    for x, y in _batches():
        opt.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        opt.step()
        sched.step()
    model = _model()
    engine = outcore.initialize(model, _cfg(tmp_path, where, 0.9))
    sched = _cyclic(engine.optimizer)
    for x, y in _batches():
        engine.backward(nn.functional.mse_loss(engine(x), y.to(engine.device)))
        engine.step()
        sched.step()
    engine.close()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", ["none", "nvme"])
def test_momentum_set_on_one_group_is_refused_before_any_group_updates(
        tmp_path: Path, where: str) -> None:
    """With the state on NVMe updates start in backward, group by group: the refusal came
    when the edited group's turn came, after the others had been updated."""
    model = _model()
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}]
    engine = outcore.initialize(model, _cfg(tmp_path, where, 0.0), param_groups=groups)
    engine.param_groups[0]["momentum"] = 0.5  # the first layer: the last updated in backward
    before = [p.detach().cpu().clone() for p in model.parameters()]
    x, y = _batches()[0]
    with pytest.raises(outcore.ConfigError, match=r"param group 0: momentum=0\.5"):
        engine.backward(nn.functional.mse_loss(engine(x), y.to(engine.device)))
        engine.step()
    engine.close()
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach().cpu(), b)
