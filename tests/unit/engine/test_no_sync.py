"""``engine.no_sync()``: DDP's gradient-accumulation idiom, kept for scripts moved from it."""

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
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(6)]


def _closed_equal(engine: outcore.Engine, model: nn.Module, plain: nn.Module) -> None:
    """Close the engine; the model's weights equal the plain one's."""
    engine.close()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["none", "nvme"])
def test_no_sync_accumulates_as_under_ddp(tmp_path: Path, optimizer: str) -> None:
    """The DDP loop, unchanged but for the engine: backwards inside ``no_sync`` add up, the
    one after it updates (with the optimizer on NVMe its updates run during that backward)."""
    plain = _model()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
    for i, (x, y) in enumerate(_batches()):
        (nn.functional.mse_loss(plain(x), y) / 2).backward()
        if i % 2:
            opt.step()
            opt.zero_grad()
    model = _model()
    engine = outcore.initialize(model, {
        "dtype": "fp32",
        "optimizer": {"type": "adamw", "lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8,
                      "weight_decay": 0.0},
        "offload": {"optimizer": optimizer, "nvme_path": str(tmp_path)}})
    for i, (x, y) in enumerate(_batches()):
        loss = nn.functional.mse_loss(engine(x), y.to(engine.device)) / 2
        if i % 2 == 0:
            with engine.no_sync():
                engine.backward(loss)
                assert not engine.step()  # no boundary yet: nothing to update
        else:
            engine.backward(loss)
            assert engine.step()
    _closed_equal(engine, model, plain)


def test_the_backward_after_no_sync_ends_the_accumulation_whatever_the_config(
        tmp_path: Path) -> None:
    """With gradient_accumulation_steps 2, the backward after two inside no_sync counted as
    the third of an accumulation of two and ended nothing: the update came a backward late.
    The config's accumulation still divides each loss."""
    plain = _model()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for x, y in _batches()[:3]:
        (nn.functional.mse_loss(plain(x), y) / 2).backward()
    opt.step()
    model = _model()
    engine = outcore.initialize(model, {"dtype": "fp32", "gradient_accumulation_steps": 2,
                                        "optimizer": {"type": "sgd", "lr": 0.1}})
    for i, (x, y) in enumerate(_batches()[:3]):
        loss = nn.functional.mse_loss(engine(x), y.to(engine.device))
        if i < 2:
            with engine.no_sync():
                engine.backward(loss)
        else:
            engine.backward(loss)
    assert engine.step()
    _closed_equal(engine, model, plain)


def _ddp_loop(nvme: str) -> dict[str, torch.Tensor]:
    """A DDP script's accumulation at 2 ranks, each on its half of every batch."""
    model = _model()
    engine = outcore.initialize(model, {
        "dtype": "fp32", "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9},
        "offload": {"optimizer": "nvme" if nvme else "none", "nvme_path": nvme or "."}})
    rank, world = engine.rank, engine.world_size
    for i, (x, y) in enumerate(_batches()):
        part = slice(rank * 4 // world, (rank + 1) * 4 // world)
        loss = nn.functional.mse_loss(engine(x[part]), y[part].to(engine.device)) / 3
        if i % 3 != 2:
            with engine.no_sync():
                engine.backward(loss)
        else:
            engine.backward(loss)
            assert engine.step()
    engine.close()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("optimizer", ["none", "nvme"])
def test_no_sync_at_two_ranks_equals_one_process_on_the_whole_batch(
        tmp_path: Path, optimizer: str) -> None:
    """Where no_sync matters: the gradients of three micro-batches, summed on each rank and
    averaged over the ranks once, equal one process's on the whole batches."""
    from tests.distributed import run_world

    plain = _model()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(_batches()):
        (nn.functional.mse_loss(plain(x), y) / 3).backward()
        if i % 3 == 2:
            opt.step()
            opt.zero_grad()
    nvme = str(tmp_path) if optimizer == "nvme" else ""
    for weights in run_world(_ddp_loop, 2, nvme):
        for name, p in plain.named_parameters():
            torch.testing.assert_close(torch.as_tensor(weights[name]), p.detach(), rtol=1e-5,
                                       atol=1e-6)
