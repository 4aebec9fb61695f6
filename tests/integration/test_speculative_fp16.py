"""The speculative step with fp16's loss scaling (optim/speculation.py's [Note: a speculative
step]): with the optimizer state on NVMe, updates run during backward, unscaled as they read
each gradient, and are kept when no gradient overflowed (and, with clipping, the norm needed
none), redone when the norm clips, and dropped when the step overflows, which skips it. Every
mix of those steps trains bit-identically to ``zero.speculative_step: false``, the loss
scale included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.device.compute_dtype import EmulatedDtypeWarning
from outcore.runtime.plan import ExecutionPlan
from tests.distributed import run_world

# fp16 is emulated on most CPUs: slow, which these small models do not mind
pytestmark = pytest.mark.filterwarnings("ignore", category=EmulatedDtypeWarning)

CLIP = 1.0
SCALE_POWER = 4  # a loss scale of 16: the 1e2 steps clip without overflowing fp16
# loss multipliers per step: 1e-3 fits; 1e2 passes the clipping norm (only with clipping);
# 1e6 overflows fp16 (65504) at any scale, which skips the step and halves the scale
MULTIPLIERS = [1e-3, 1e-3, 1e6, 1e-3, 1e-3, 1e2, 1e-3, 1e-3]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 80), nn.Tanh(),
                         nn.Linear(80, 8))


def _config(tmp_path: Path, speculate: bool, clip: float, params: str,
            dtype: str = "fp16", **zero: int) -> outcore.Config:
    return outcore.Config.from_dict({
        "dtype": dtype, "gradient_clipping": clip, "track_grad_norm": clip > 0,
        "loss_scale": {"initial_scale_power": SCALE_POWER},
        "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1},
        "zero": {"speculative_step": speculate, **zero},
        "offload": {"optimizer": "nvme", "params": params, "nvme_path": str(tmp_path)}})


def _loss(engine: outcore.Engine, step: int) -> torch.Tensor:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
    return engine(x.to(engine.device)).float().pow(2).mean()


def _values(engine: outcore.Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}


def _train(engine: outcore.Engine, multipliers: list[float]) -> dict[str, list]:
    out: dict[str, list] = {"losses": [], "stepped": [], "scales": [], "norms": []}
    for step, m in enumerate(multipliers):
        loss = _loss(engine, step) * m
        engine.backward(loss)
        out["stepped"].append(engine.step())
        out["losses"].append(loss.item())
        out["scales"].append(engine.scaler.scale)
        out["norms"].append(engine.last_grad_norm)
    return out


@pytest.mark.parametrize("clip", [CLIP, 0.0])
@pytest.mark.parametrize("params", ["nvme", "cpu"])
def test_kept_redone_and_overflowed_steps_train_exactly_as_without_speculation(
        tmp_path: Path, clip: float, params: str) -> None:
    """Losses, the loss scale, norms and final weights equal those of
    ``zero.speculative_step: false`` bit for bit, over steps that keep their tentative
    updates, steps that redo them (clipping) and steps that overflow (skipped). A skipped
    step leaves every weight as it was, the training copies in memory included."""
    results = {}
    for speculate in (False, True):
        with outcore.initialize(_model(), _config(tmp_path / str(speculate), speculate, clip,
                                                  params)) as engine:
            assert engine.plan.speculates is speculate, engine.plan.reasons["speculates"]
            assert engine.plan.overlaps_optimizer is speculate
            got = _train(engine, MULTIPLIERS[:2])
            before_overflow = _values(engine)
            more = _train(engine, MULTIPLIERS[2:3])  # the overflow
            assert more["stepped"] == [False]
            assert all(torch.equal(v, before_overflow[k]) for k, v in _values(engine).items())
            more2 = _train(engine, MULTIPLIERS[3:])
            for k in got:
                got[k] += more[k] + more2[k]
            results[speculate] = (got, _values(engine), dict(engine.sharded_optimizer.stats))
    plain, spec = results[False], results[True]
    clips = [n is not None and CLIP < n < float("inf") for n in plain[0]["norms"]]
    # the overflowed step's norm is not finite (it had kept the step before's)
    assert plain[0]["norms"][2] == (float("inf") if clip > 0 else None)
    assert plain[0]["stepped"] == [True, True, False, True, True, True, True, True]
    assert clips[5] is (clip > 0) and sum(clips) == (clip > 0)
    assert plain[0]["scales"][2] == plain[0]["scales"][1] / 2  # the overflow halved it
    assert spec[0] == plain[0]
    for name, value in plain[1].items():
        assert torch.equal(spec[1][name], value), name
    stats, n = spec[2], len(list(_model().parameters()))
    # speculated at steps 2, 3 (overflowed: dropped), 5, 6 (clipped: redone; kept without
    # clipping) and 8; without clipping at 7 too (1 is the first, 4 and 7 follow a step
    # that did not fit)
    if clip > 0:
        assert stats["updates_during_backward"] == 5 * n
        assert stats["tentative_kept"] == 3 * n and stats["tentative_redone"] == n
    else:
        assert stats["updates_during_backward"] == 6 * n
        assert stats["tentative_kept"] == 5 * n and stats["tentative_redone"] == 0
    assert stats["tentative_dropped"] == n
    assert plain[2]["updates_during_backward"] == 0


@pytest.mark.parametrize("state, clip, speculates", [
    ("nvme", 0.0, True),  # fp16 alone: an overflow is the check
    ("nvme", 1.0, True),
    ("cpu", 0.0, False),  # the state in memory: no room aside, updates wait for step()
    ("cpu", 1.0, False),
])
def test_fp16_runs_speculate_with_the_state_on_nvme(tmp_path: Path, state: str, clip: float,
                                                     speculates: bool) -> None:
    """fp16 speculates wherever the state is on NVMe, with or without clipping, and the plan
    says which checks decide; elsewhere fp16's updates wait for ``step()``, as before."""
    cfg = outcore.Config.from_dict({"dtype": "fp16", "gradient_clipping": clip, "offload": {
        "optimizer": state, "nvme_path": str(tmp_path)}})
    plan = ExecutionPlan.for_config(cfg, 1, "cpu", dtype="fp16")
    assert plan.speculates is speculates, plan.reasons["speculates"]
    assert plan.overlaps_optimizer is speculates, plan.reasons["overlaps_optimizer"]
    assert plan.grad_slot is speculates  # the unscaled copy's buffer
    if speculates:
        assert "no gradient overflowed" in plan.reasons["speculates"]
        assert ("the norm needs no clipping" in plan.reasons["speculates"]) is (clip > 0)
    else:
        assert "unless the updates are tentative" in plan.reasons["overlaps_optimizer"]


