"""A write into a parameter's gathered tensor inside the engine's forward, through
``p.detach()`` or ``p.data``, is refused by name where it would be lost, and trains as in
PyTorch where the tensor is the fp32 master itself (zero/forward_writes.py's note). Found by
a user's probe: ``nn.Embedding(max_norm=...)`` lost its renormalization after every step, and
``w.data.clamp_()`` in a forward was neither refused nor kept."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.errors import ParamAccessError
from tests.distributed import run_world


class _Renorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 5, max_norm=1.0)
        self.out = nn.Linear(5, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids)).pow(2).mean()


class _Clip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.l.weight.data.clamp_(-0.1, 0.1)  # WGAN-style, inside the forward
        return self.l(x).pow(2).mean()


class _Reads(nn.Module):
    """Reads through ``.data`` and ``.detach()`` in its forward, and writes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.l.weight.data.abs().mean() + self.l.weight.detach().abs().mean()
        return (self.l(x) * scale).pow(2).mean()


def _cfg(place: str, dtype: str, tmp_path: Path) -> dict:
    params, _, optimizer = place.partition("+")
    return {"dtype": dtype, "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.0},
            "offload": {"params": params, "optimizer": optimizer or params,
                        "nvme_path": str(tmp_path)}}


def _inputs(model: nn.Module) -> torch.Tensor:
    return torch.tensor([[1, 2, 3, 2]]) if isinstance(model, _Renorm) else torch.randn(4, 5)


def _losses(model: nn.Module, steps: int, engine: outcore.Engine | None = None) -> list[float]:
    torch.manual_seed(1)
    opt = None if engine else torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    out = []
    for _ in range(steps):
        loss = model(_inputs(model))
        if engine is None:
            assert opt is not None
            opt.zero_grad()
            loss.backward()
            opt.step()
        else:
            engine.backward(loss)
            engine.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("make", [_Renorm, _Clip])
@pytest.mark.parametrize(("place", "dtype"), [("nvme", "fp32"), ("cpu+nvme", "fp32"),
                                              ("none", "bf16")])
def test_a_write_that_would_be_lost_is_refused_by_name(tmp_path: Path, make: type,
                                                       place: str, dtype: str) -> None:
    torch.manual_seed(0)
    model = make()
    engine = outcore.initialize(model, _cfg(place, dtype, tmp_path))
    name = "emb.weight" if make is _Renorm else "l.weight"
    with pytest.raises(ParamAccessError, match=f"parameter {name} was written in place inside "
                       "the engine's forward.*gathered_parameters"):
        model(_inputs(model))
    engine.close()


@pytest.mark.parametrize("make", [_Renorm, _Clip])
def test_where_the_tensor_is_the_master_the_write_trains_as_in_pytorch(tmp_path: Path,
                                                                       make: type) -> None:
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    want = _losses(reference, 3)
    engine = outcore.initialize(model, _cfg("none", "fp32", tmp_path))
    assert _losses(model, 3, engine) == want
    engine.close()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("place", ["nvme", "none"])
def test_reads_through_data_and_detach_are_not_refused(tmp_path: Path, place: str) -> None:
    torch.manual_seed(0)
    model = _Reads()
    reference = copy.deepcopy(model)
    want = _losses(reference, 3)
    engine = outcore.initialize(model, _cfg(place, "fp32", tmp_path))
    got = _losses(model, 3, engine)
    engine.close()
    assert got == pytest.approx(want, rel=1e-5)


class _GatheredInForward(nn.Module):
    """Clips inside its forward the way the refusal says works: in gathered_parameters."""

    def __init__(self, engine_of: list) -> None:
        super().__init__()
        self.l = nn.Linear(5, 3)
        self.engine_of = engine_of

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.engine_of:
            with self.engine_of[0].gathered_parameters([self.l.weight], modify=True):
                self.l.weight.detach().clamp_(-0.1, 0.1)
                self.l.weight.data.clamp_(-0.1, 0.1)
        return self.l(x).pow(2).mean()


def test_gathered_parameters_with_modify_inside_a_forward_is_not_refused(tmp_path: Path) -> None:
    """The refusal's own advice: a reviewer found it refused at the forward's end."""
    torch.manual_seed(0)
    holder: list = []
    model = _GatheredInForward(holder)
    engine = outcore.initialize(model, _cfg("nvme", "fp32", tmp_path))
    holder.append(engine)
    engine.backward(model(torch.randn(4, 5)))
    engine.step()
    with engine.gathered_parameters([model.l.weight]):
        assert model.l.weight.abs().max() <= 0.1 + 1e-2  # clipped, then one small step
    engine.close()


def test_a_submodule_called_on_its_own_is_checked_and_ends_its_watch(tmp_path: Path) -> None:
    """``model.emb(ids)`` outside the model's forward: its renormalization was lost unseen,
    and the watch stayed open, holding every p.data read afterwards (a reviewer's find)."""
    torch.manual_seed(0)
    model = _Renorm()
    engine = outcore.initialize(model, _cfg("nvme", "fp32", tmp_path))
    with pytest.raises(ParamAccessError, match="parameter emb.weight was written"):
        model.emb(torch.tensor([1, 2]))
    for _ in range(3):
        model.out.weight.data.sum()
    watch = engine.hooks.writes
    assert not watch._begun and not watch._handed
    engine.close()


def _write_on_rank_zero(swap: str) -> str | None:
    import os

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = _Clip() if rank == 0 else _Reads()  # the same parameters; one rank writes
    engine = outcore.initialize(model, _cfg("nvme", "fp32", Path(swap) / str(rank)))
    try:
        model(torch.randn(4, 5))
    except ParamAccessError as e:
        return str(e)
    finally:
        engine.close()
    return None


def test_a_write_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    said = run_world(_write_on_rank_zero, 2, str(tmp_path))
    assert said[0] is not None and "parameter l.weight was written" in said[0]
    assert said[1] is not None and "another rank wrote a parameter" in said[1]


def _forward_on_rank_zero_only(swap: str) -> list[str]:
    import os

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
    engine = outcore.initialize(model, _cfg("nvme", "fp32", Path(swap) / str(rank)))
    said = []
    try:
        with torch.no_grad():  # every rank: an eval forward is fine
            model(torch.randn(4, 5))
        for _ in range(2):
            try:
                if rank == 0:  # a sample on rank 0 alone, as DDP allows
                    with torch.no_grad():
                        model(torch.randn(4, 5))
                engine.backward(model(torch.randn(4, 5)).pow(2).mean())
                engine.step()
            except ParamAccessError as e:
                said.append(str(e))
    finally:
        engine.close()
    return said


def test_a_forward_on_one_rank_only_is_refused_on_every_rank(tmp_path: Path) -> None:
    """It paired with the other ranks' next training forward, which gathers the same layers:
    nothing failed there, and the ranks ran on out of step until collectives of different
    sizes met (a hang). Each time it is refused on every rank, and they stay in step."""
    said = run_world(_forward_on_rank_zero_only, 2, str(tmp_path), timeout=120)
    assert [len(s) for s in said] == [2, 2], said
    assert "the ranks are out of step: this rank (rank 0) ended a forward under " \
           "torch.no_grad(), another rank something else" in said[0][0]
    assert "(rank 1) ended a forward with gradients" in said[1][0]
    assert "must run on every rank" in said[1][1]
