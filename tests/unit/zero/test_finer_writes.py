"""A 16-bit run's parameters read as their training copy; a write of the very tensor a read
gave, unmodified, keeps the fp32 master (finer.py's [Note: a write of what a read gave keeps
the master]), and any other is written as given. Found by user-style probes:
``model.load_state_dict(model.state_dict())`` moved every master by up to a bf16 step, and
the first fix undid a constraint written with ``copy_`` where the master rounded into it."""

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
        model[2].weight.data = model[2].weight.detach()
    after = _masters(engine, model)
    for name in before:
        assert torch.equal(after[name], before[name]), name
    engine.close()


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_a_write_of_anything_else_is_written_as_given(tmp_path: Path, offload: str) -> None:
    """A copy changed in place, a tensor computed from a read (a constraint: a clamp whose
    bound the master exceeds by less than a bf16 step), an fp32 source: each replaces the
    master with its values, as the write says."""
    model, engine = _engine(tmp_path, offload)
    w = model[0].weight
    changed = w.detach()
    changed[0] += 1.0  # in place, after the read: its version moved
    with torch.no_grad():
        w.copy_(changed)
    assert torch.equal(_masters(engine, model)["0.weight"], changed.float())
    with torch.no_grad():  # a master just above a bound that reads as the bound
        w.copy_(torch.full_like(w, 1.002, dtype=torch.float32))
        assert w.detach().max().item() == 1.0
        w.copy_(w.detach().clamp(max=1.0))
    assert _masters(engine, model)["0.weight"].max().item() == 1.0
    nudged = _masters(engine, model)["0.weight"] + 1e-6  # fp32, below bf16's step
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
