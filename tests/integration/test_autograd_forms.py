"""Backward forms beyond ``engine.backward(loss)``: two losses of one forward
(``retain_graph``), and ``backward(inputs=...)`` (calls.py's ``refuse_backward_into_params``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.errors import ParamAccessError
from tests.common import assert_states_close, on_ranks

BATCH, STEPS = 8, 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 4, generator=g)


def _cfg(offload: str, swap: str) -> dict:
    return {"dtype": "fp32", "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
            "offload": {"params": offload, "optimizer": offload, "nvme_path": swap}}


def _two_losses_torch() -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch()
    for _ in range(STEPS):
        opt.zero_grad()
        out = model(x)
        nn.functional.mse_loss(out, y).backward(retain_graph=True)
        out.pow(2).mean().mul(0.1).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _two_losses(offload: str, swap: str) -> dict[str, torch.Tensor]:
    model = _model()
    engine = outcore.initialize(model, _cfg(offload, swap))
    rank, world = engine.rank, engine.world_size
    x, y = (t[rank * BATCH // world:(rank + 1) * BATCH // world].to(engine.device)
            for t in _batch())
    for _ in range(STEPS):
        out = engine(x)
        engine.backward(nn.functional.mse_loss(out, y), retain_graph=True, boundary=False)
        engine.backward(out.pow(2).mean().mul(0.1))
        engine.step()
    engine.close(keep_values=True)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("world", "offload"), [(1, "none"), (1, "nvme"), (2, "none"),
                                                (2, "nvme")])
def test_two_losses_of_one_forward_train_as_torch(tmp_path: Path, world: int,
                                                  offload: str) -> None:
    """``engine.backward`` had no ``retain_graph``: the second loss of one forward met torch's
    "backward through the graph a second time", whose advice it could not follow."""
    assert_states_close(on_ranks(world, _two_losses, offload, str(tmp_path)),
                        _two_losses_torch())


def _backward_into(offload: str, swap: str) -> str:
    model = _model()
    with outcore.initialize(model, _cfg(offload, swap)) as engine:
        x = _batch()[0].to(engine.device).requires_grad_()
        out = engine(x)
        out.sum().backward(inputs=[x], retain_graph=True)  # an input's gradient: PyTorch's
        assert x.grad is not None and x.grad.abs().sum() > 0
        with pytest.raises(ParamAccessError, match="2.weight among the inputs") as e:
            out.sum().backward(inputs=[model[2].weight])
        with pytest.raises(ParamAccessError, match="among the inputs"):
            torch.autograd.backward(out.sum(), inputs=[x, model[0].bias])
        engine.backward(nn.functional.mse_loss(engine(x.detach()), torch.zeros(BATCH, 4,
                                                                                device=x.device)))
        assert engine.step()  # the engine goes on after the refusals
        return str(e.value)


@pytest.mark.parametrize(("world", "offload"), [(1, "none"), (1, "nvme"), (2, "none")])
def test_backward_into_a_parameter_is_refused(tmp_path: Path, world: int,
                                              offload: str) -> None:
    """With the parameters on NVMe ``loss.backward(inputs=[p])`` computed nothing for ``p``
    and the step trained nothing, without a word; at 2 ranks it was refused as a read."""
    for message in on_ranks(world, _backward_into, offload, str(tmp_path)):
        assert "engine.backward(loss)" in message and "requires_grad=False" in message
