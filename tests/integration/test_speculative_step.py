"""The speculative step (optim/speculation.py's [Note: a speculative step]): with clipping and
the optimizer state on NVMe, updates run during backward, written aside, and are kept when
the gradients' norm needed no clipping, else redone at ``step()``. Whatever the mix of kept
and redone steps, training is bit-identical to the step without speculation; a
``zero_grad()`` between backward and ``step()`` takes the tentative updates back, and a disk
short of room for them turns speculation off instead of failing."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.errors import StorageError
from outcore.offload.storage import NvmeShard
from outcore.offload.tier import Tier
from outcore.optim import optimizer
from outcore.optim.speculation import written
from outcore.runtime.plan import ExecutionPlan

CLIP = 1.0
# loss scales per step: small ones give gradient norms under CLIP, large ones over it, so the
# steps run: plain (the first; it fits: speculation on), kept, redone (off), plain (it fits:
# on again), kept, redone, plain
SCALES = [1e-3, 1e-3, 1e3, 1e-3, 1e-3, 1e3, 1e-3]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 80), nn.Tanh(),
                         nn.Linear(80, 8))


def _config(tmp_path: Path, speculate: bool, dtype: str, params: str) -> outcore.Config:
    return outcore.Config.from_dict({
        "dtype": dtype, "gradient_clipping": CLIP, "track_grad_norm": True,
        "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1},
        "zero": {"speculative_step": speculate},
        "offload": {"optimizer": "nvme", "params": params, "nvme_path": str(tmp_path)}})


def _batch(step: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(step))


def _train(engine: outcore.Engine, scales: list[float]) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for step, scale in enumerate(scales):
        loss = engine(_batch(step).to(engine.device)).float().pow(2).mean() * scale
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.last_grad_norm)
    return losses, norms


def _values(engine: outcore.Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("params", ["nvme", "cpu"])
def test_kept_and_redone_steps_train_exactly_as_without_speculation(
        tmp_path: Path, dtype: str, params: str) -> None:
    """Losses, norms and final weights equal those of ``zero.speculative_step: false`` bit for
    bit, over steps that keep their tentative updates and steps that redo them."""
    results = {}
    for speculate in (False, True):
        cfg = _config(tmp_path / str(speculate), speculate, dtype, params)
        with outcore.initialize(_model(), cfg) as engine:
            assert engine.plan.speculates is speculate
            assert engine.plan.overlaps_optimizer is speculate
            losses, norms = _train(engine, SCALES)
            results[speculate] = (losses, norms, _values(engine),
                                  dict(engine.sharded_optimizer.stats))
    plain, spec = results[False], results[True]
    assert [n > CLIP for n in plain[1]] == [False, False, True, False, False, True, False], (
        plain[1])
    assert spec[0] == plain[0] and spec[1] == plain[1]
    for name, value in plain[2].items():
        assert torch.equal(spec[2][name], value), name
    stats = spec[3]
    n = len(list(_model().parameters()))
    # speculated at steps 2, 3, 5 and 6 (1 is the first, 4 and 7 follow a clipped step);
    # 3 and 6 were redone
    assert stats["updates_during_backward"] == 4 * n
    assert stats["tentative_kept"] == 2 * n and stats["tentative_redone"] == 2 * n
    assert plain[3]["updates_during_backward"] == 0


@pytest.mark.filterwarnings("ignore::outcore.device.compute_dtype.EmulatedDtypeWarning")
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_zero_grad_before_step_takes_tentative_updates_back(tmp_path: Path, dtype: str) -> None:
    """A boundary backward's tentative updates are not applied until ``step()``, so a
    ``zero_grad()`` in between forgets them, as torch's optimizer would never have seen
    them: training then equals a run where that backward never happened. The training
    copies in memory, which the updates overwrote, are cast from the masters again. With
    fp16 the kept gradients were never unscaled in place, so the next steps see the same
    values."""
    def run(speculate: bool, drop_one: bool) -> dict[str, torch.Tensor]:
        cfg = _config(tmp_path / f"{speculate}{drop_one}", speculate, dtype, "cpu")
        with outcore.initialize(_model(), cfg) as engine:
            _train(engine, [1e-3])  # a step that fits: the next backward speculates
            if drop_one:
                before = _values(engine)
                engine.backward(engine(_batch(7)).float().pow(2).mean() * 1e-3)
                assert (engine.sharded_optimizer.stats["updates_during_backward"] > 0) is speculate
                engine.zero_grad()
                assert all(torch.equal(v, before[k]) for k, v in _values(engine).items())
            _train(engine, [1e-3, 1e-3])
            return _values(engine)

    reference = run(False, False)
    for speculate in (False, True):
        got = run(speculate, True)
        assert all(torch.equal(got[k], v) for k, v in reference.items()), speculate


@pytest.mark.parametrize("disk", ["refuses", "half full"])
def test_a_disk_without_room_for_tentative_updates_turns_speculation_off(
        tmp_path: Path, monkeypatch, caplog, disk: str) -> None:
    """Room for the second copies is made at the first speculative backward, if it takes at
    most half of the disk's free space; where the disk refuses it or is shorter than that, a
    warning says so and every update waits for ``step()``, training as before."""
    with outcore.initialize(_model(), _config(tmp_path / "a", False, "bf16", "nvme")) as engine:
        reference = _train(engine, SCALES[:3])
    cfg = _config(tmp_path / "b", True, "bf16", "nvme")
    with caplog.at_level(logging.WARNING, logger="outcore"), outcore.initialize(_model(),
                                                                                cfg) as e:
        # after initialize, which checks that the states themselves fit (lifetime.py)
        if disk == "refuses":
            def full(self: NvmeShard) -> None:
                raise StorageError("not enough free space for the NVMe swap (test)")
            monkeypatch.setattr(NvmeShard, "reserve_aside", full)
            said = "not enough free space"
        else:
            usage = shutil.disk_usage(tmp_path)
            monkeypatch.setattr(optimizer.shutil, "disk_usage",
                                lambda path: usage._replace(free=100_000))
            said = "more than half of the 100 KB free"
        assert _train(e, SCALES[:3]) == reference
        assert e.sharded_optimizer.stats["updates_during_backward"] == 0
        assert e.rt.ledger.tier_bytes("nvme") == sum(  # no room is kept aside
            stored.nbytes for sp in e.sharded_optimizer.params
            for stored in {id(s): s for s in written(sp, e.sharded_optimizer.state[sp])}.values()
            if stored.tier is Tier.NVME)  # (training copies kept in memory: build.py)
    assert "speculative step is off" in caplog.text
    assert said in caplog.text


@pytest.mark.parametrize("cfg, speculates", [
    ({"gradient_clipping": 1.0, "offload": {"optimizer": "nvme"}}, True),
    ({"gradient_clipping": 0.0, "offload": {"optimizer": "nvme"}}, False),
    ({"gradient_clipping": 1.0}, False),  # the state in memory: no room aside
    ({"gradient_clipping": 1.0, "offload": {"optimizer": "nvme"},
      "zero": {"speculative_step": False}}, False),
    ({"gradient_clipping": 1.0, "offload": {"optimizer": "nvme"},
      "zero": {"overlap_optimizer": False}}, False),
    ({"gradient_clipping": 1.0, "offload": {"optimizer": "nvme"},
      "optimizer": {"type": "adafactor"}}, False),
])
def test_which_runs_speculate(cfg: dict, speculates: bool, tmp_path: Path) -> None:
    """The plan speculates with clipping, the state on NVMe and the optimizer overlapped; a
    speculating run never defers its updates into the next forward."""
    if "offload" in cfg:
        cfg = {**cfg, "offload": {**cfg["offload"], "nvme_path": str(tmp_path)}}
    cfg = {**cfg, "zero": {**cfg.get("zero", {}), "overlap_step_with_forward": True}}
    plan = ExecutionPlan.for_config(outcore.Config.from_dict(cfg), 1, "cpu",
                                            dtype="bf16")
    assert plan.speculates is speculates, plan.reasons["speculates"]
    if speculates:
        assert plan.overlaps_optimizer and not plan.defers_updates


@pytest.mark.parametrize("params", ["nvme", "cpu"])
def test_a_model_leaving_between_backward_and_step_has_the_values_before_it(
        tmp_path: Path, params: str) -> None:
    """A second engine taking the model over, or ``close()``, after a boundary backward whose
    updates are tentative: no step concluded them, so the model goes on from the values it
    had before that backward (its training copies in memory included), as without
    speculation, where nothing was updated yet."""
    def run(speculate: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        model = _model()
        cfg = _config(tmp_path / str(speculate), speculate, "bf16", params)
        engine = outcore.initialize(model, cfg)
        _train(engine, [1e-3])
        engine.backward(engine(_batch(7)).float().pow(2).mean() * 1e-3)
        assert (engine.sharded_optimizer.stats["updates_during_backward"] > 0) is speculate
        with outcore.initialize(model, cfg) as second:  # takes the model over
            losses = _train(second, [1e-3, 1e-3])[0]
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

    plain, spec = run(False), run(True)
    assert spec[0] == plain[0]
    assert all(torch.equal(spec[1][k], v) for k, v in plain[1].items())


def test_a_checkpoint_of_a_speculating_run_resumes_exactly(tmp_path: Path) -> None:
    """A checkpoint saved after kept tentative updates holds the stored values (the extents
    made current), and a run loading it, with its own room aside, trains on exactly as the
    run that saved it."""
    cfg = _config(tmp_path / "swap", True, "bf16", "nvme")
    with outcore.initialize(_model(), cfg) as engine:
        _train(engine, SCALES[:2])  # the second step speculates, and is kept
        assert engine.sharded_optimizer.stats["tentative_kept"] > 0
        engine.save_checkpoint(tmp_path / "ckpt")
        later = _train(engine, [1e-3, 1e3, 1e-3, 1e-3])  # kept, redone, plain, kept
        assert engine.sharded_optimizer.stats["tentative_redone"] > 0
    with outcore.initialize(_model(), _config(tmp_path / "swap2", True, "bf16", "nvme")) as e:
        _train(e, [1e-3])  # a step that fits first: the load lands between speculative steps
        e.load_checkpoint(tmp_path / "ckpt")
        assert _train(e, [1e-3, 1e3, 1e-3, 1e-3]) == later


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises when armed: a fault in the middle of backward, after
    the layers above it had their (tentative) updates submitted."""

    armed = False

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - torch's signature
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - torch's signature
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise RuntimeError("injected backward fault")
        return g


