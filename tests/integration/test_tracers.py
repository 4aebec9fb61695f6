"""``torch.export``, ``torch.jit.trace`` and ``torch.func`` on a model outcore manages.

outcore's fetches run outside any tracer (zero/untraced.py's note): ``torch.export.export``
before the first forward with the parameters on NVMe failed inside the fetch (a fake mode's
meta storage swapped into a full tensor) and left every later forward failing until
``close()``; ``torch.jit.trace`` recorded the fetch's ``view`` and failed in torch's alias
analysis, and at two ranks a collective (reported as a dead rank). Now export works and
matches plain PyTorch; a jit trace or a differentiating ``torch.func`` transform where the
parameters move is refused before anything is fetched, naming the way out
(overlap/traced.py's note); and the model trains on as if nothing had been tried. A fetch
that fails part-way is undone (zero/group.py's note), here through an I/O error.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import outcore
from outcore.errors import ParamAccessError
from tests.distributed import run_world

TIERS = ["none", "nvme"]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _cfg(offload: str, swap: str) -> dict[str, Any]:
    # every group released after use, so a small model moves as a large one does
    return {"dtype": "fp32", "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
            "offload": {"params": offload, "optimizer": offload, "nvme_path": swap},
            "zero": {"persistence_threshold_bytes": 0}}


_X = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))


def _losses(engine: outcore.Engine, steps: int) -> list[float]:
    x, out = _X.to(engine.device), []
    for _ in range(steps):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def _plain_losses(steps: int, first: int = 0) -> tuple[nn.Module, list[float]]:
    """Plain PyTorch's model after ``first`` steps, and its losses for ``steps`` more."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for n in range(first + steps):
        loss = model(_X).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if n >= first:
            losses.append(loss.item())
    return model, losses


def _plain_after(first: int) -> nn.Module:
    return _plain_losses(0, first)[0].eval()


@pytest.mark.parametrize("offload", TIERS)
@pytest.mark.parametrize("first", [0, 1], ids=["fresh", "trained"])
def test_export_matches_plain_pytorch_and_training_goes_on(
        tmp_path: Path, offload: str, first: int) -> None:
    model = _net()
    engine = outcore.initialize(model, _cfg(offload, str(tmp_path)))
    _losses(engine, first)
    model.eval()
    x = _X.to(engine.device)
    ep = torch.export.export(model, (x,))
    want = _plain_after(first)(_X)
    torch.testing.assert_close(ep.module()(x).cpu(), want, rtol=1e-5, atol=1e-6)
    # no outcore work in the graph: only the model's own ops
    assert {str(n.target) for n in ep.graph.nodes if n.op == "call_function"} <= {
        "aten.linear.default", "aten.tanh.default"}
    with torch.no_grad():
        torch.testing.assert_close(model(x).cpu(), want, rtol=1e-5, atol=1e-6)
    model.train()
    torch.testing.assert_close(_losses(engine, 2), _plain_losses(2, first)[1],
                               rtol=1e-5, atol=1e-6)
    engine.close()


@pytest.mark.parametrize("first", [0, 1], ids=["fresh", "trained"])
def test_jit_trace_with_parameters_in_place_matches_plain_pytorch(
        tmp_path: Path, first: int) -> None:
    model = _net()
    engine = outcore.initialize(model, _cfg("none", str(tmp_path)))
    _losses(engine, first)
    model.eval()
    x, want = _X.to(engine.device), _plain_after(first)(_X)
    with torch.no_grad():
        traced = torch.jit.trace(model, (x,))
        torch.testing.assert_close(traced(x).cpu(), want, rtol=1e-5, atol=1e-6)
    model.train()
    torch.testing.assert_close(_losses(engine, 2), _plain_losses(2, first)[1],
                               rtol=1e-5, atol=1e-6)
    engine.close()


