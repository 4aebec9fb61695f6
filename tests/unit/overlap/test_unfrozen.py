"""Changing which parameters train, after ``outcore.initialize``: what torch users do to a model.

Freezing a trained parameter later trains as torch does; unfreezing one that was frozen when
the engine was made is refused in words at ``engine.backward`` before any work, so the same
backward can be retried once it is frozen again (overlap/hooks.py's [Note: a parameter
unfrozen after initialize]); ``nn.Parameter(p)`` of a sharded parameter, as
parametrizations make, is refused in words instead of failing in torch's internals
(zero/calls.py's ``refuse_new_parameter``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.device.accel import default_device

OFFLOADS = ("none", "nvme")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4)).to(default_device())


def _engine(model: nn.Module, offload: str, tmp: Path) -> outcore.Engine:
    return outcore.initialize(model, {
        "dtype": "fp32", "optimizer": {"type": "adamw", "lr": 1e-2},
        "zero": {"persistence_threshold_bytes": 0},  # every layer is fetched and released
        "offload": {"params": offload, "optimizer": offload, "nvme_path": str(tmp)}})


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).to(default_device())


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone().cpu() for p in model.parameters()]


def _train_as_torch(model: nn.Module, ref: nn.Module, engine: outcore.Engine, steps: int,
                    before=None) -> None:
    """``steps`` steps of the engine and of torch's AdamW over ``ref`` (``before(step)``
    first): equal losses, then equal weights once the engine is closed."""
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(steps):
        if before is not None:
            before(step)
        loss = engine(_batch(step)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        opt.zero_grad()
        want = ref(_batch(step)).pow(2).mean()
        want.backward()
        opt.step()
        assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    engine.close()
    assert list(model.state_dict()) == list(ref.state_dict())
    for mine, theirs in zip(_weights(model), _weights(ref), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("offload", OFFLOADS)
def test_freezing_later_trains_as_torch_does(tmp_path: Path, offload: str) -> None:
    model, ref = _model(), _model()

    def freeze(step: int) -> None:  # torch's AdamW skips a parameter whose grad is None
        if step == 2:
            model[2].weight.requires_grad_(False)
            ref[2].weight.requires_grad_(False)

    _train_as_torch(model, ref, _engine(model, offload, tmp_path), 4, freeze)


def _unfreeze_then_retry(model: nn.Module, engine: outcore.Engine, unfreeze: bool) -> list:
    losses = []
    for step in range(4):
        loss = engine(_batch(step)).pow(2).mean()
        if unfreeze and step == 2:
            model[0].weight.requires_grad_(True)
            with pytest.raises(outcore.OutcoreError, match=r"parameter 0\.weight requires grad "
                               r"now, but it was frozen when outcore\.initialize"):
                engine.backward(loss)
            assert model[0].weight.grad is None  # no full-size gradient left behind
            model[0].weight.requires_grad_(False)
        engine.backward(loss)  # the same loss: its graph was not touched
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("offload", OFFLOADS)
def test_unfreezing_after_initialize_is_refused_before_any_work(tmp_path: Path,
                                                                 offload: str) -> None:
    runs = []
    for unfreeze in (False, True):
        model = _model()
        model[0].weight.requires_grad_(False)
        engine = _engine(model, offload, tmp_path / str(unfreeze))
        losses = _unfreeze_then_retry(model, engine, unfreeze)
        engine.close()
        runs.append((losses, _weights(model)))
    (want, want_w), (got, got_w) = runs
    assert got == want  # the refused backward changed nothing
    for mine, theirs in zip(got_w, want_w, strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("offload", OFFLOADS)
def test_a_new_parameter_from_a_sharded_one_is_refused_in_words(tmp_path: Path,
                                                                 offload: str) -> None:
    model = _model()
    engine = _engine(model, offload, tmp_path)
    before = _weights(model)
    with pytest.raises(outcore.ParamAccessError, match=r"Parameter\(\.\.\.\) of parameter "
                       r"2\.weight.*apply it before outcore\.initialize"):
        nn.utils.parametrizations.weight_norm(model[2])
    assert not nn.utils.parametrize.is_parametrized(model[2])  # the module is as it was
    with pytest.raises(outcore.ParamAccessError, match=r"of parameter 4\.weight"):
        nn.Parameter(model[4].weight)
    copy = nn.Parameter(model[4].weight.detach().clone())  # what the message says to do
    assert torch.equal(copy.detach().cpu(), before[4])
    loss = engine(_batch(0)).pow(2).mean()
    engine.backward(loss)
    assert engine.step()  # the engine trains on
    engine.close()


def test_weight_norm_registered_before_initialize_trains_as_torch_does(tmp_path: Path) -> None:
    model, ref = _model(), _model()
    for m in (model, ref):
        nn.utils.parametrizations.weight_norm(m[2])
    _train_as_torch(model, ref, _engine(model, "nvme", tmp_path), 3)


class _Normed(nn.Module):
    """A model whose construction applies weight_norm (as wav2vec2's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.utils.parametrizations.weight_norm(nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def test_weight_norm_under_init_says_to_build_outside_it() -> None:
    cfg = outcore.Config.from_dict({"dtype": "fp32"})
    with pytest.raises(outcore.ParamAccessError, match="build a model that applies it outside "
                       r"outcore\.init \(outcore\.initialize shards it after\)"), outcore.init(cfg):
        _Normed()
    model = _Normed().to(default_device())  # what the message says: it trains
    engine = outcore.initialize(model, cfg)
    engine.backward(engine(_batch(0)).pow(2).mean())
    assert engine.step()
    engine.close()
