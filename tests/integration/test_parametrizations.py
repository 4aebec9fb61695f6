"""torch.nn.utils.parametrize around an outcore model: ``Tensor.set_`` (which
``register_parametrization`` calls) writes the values (surface.py's [Note: set_ writes the
values]), and ``initialize`` neither evaluates a parametrized weight nor refuses one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import outcore
from outcore.errors import ParamAccessError
from tests.common import assert_states_close
from tests.distributed import run_world

STEPS, BATCH = 3, 16


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g)


def _set(m: nn.Sequential) -> None:
    with torch.no_grad():
        m[0].weight.set_(torch.full((8, 8), 0.05))


def _orthogonal(m: nn.Sequential) -> None:
    parametrizations.orthogonal(m[0])  # sets the original with its right_inverse (set_)


def _spectral(m: nn.Sequential) -> None:
    parametrizations.spectral_norm(m[0])


def _weight_norm(m: nn.Sequential) -> None:
    parametrizations.weight_norm(m[2])


CHANGES: dict[str, Callable[[nn.Sequential], None]] = {
    "set_": _set, "orthogonal": _orthogonal, "spectral_norm": _spectral,
    "weight_norm": _weight_norm}


def _train(change: str, when: str, offload: str, swap: str) -> dict[str, torch.Tensor]:
    """SGD steps on the whole batch (each rank its part); ``when``: the change is made
    "before" or "after" ``initialize``, or "torch" (no outcore)."""
    model = _model()
    if when in ("before", "torch"):
        CHANGES[change](model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = None
    if when != "torch":
        engine = outcore.initialize(model, {
            "dtype": "fp32", "offload": {"params": offload, "optimizer": offload,
                                         "nvme_path": swap}}, optimizer=opt)
    if when == "after":
        CHANGES[change](model)
    rank, world = (engine.rank, engine.world_size) if engine else (0, 1)
    x, y = _batch()
    part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    device = engine.device if engine else torch.device("cpu")
    x, y = x[part].to(device), y[part].to(device)
    for _ in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss((engine or model)(x), y)
        if engine:
            engine.backward(loss)
        else:
            loss.backward()
        opt.step()
    if engine:
        engine.close(keep_values=True)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("offload", ["none", "nvme"])
@pytest.mark.parametrize("change", ["set_", "orthogonal", "spectral_norm"])
def test_set_and_a_parametrization_after_initialize_train_as_torch(
        tmp_path: Path, change: str, offload: str) -> None:
    """``set_`` never reached outcore: the parameter kept the set tensor and never trained
    again (in memory), or the update went to the old shards (on NVMe); ``orthogonal``
    applied after ``initialize`` trained other weights than PyTorch's."""
    assert_states_close([_train(change, "after", offload, str(tmp_path))],
                        _train(change, "torch", "", ""))


@pytest.mark.parametrize("offload", ["none", "nvme"])
@pytest.mark.parametrize("change", ["set_", "orthogonal", "spectral_norm", "weight_norm"])
def test_a_parametrization_before_initialize_trains_as_torch_at_two_ranks(
        tmp_path: Path, change: str, offload: str) -> None:
    """``initialize`` read every module's ``weight`` for its tied-embedding table, which
    computes a parametrized weight: at 2 ranks a refusal naming ``outcore.init`` (which the
    script never used), and at 1 rank an extra power iteration of ``spectral_norm``."""
    assert_states_close(run_world(_train, 2, change, "before", offload, str(tmp_path)),
                        _train(change, "torch", "", ""))


def test_initialize_leaves_a_spectral_norm_state_alone() -> None:
    model = _model()
    parametrizations.spectral_norm(model[0])
    u = model[0].parametrizations.weight[0]._u.clone()
    with outcore.initialize(model, {"dtype": "fp32"}):
        assert torch.equal(model[0].parametrizations.weight[0]._u, u)


def test_set_follows_torch_rules_and_refuses_a_new_storage() -> None:
    model = _model()
    with outcore.initialize(model, {"dtype": "fp32"}) as engine:
        weight = model[0].weight
        new = torch.full((8, 8), 0.25, device=engine.device)
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            weight.set_(new)  # outside no_grad, as torch refuses it
        with torch.no_grad():
            with pytest.raises(ParamAccessError, match="set_ on parameter 0.weight"):
                weight.set_()
            with pytest.raises(ParamAccessError, match="shape \\[3\\]"):
                weight.set_(torch.zeros(3, device=engine.device))
            assert weight.set_(new) is weight
        new.fill_(1.0)  # a copy was written, as p.data = t writes one
        with engine.gathered_parameters([weight]):
            assert torch.equal(weight.detach().cpu(), torch.full((8, 8), 0.25))
