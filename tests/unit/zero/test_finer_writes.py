"""A 16-bit run's parameters read as their training copy; a write of values at that
precision keeps the fp32 master wherever it does not change what a read shows (finer.py's
[Note: a write of what a read gave keeps the master]). Found by a user-style probe:
``model.load_state_dict(model.state_dict())`` moved every master by up to a bf16 step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from tests.distributed import run_world


def _masters(engine: outcore.Engine, model: nn.Module) -> dict[str, torch.Tensor]:
    with engine.gathered_parameters():
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _engine(tmp: Path, offload: str) -> tuple[nn.Module, outcore.Engine]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    engine = outcore.initialize(model, {"dtype": "bf16", "optimizer": {"lr": 1e-2}, "offload": {
        "params": offload, "optimizer": offload, "nvme_path": str(tmp)}})
    x = torch.randn(8, 16).to(engine.device)
    engine.backward(engine(x).float().pow(2).mean())  # masters off the bf16 grid
    engine.step()
    return model, engine


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_writing_back_what_was_read_keeps_the_masters(tmp_path: Path, offload: str) -> None:
    model, engine = _engine(tmp_path, offload)
    before = _masters(engine, model)
    w = model[0].weight
    assert w.dtype == torch.bfloat16 and not torch.equal(w.detach().float(), before["0.weight"])
    with torch.no_grad():
        model.load_state_dict(model.state_dict())
        w.copy_(w.detach())
        model[2].weight.data = model[2].weight.data.clone()
    after = _masters(engine, model)
    for name in before:
        assert torch.equal(after[name], before[name]), name
    engine.close()


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_a_write_that_changes_values_takes_them(tmp_path: Path, offload: str) -> None:
    """A bf16 source changes the elements it changes (to its values); an fp32 source is
    written exactly, even where it rounds to what a read shows (a fine-tune over its base)."""
    model, engine = _engine(tmp_path, offload)
    before = _masters(engine, model)["0.weight"]
    w = model[0].weight
    new = w.detach().clone()
    new[0] += 1.0
    with torch.no_grad():
        w.copy_(new)
    after = _masters(engine, model)["0.weight"]
    assert torch.equal(after[0], new[0].float())
    assert torch.equal(after[1:], before[1:])
    nudged = after + 1e-6  # below bf16's step: a read shows the same values
    with torch.no_grad():
        w.copy_(nudged)
    assert torch.equal(_masters(engine, model)["0.weight"], nudged)
    engine.close()


def _two_ranks(root: str) -> bool:
    model, engine = _engine(Path(root) / f"swap{os.environ['RANK']}", "nvme")
    before = _masters(engine, model)
    with engine.gathered_parameters(modify=True):
        pass  # the masters stay what they are through a gathered round trip too
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.zeros_like(p))  # a pointwise write, done on each rank's slice
    zeroed = _masters(engine, model)
    same = all(torch.equal(zeroed[n], torch.zeros_like(v)) for n, v in before.items())
    engine.close()
    return same


def test_at_two_ranks_a_changing_write_reaches_every_slice(tmp_path: Path) -> None:
    assert run_world(_two_ranks, 2, str(tmp_path)) == [True, True]