def test_jit_trace_with_parameters_on_nvme_is_refused_and_a_copy_traces(
        tmp_path: Path) -> None:
    model = _net()
    engine = outcore.initialize(model, _cfg("nvme", str(tmp_path)))
    x = _X.to(engine.device)
    for call in (lambda: torch.jit.trace(model, (x,)), lambda: torch.jit.trace(model[0], (x,))):
        with pytest.raises(ParamAccessError, match=r"copy\.deepcopy\(model\).*engine\.close\(\)"):
            call()
    assert engine.schedule_stats()["fetches"] == 0, "refused before anything was fetched"
    want = _plain_after(0)(_X)
    with torch.no_grad():
        traced = torch.jit.trace(copy.deepcopy(model).eval(), (x,))
        torch.testing.assert_close(traced(x).cpu(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_losses(engine, 2), _plain_losses(2)[1], rtol=1e-5, atol=1e-6)
    engine.close()


def _grads(model: nn.Module, x: torch.Tensor, values: bool = True) -> dict[str, torch.Tensor]:
    """``torch.func.grad`` of the loss over the parameters: at their values (a read at one
    rank), or at zeros (shapes only: what a read at more ranks, refused, would not give)."""
    params = {k: v.detach().clone() if values else torch.zeros_like(v)
              for k, v in model.named_parameters()}
    return torch.func.grad(
        lambda p: torch.func.functional_call(model, p, (x,)).pow(2).mean())(params)


@pytest.mark.parametrize("offload", TIERS)
def test_func_grad_works_in_place_and_is_refused_where_parameters_move(
        tmp_path: Path, offload: str) -> None:
    model = _net()
    engine = outcore.initialize(model, _cfg(offload, str(tmp_path)))
    x = _X.to(engine.device)
    if engine.schedule.movable:
        with pytest.raises(ParamAccessError, match=r"torch\.func\.grad.*offload\.params 'none'"):
            _grads(model, x)
    else:
        want = _grads(_net(), _X)
        for k, g in _grads(model, x).items():
            torch.testing.assert_close(g.cpu(), want[k], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_losses(engine, 2), _plain_losses(2)[1], rtol=1e-5, atol=1e-6)
    engine.close()


@pytest.mark.parametrize("offload", TIERS)
def test_a_forward_with_saved_tensor_hooks_disabled(tmp_path: Path, offload: str) -> None:
    """A library's ``disable_saved_tensors_hooks`` guard around the forward: where parameters
    move, outcore's backward needs those hooks, and the refusal says so (torch raised the
    guard's own message); in place the forward runs as PyTorch's."""
    model = _net()
    engine = outcore.initialize(model, _cfg(offload, str(tmp_path)))
    x = _X.to(engine.device)
    guard = torch.autograd.graph.disable_saved_tensors_hooks("no hooks in my library")
    if engine.schedule.movable:
        with guard, pytest.raises(ParamAccessError,
                                  match=r"disable_saved_tensors_hooks.*Run the forward outside"):
            engine(x)
        assert engine.schedule_stats()["fetches"] == 0, "refused before anything was fetched"
    else:
        with guard:
            out = engine(x)
        torch.testing.assert_close(out.detach().cpu(), _net()(_X).detach(), rtol=1e-5,
                                   atol=1e-6)
    torch.testing.assert_close(_losses(engine, 2), _plain_losses(2)[1], rtol=1e-5, atol=1e-6)
    engine.close()


def test_a_read_that_fails_part_way_leaves_the_model_working(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk read refused in the middle of a group's fetch (an I/O error), with the group
    persistent (the schedule never releases it): the next forward reads it again."""
    model = _net()
    cfg = _cfg("nvme", str(tmp_path))
    cfg["zero"] = {"persistence_threshold_bytes": 1 << 20}
    engine = outcore.initialize(model, cfg)
    shard = engine.groups[0].params[1].compute_shard
    assert shard is not None and engine.groups[0].persistent

    def refused(out: torch.Tensor) -> object:
        raise OSError(5, "Input/output error (test)")

    monkeypatch.setattr(shard, "load", refused)
    with pytest.raises(OSError, match="Input/output error"):
        engine(_X.to(engine.device))
    monkeypatch.undo()
    torch.testing.assert_close(_losses(engine, 2), _plain_losses(2)[1], rtol=1e-5, atol=1e-6)
    engine.close()


def _two_ranks(swap: str) -> dict[str, Any]:
    model = _net()
    engine = outcore.initialize(model, _cfg("none", swap))
    x = _X.to(engine.device)
    refusals = []
    for call in (lambda: torch.jit.trace(model, (x,)), lambda: _grads(model, x, values=False)):
        try:
            call()
            refusals.append("")
        except ParamAccessError as e:
            refusals.append(str(e))
    with engine.gathered_parameters():
        plain = copy.deepcopy(model).eval()
    with torch.no_grad():
        traced = torch.jit.trace(plain, (x,))(x).cpu()
    losses = _losses(engine, 2)
    engine.close()
    return {"refusals": refusals, "traced": traced.tolist(), "losses": losses}


def _export_inside_gathered(swap: str) -> list[float]:
    """After a step, torch.export inside gathered_parameters at 2 ranks: the forward's own
    collectives ran under export's modes, which crashed on a data-dependent guard or waited
    in a recorded all-gather for ranks that never joined."""
    model = _net()
    engine = outcore.initialize(model, _cfg("none", swap))
    x = _X.to(engine.device)
    _losses(engine, 1)
    with engine.gathered_parameters():
        program = torch.export.export(model, (x,))
        got, want = program.module()(x), model(x)
    torch.testing.assert_close(got, want)
    out = got.detach().cpu().flatten().tolist()
    engine.close()
    return out


def test_at_two_ranks_export_inside_gathered_parameters_works(tmp_path: Path) -> None:
    first, second = run_world(_export_inside_gathered, 2, str(tmp_path), timeout=120)
    assert first == second


def test_at_two_ranks_jit_trace_and_func_grad_are_refused_on_every_rank(
        tmp_path: Path) -> None:
    want = _plain_after(0)(_X)
    for rank in run_world(_two_ranks, 2, str(tmp_path)):
        jit, grad = rank["refusals"]
        assert "torch.jit.trace" in jit and "gathered_parameters" in jit, jit
        assert "torch.func.grad" in grad and "engine.close()" in grad, grad
        torch.testing.assert_close(torch.tensor(rank["traced"]), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rank["losses"], _plain_losses(2)[1], rtol=1e-5, atol=1e-6)
