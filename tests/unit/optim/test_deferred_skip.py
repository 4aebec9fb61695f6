"""``zero.overlap_step_with_forward`` with a module the next forward skips (a branch taken
only on some steps: mixture-of-experts, layer drop). Its update from the step before may still
run when the next ``step()`` comes, its gradient (of that past step) still held: that step must
wait for it, not update the parameter again from a gradient the update dropped meanwhile."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.device.accel import default_device
from outcore.optim.optimizer import ShardedOptimizer


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l3, self.l2 = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 1)
        self.b1, self.b2, self.branch = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.l3(torch.tanh(self.l1(x))))
        if use_branch:
            h = h + self.branch(self.b2(self.b1(h)))
        return self.l2(h)


def _train(tmp_path: Path, defer: bool) -> list[torch.Tensor]:
    cfg = outcore.Config(
        dtype="fp32", optimizer={"lr": 1e-2},
        zero={"persistence_threshold_bytes": 0, "overlap_step_with_forward": defer},
        offload={"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path),
                 "host_buffer_bytes": 1 << 20})
    engine = outcore.initialize(Net().to(default_device()), cfg)
    assert engine.defers_updates is defer
    gen = torch.Generator().manual_seed(1)
    for use_branch in (True, False, True, False):
        x = torch.randn(4, 16, generator=gen).to(default_device())
        engine.backward(engine(x, use_branch).pow(2).mean())
        assert engine.step()
        engine.zero_grad()
    with engine.gathered_parameters():
        weights = [p.detach().clone().cpu() for p in engine.module.parameters()]
    engine.close()
    return weights


def test_a_skipped_branchs_late_update_is_waited_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = ShardedOptimizer.apply

    def apply(self, work, hp):  # the branch's update outlasts the next forward and backward
        if any(sl.sp.name.startswith("branch") for sl in work.params):
            time.sleep(0.6)
        real(self, work, hp)

    monkeypatch.setattr(ShardedOptimizer, "apply", apply)
    deferred = _train(tmp_path / "d", defer=True)
    waited = _train(tmp_path / "w", defer=False)
    for a, b in zip(deferred, waited, strict=True):
        assert torch.equal(a, b)