def _two_ranks(swap: str, speculate: bool) -> tuple[dict[str, list], dict[str, torch.Tensor],
                                                     dict[str, int]]:
    """Rank 1 alone overflows at the third step; rank 0's gradients there are fine."""
    cfg = _config(Path(swap) / str(speculate), speculate, CLIP, "nvme")
    out: dict[str, list] = {"losses": [], "stepped": [], "scales": []}
    with outcore.initialize(_model(), cfg) as engine:
        rank = torch.distributed.get_rank()
        for step, m in enumerate(MULTIPLIERS):
            m = 1e-3 if m == 1e6 and rank == 0 else m
            loss = _loss(engine, 2 * step + rank) * m
            engine.backward(loss)
            out["stepped"].append(engine.step())
            out["losses"].append(loss.item())
            out["scales"].append(engine.scaler.scale)
        with engine.gathered_parameters():  # every rank joins the gather
            values = _values(engine)
        return out, values, dict(engine.sharded_optimizer.stats)


def test_two_ranks_drop_tentative_updates_when_either_overflows(tmp_path: Path) -> None:
    """The overflow check is global: where only rank 1 overflows, rank 0 drops its tentative
    updates too, and both ranks train exactly as without speculation."""
    plain = run_world(_two_ranks, 2, str(tmp_path), False)
    spec = run_world(_two_ranks, 2, str(tmp_path), True)
    for rank in (0, 1):
        assert spec[rank][0] == plain[rank][0], rank
        assert spec[rank][0]["stepped"][2] is False
        # run_world hands tensors back as numpy arrays
        assert all((spec[rank][1][k] == v).all() for k, v in plain[rank][1].items()), rank
        assert spec[rank][2]["tentative_dropped"] > 0, rank


@pytest.mark.filterwarnings("ignore:zero.prefetch_bytes=1 is smaller")
@pytest.mark.parametrize("dtype, clip", [("fp16", 0.0), ("bf16", CLIP)])
@pytest.mark.parametrize("params", ["nvme", "cpu"])
@pytest.mark.parametrize("between", ["backward", "model(x)", "load_state_dict"])
def test_a_second_backward_or_a_state_load_before_step_redoes_the_updates(
        tmp_path: Path, between: str, params: str, dtype: str, clip: float) -> None:
    """The tentative updates of a boundary backward were computed from its gradients and the
    moments of the moment: a second forward and backward before ``step()`` add to those
    gradients (and, with the parameters in memory, must compute on the weights before the
    updates, which overwrote the training copies), and an optimizer ``load_state_dict``
    replaces those moments; either takes the updates back and ``step()`` redoes them,
    exactly as without speculation (fp16, and bf16 with clipping). No layer stays gathered
    between forwards, so the second forward reads the shards the updates wrote."""
    def run(speculate: bool) -> dict[str, torch.Tensor]:
        cfg = _config(tmp_path / f"{speculate}", speculate, clip, params, dtype,
                      prefetch_bytes=1, persistence_threshold_bytes=0)
        with outcore.initialize(_model(), cfg) as engine:
            _train(engine, [1e-3, 1e-3])
            saved = engine.optimizer.state_dict()
            _train(engine, [1e-3])
            engine.backward(_loss(engine, 7) * 1e-3)
            assert (engine.sharded_optimizer.stats["updates_during_backward"] > 0) is speculate
            if between in ("backward", "model(x)"):
                engine.synchronize()  # the updates have written the copies in memory
                if between == "backward":
                    loss = _loss(engine, 8)
                else:  # the plain model called directly, as a loop written for it does
                    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(8))
                    loss = engine.module(x).float().pow(2).mean()
                engine.backward(loss * 1e-3)
            else:
                engine.optimizer.load_state_dict(saved)
            assert engine.step()
            _train(engine, [1e-3])
            return _values(engine)

    plain, spec = run(False), run(True)
    assert all(torch.equal(spec[k], v) for k, v in plain.items())


def test_a_second_backward_after_updates_applied_for_good_is_refused(tmp_path: Path) -> None:
    """Where the updates during backward are not tentative (no clipping, no fp16), a second
    backward before ``step()`` could not reach them: it is refused with what to do, and the
    step goes on."""
    cfg = outcore.Config.from_dict({"dtype": "bf16", "offload": {
        "optimizer": "nvme", "params": "nvme", "nvme_path": str(tmp_path)}})
    with outcore.initialize(_model(), cfg) as engine:
        assert engine.plan.overlaps_optimizer and not engine.plan.speculates
        engine.backward(_loss(engine, 0))
        with pytest.raises(outcore.OutcoreError, match="backward\\(\\) between a backward and "
                           "step\\(\\): this backward already applied the updates"):
            engine.backward(_loss(engine, 1))
        assert engine.step()
        engine.backward(_loss(engine, 1))  # after step(): fine
        assert engine.step()
