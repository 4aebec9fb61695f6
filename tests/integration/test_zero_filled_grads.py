"""``zero_grad(set_to_none=False)``: a parameter without a gradient in a step still updates,
as torch's optimizers update a zero ``grad`` (optim/zero_filled.py's note)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from tests.common import assert_states_close
from tests.distributed import run_world

BATCH, STEPS = 8, 4


class Branches(nn.Module):
    """``side`` runs only in the first step, as an expert no token reaches afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(4, 2)
        self.side = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return self.main(x) + (self.side(x) if step == 0 else 0)


def _model() -> Branches:
    torch.manual_seed(0)
    return Branches()


def _x() -> torch.Tensor:
    return torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(2))


def _optimizer(kind: str, params: object) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.1, weight_decay=0.1)  # type: ignore[arg-type]
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)  # type: ignore[arg-type]


def _torch(kind: str, set_to_none: bool) -> dict[str, torch.Tensor]:
    model = _model()
    opt = _optimizer(kind, model.parameters())
    for step in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        model(_x(), step).pow(2).mean().backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _outcore(kind: str, set_to_none: bool, via: str, offload: str,
             swap: str) -> dict[str, torch.Tensor]:
    model = _model()
    opt = _optimizer(kind, model.parameters())
    engine = outcore.initialize(model, {"dtype": "fp32", "offload": {
        "params": offload, "optimizer": offload, "nvme_path": swap}}, optimizer=opt)
    rank, world = engine.rank, engine.world_size
    x = _x()[rank * BATCH // world:(rank + 1) * BATCH // world].to(engine.device)
    for step in range(STEPS):
        {"optimizer": opt, "model": model, "engine": engine}[via].zero_grad(  # type: ignore[operator]
            set_to_none=set_to_none)
        engine.backward(model(x, step).pow(2).mean())
        engine.step()
    engine.close(keep_values=True)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("via", ["optimizer", "model", "engine"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_an_unused_branch_updates_as_torch_with_zero_filled_grads(
        tmp_path: Path, offload: str, kind: str, via: str) -> None:
    """``side`` stood still after the first step where torch's optimizer moved it by its
    momentum and weight decay."""
    want = _torch(kind, set_to_none=False)
    assert not torch.equal(want["side.bias"], _torch(kind, set_to_none=True)["side.bias"])
    assert_states_close([_outcore(kind, False, via, offload, str(tmp_path))], want)


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_zero_filled_grads_at_two_ranks_and_set_to_none_again(tmp_path: Path,
                                                              offload: str) -> None:
    assert_states_close(run_world(_outcore, 2, "adamw", False, "optimizer", offload, str(tmp_path)),
           _torch("adamw", set_to_none=False))
    assert_states_close([_outcore("adamw", True, "optimizer", offload, str(tmp_path))],
           _torch("adamw", set_to_none=True))
