"""A module swapped into the model after ``initialize`` by a torch tool that copies the old
module's hooks onto the new one (torch.ao.quantization's ``prepare_qat``, ``fuse_modules``,
``quantize_dynamic``): its first forward raised a bare ``KeyError`` from the hooks. It now
runs as a module outcore did not group: parameters it shares with the old one are fetched
where it touches them, so training matches plain PyTorch."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.ao.quantization as tq
from torch import nn

import outcore
from tests.common import ranks_mean
from tests.distributed import run_world


class _QatNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.dq = tq.QuantStub(), tq.DeQuantStub()
        self.l1, self.act, self.l2 = nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dq(self.l2(self.act(self.l1(self.q(x)))))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 12, generator=g), torch.randn(4, 4, generator=g)) for _ in range(4)]


def _prepare_qat(model: nn.Module) -> None:
    model.qconfig = tq.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of its quantized tensors
        tq.prepare_qat(model, inplace=True)


def _qat_losses(nvme: str, after: bool = True) -> list[float]:
    """QAT prepared after ``initialize`` (or before: ``after=False``; ``nvme``: the state's
    folder, or "" for memory), each rank on its part of every batch; each step's loss as the
    ranks' mean."""
    torch.manual_seed(0)
    model = _QatNet()
    place = "nvme" if nvme else "none"
    if not after:
        _prepare_qat(model)
    engine = outcore.initialize(model, {
        "dtype": "fp32", "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.0},
        "offload": {"params": place, "optimizer": place, "nvme_path": nvme or "."}})
    if after:
        _prepare_qat(model)
    rank, world = engine.rank, engine.world_size
    losses = []
    for x, y in _batches():
        part = slice(rank * 4 // world, (rank + 1) * 4 // world)
        loss = nn.functional.mse_loss(model(x[part]), y[part].to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(ranks_mean(loss, world))
    engine.close()
    return losses


@pytest.mark.parametrize("place", ["none", "nvme"])
def test_prepare_qat_after_initialize_trains_as_torch(tmp_path: Path, place: str) -> None:
    torch.manual_seed(0)
    plain = _QatNet()
    _prepare_qat(plain)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
    want = []
    for x, y in _batches():
        opt.zero_grad()
        loss = nn.functional.mse_loss(plain(x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    got = _qat_losses(str(tmp_path) if place == "nvme" else "")
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_prepare_qat_after_initialize_at_two_ranks_as_before_it() -> None:
    """At more ranks each rank's fake-quantization observers see its own part of the batch
    (buffers are each rank's, as under DDP), so the reference is QAT prepared before
    ``initialize``, at the same ranks."""
    want = run_world(_qat_losses, 2, "", False)
    got = run_world(_qat_losses, 2, "", True)
    assert got[0] == pytest.approx(want[0], rel=1e-6, abs=1e-7)


@pytest.mark.cpu_only("quantize_dynamic's kernels are CPU-only")
def test_fused_and_dynamically_quantized_modules_run_as_torch() -> None:
    """``fuse_modules`` (train mode: the fused module wraps the conv and the norm outcore
    grouped) and ``quantize_dynamic(inplace=True)`` (new modules with their own weights)."""
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                             nn.Linear(4 * 6 * 6, 5))

    x = torch.randn(2, 3, 8, 8)
    plain = net()
    tq.fuse_modules_qat(plain, [["0", "1", "2"]], inplace=True)
    model = net()
    engine = outcore.initialize(model, {"dtype": "fp32"})
    tq.fuse_modules_qat(model, [["0", "1", "2"]], inplace=True)
    torch.testing.assert_close(model(x).cpu(), plain(x))
    engine.close()

    plain, model = net().eval(), net().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tq.quantize_dynamic(plain, {nn.Linear}, dtype=torch.qint8, inplace=True)
        engine = outcore.initialize(model, {"dtype": "fp32"})
        tq.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x))
    engine.close()
