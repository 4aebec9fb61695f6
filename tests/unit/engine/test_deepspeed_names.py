"""DeepSpeed's engine methods on outcore's engine (deepspeed_names.py's note): the ones with the
same value answer as DeepSpeed's do, the others say what to write with outcore."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.engine.deepspeed_names import ELSEWHERE


def _engine(tmp_path: Path, **cfg: object) -> outcore.Engine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    return outcore.initialize(model, {"dtype": "fp32", "offload": {"nvme_path": str(tmp_path)},
                                      **cfg})


def _train_step(engine: outcore.Engine) -> bool:
    x, y = torch.randn(4, 6), torch.randn(4, 1)
    engine.backward(nn.functional.mse_loss(engine(x), y.to(engine.device)))
    return engine.step()


def test_the_same_values_under_deepspeed_names(tmp_path: Path) -> None:
    """get_lr follows a scheduler and an edit of the groups; the accumulation, the stage and
    the norm are the engine's own."""
    engine = _engine(tmp_path, gradient_accumulation_steps=2, gradient_clipping=1.0,
                     optimizer={"type": "adamw", "lr": 0.1})
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    assert engine.get_lr() == [0.1]
    assert engine.gradient_accumulation_steps() == 2
    assert engine.zero_optimization_stage() == 3
    assert engine.get_global_grad_norm() is None  # no step yet
    assert not _train_step(engine) and _train_step(engine)
    sched.step()
    assert engine.get_lr() == [pytest.approx(0.05)]
    assert engine.get_global_grad_norm() == engine.last_grad_norm
    assert engine.last_grad_norm is not None and engine.last_grad_norm > 0
    engine.param_groups[0]["lr"] = 0.3
    assert engine.get_lr() == [0.3]
    engine.close()


def test_the_norm_is_none_without_clipping(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    assert _train_step(engine)
    assert engine.get_global_grad_norm() is None
    engine.close()


@pytest.mark.parametrize("name", sorted(ELSEWHERE))
def test_other_deepspeed_names_say_what_to_write(tmp_path: Path, name: str) -> None:
    """An AttributeError (so hasattr and getattr's default keep working) that names the way
    with outcore."""
    engine = _engine(tmp_path)
    with pytest.raises(AttributeError, match=r"\(a DeepSpeed engine's\); with outcore: ") as err:
        getattr(engine, name)
    assert err.value.name == name
    assert ELSEWHERE[name] in str(err.value)
    assert not hasattr(engine, name)
    assert getattr(engine, name, "default") == "default"
    engine.close()


def test_an_unknown_name_is_a_plain_attribute_error(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    with pytest.raises(AttributeError, match=r"^'Engine' object has no attribute 'trian'$"):
        engine.trian  # noqa: B018 - the read is the test
    engine.close()


def test_a_deepspeed_tag_in_save_or_load_checkpoint_is_named(tmp_path: Path) -> None:
    """``save_checkpoint(save_dir, tag)`` would pass the tag as the client state, and
    ``load_checkpoint(load_dir, tag)`` as keep_settings (true, so this engine's settings would
    be kept without a word): both refused, saying how outcore names a checkpoint, before
    anything is written or loaded."""
    engine = _engine(tmp_path)
    _train_step(engine)
    root = tmp_path / "ck"
    with pytest.raises(outcore.ConfigError, match=r"got 'step1'.*os\.path\.join\(save_dir, tag\)"):
        engine.save_checkpoint(root, "step1")
    assert not root.exists()
    engine.save_checkpoint(root / "step1")
    engine.param_groups[0]["lr"] = 0.5
    before = [p.detach().clone() for p in engine.module.parameters()]
    with pytest.raises(outcore.ConfigError,
                       match=r"got 'step1'.*os\.path\.join\(load_dir, tag\).*client state alone"):
        engine.load_checkpoint(root, "step1")
    assert engine.param_groups[0]["lr"] == 0.5
    for p, b in zip(engine.module.parameters(), before, strict=True):
        assert torch.equal(p.detach().cpu(), b.cpu())
    assert engine.load_checkpoint(root / "step1", keep_settings=False) == {}
    engine.close()


def test_a_property_that_fails_inside_keeps_its_own_error(tmp_path: Path) -> None:
    """Python retries a property that raised AttributeError through __getattr__: the error
    then named the property as missing, not what it was missing."""
    class Probe(outcore.Engine):
        @property
        def broken(self) -> object:
            return self._not_there  # type: ignore[attr-defined]

    engine = _engine(tmp_path)
    engine.__class__ = Probe
    with pytest.raises(AttributeError, match="'_not_there'"):
        engine.broken  # noqa: B018 - the read is the test
    engine.__class__ = outcore.Engine
    engine.close()
