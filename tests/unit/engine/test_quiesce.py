"""``lifetime.quiesce(engine)`` (what ``OutcoreTrainer.train()`` does when training ends)
leaves nothing of the engine's in flight: the updates a step left running and the reads it
started ahead for the next forward, which would hold the swap file of an engine dropped then.
``engine.synchronize()`` waits for the updates only, so a timer around ``step()`` does not
count the next forward's reads."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.device.accel import default_device
from outcore.engine import lifetime
from outcore.offload import aio


class Disk:
    """The swap file's reads, each SLOW_S long (a busy disk), counted from the request to
    its completion (a read waiting for an I/O thread counts too)."""

    SLOW_S = 0.05

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pending = 0
        self._lock = threading.Lock()
        real_transfer, real_pread = aio.transfer, aio.AioEngine.pread

        def transfer(op, fd, view, offset, path):
            if op == "read":
                time.sleep(self.SLOW_S)
            return real_transfer(op, fd, view, offset, path)

        def pread(engine, fd, buf, offset, **kwargs):
            with self._lock:
                self.pending += 1
            future = real_pread(engine, fd, buf, offset, **kwargs)
            future.add_done_callback(self._done)
            return future

        monkeypatch.setattr(aio, "transfer", transfer)
        monkeypatch.setattr(aio.AioEngine, "pread", pread)

    def _done(self, _future: object) -> None:
        with self._lock:
            self.pending -= 1


def test_no_read_runs_after_quiesce_and_synchronize_leaves_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = Disk(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(50, 70), nn.Tanh(), nn.Linear(70, 70), nn.Tanh(),
                          nn.Linear(70, 3)).to(default_device())
    engine = outcore.initialize(model, {
        "dtype": "fp32", "optimizer": {"type": "sgd", "lr": 0.05},
        "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)}})
    x = torch.randn(8, 50).to(default_device())
    losses = []
    for _ in range(2):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        assert engine.step()
        losses.append(loss.item())
        engine.synchronize()
        assert disk.pending, "the next forward's reads, started by step(), go on"
        lifetime.quiesce(engine)
        assert disk.pending == 0
    # what was read ahead is what the next forward uses: training goes on as it would
    assert engine(x).pow(2).mean().item() < losses[-1] < losses[0]
    engine.close()