class _Faulty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 48), nn.Linear(48, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_FailOnce.apply(torch.tanh(self.a(x))))


def test_a_failed_backward_takes_its_tentative_updates_back(tmp_path: Path) -> None:
    """A boundary backward that raises after the last layer's update was submitted: the
    update was tentative, so it is taken back (the weights are as before that backward), and
    the run goes on exactly as one where the fault never happened."""
    def run(fail: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        cfg = _config(tmp_path / str(fail), True, "fp32", "nvme")
        with outcore.initialize(_Faulty(), cfg) as engine:
            _train(engine, [1e-3])  # fits: the next backward speculates
            if fail:
                before = _values(engine)
                _FailOnce.armed = True
                with pytest.raises(RuntimeError, match="injected backward fault"):
                    engine.backward(engine(_batch(7)).float().pow(2).mean() * 1e-3)
                stats = engine.sharded_optimizer.stats
                assert stats["updates_during_backward"] > 0 and stats["tentative_redone"] > 0
                assert all(torch.equal(v, before[k]) for k, v in _values(engine).items())
            _train(engine, [1e-3, 1e-3])
            return _values(engine)

    clean, faulted = run(False), run(True)
    assert all(torch.equal(faulted[k], v) for k, v in clean.items())


def test_the_torch_optimizer_contract_and_a_scheduler_over_a_speculating_engine(
        tmp_path: Path) -> None:
    """A plain loop through ``engine.optimizer`` (``step``, ``zero_grad`` at the top of each
    iteration, a torch LR scheduler) trains exactly as without speculation."""
    def run(speculate: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        cfg = _config(tmp_path / str(speculate), speculate, "bf16", "nvme")
        with outcore.initialize(_model(), cfg) as engine:
            opt = engine.optimizer
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            losses = []
            for step, scale in enumerate(SCALES):
                opt.zero_grad()
                loss = engine(_batch(step).to(engine.device)).float().pow(2).mean() * scale
                engine.backward(loss)
                opt.step()
                sched.step()
                losses.append(loss.item())
            assert (engine.sharded_optimizer.stats["tentative_kept"] > 0) is speculate
            return losses, _values(engine)

    plain, spec = run(False), run(True)
    assert spec[0] == plain[0]
    assert all(torch.equal(spec[1][k], v) for k, v in plain[1].items())
