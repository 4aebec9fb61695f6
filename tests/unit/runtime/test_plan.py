"""The execution plan: every path decision pinned for the configurations that matter, and
the components following it instead of deciding again."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import outcore
from outcore.offload.storage import Tier
from outcore.runtime.plan import STAGING_SLOTS, ExecutionPlan, Inputs

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME
AW = ("exp_avg", "exp_avg_sq")

# (inputs, the decisions that distinguish them); decisions not named are checked elsewhere
TABLE = [
    pytest.param(Inputs(1, "cpu", "fp32", D, D), dict(
        zero_copy=True, compute_is_master=True, carries_head=True, overlaps_optimizer=False,
        streams=False, keeps_grad_buffers=True, holds_raw_grads=False, grad_tier=D,
        state_in_host_memory=True, aligned_full=False, staged_kinds=(), staged_cast=False),
        id="1 rank cpu fp32, no offload"),
    pytest.param(Inputs(1, "cpu", "bf16", N, N), dict(
        zero_copy=False, compute_is_master=False, aligned_full=True, aligned_gather=False,
        holds_raw_grads=True, overlaps_optimizer=True, keeps_grad_buffers=False,
        carries_head=False, streams=True, staged_kinds=("master", *AW), staged_cast=True,
        grad_slot=True, state_in_host_memory=False, grad_tier=H),
        id="1 rank cpu bf16, all on nvme"),
    pytest.param(Inputs(1, "cpu", "fp32", N, N), dict(
        compute_is_master=True, staged_cast=False, grad_slot=False, holds_raw_grads=True),
        id="1 rank cpu fp32, all on nvme: masters are the params"),
    pytest.param(Inputs(2, "cpu", "bf16", N, N), dict(
        aligned_gather=True, aligned_full=False, holds_raw_grads=False, grad_slot=False,
        zero_copy=False, carries_head=False),
        id="2 ranks cpu bf16, all on nvme"),
    pytest.param(Inputs(1, "cpu", "fp32", H, N), dict(
        compute_is_master=False, staged_cast=False, streams=True, zero_copy=True,
        staged_kinds=("master", *AW)),
        id="1 rank cpu fp32, optimizer on nvme"),
    pytest.param(Inputs(1, "cpu", "fp16", N, N, gradient_clipping=1.0), dict(
        loss_scaling=True, speculates=True, overlaps_optimizer=True, holds_raw_grads=False,
        grad_slot=True), id="fp16 with clipping"),
    pytest.param(Inputs(1, "cpu", "fp16", N, N, speculative_step=False), dict(
        loss_scaling=True, speculates=False, overlaps_optimizer=False, holds_raw_grads=False,
        grad_slot=False), id="fp16 without the speculative step"),
    pytest.param(Inputs(1, "cpu", "bf16", H, H), dict(
        zero_copy=True, overlaps_optimizer=False, carries_head=True, streams=False),
        id="1 rank cpu, host offload"),
    pytest.param(Inputs(1, "cuda", "bf16", H, H), dict(
        zero_copy=False, overlaps_optimizer=True, carries_head=True, state_in_host_memory=True,
        grad_tier=H, aligned_full=False),
        id="1 rank cuda, host offload"),
    pytest.param(Inputs(4, "cuda", "bf16", D, D), dict(
        zero_copy=False, grad_tier=D, state_in_host_memory=False, overlaps_optimizer=True,
        carries_head=False, keeps_grad_buffers=True),
        id="4 ranks cuda, no offload"),
    pytest.param(Inputs(1, "cpu", "bf16", N, N, overlap_step_with_forward=True), dict(
        defers_updates=True), id="step's tail into the next forward"),
    pytest.param(Inputs(1, "cuda", "bf16", H, H, overlap_step_with_forward=True), dict(
        defers_updates=True), id="the tail into the next forward, state in a GPU's host"),
    pytest.param(Inputs(1, "cpu", "bf16", H, H, overlap_step_with_forward=True), dict(
        defers_updates=False), id="tail kept in the step, state in a CPU device's memory"),
    pytest.param(Inputs(2, "cuda", "bf16", D, D, overlap_step_with_forward=True), dict(
        overlaps_optimizer=True, defers_updates=False),
        id="tail kept in the step, state on the GPU (not measured)"),
    pytest.param(Inputs(1, "cpu", "bf16", N, N, overlap_step_with_forward=True,
                        track_grad_norm=True), dict(defers_updates=False),
                 id="tail kept in the step where the norm is tracked"),
    pytest.param(Inputs(1, "cpu", "fp32", D, N, overlap_step_with_forward=True), dict(
        zero_copy=True, defers_updates=False), id="tail kept in the step with zero-copy shards"),
    pytest.param(Inputs(1, "cpu", "bf16", N, N, optimizer_type="sgd"), dict(
        state_kinds=(), staged_kinds=("master",)), id="sgd without momentum"),
    pytest.param(Inputs(1, "cpu", "bf16", N, D), dict(
        derives_compute_copy=True, compute_is_master=False, aligned_full=True),
        id="params on nvme, masters in memory: copies cast from them"),
    pytest.param(Inputs(2, "cuda", "fp32", N, H), dict(
        derives_compute_copy=True, compute_is_master=False),
        id="params on nvme, masters on the host, fp32: copies cast from them"),
    pytest.param(Inputs(1, "cpu", "bf16", N, N), dict(derives_compute_copy=False),
                 id="masters on nvme: the 16-bit copy is stored (half the bytes to read)"),
    pytest.param(Inputs(1, "cpu", "bf16", H, D), dict(derives_compute_copy=False),
                 id="params in host memory: the copy is stored"),
    pytest.param(Inputs(1, "cpu", "bf16", N, N, overlap_optimizer=False), dict(
        overlaps_optimizer=False, defers_updates=False), id="overlap switched off"),
    pytest.param(Inputs(1, "cpu", "bf16", N, N), dict(keeps_copies_resident=True),
                 id="all on nvme: copies that fit the budget stay in memory"),
    pytest.param(Inputs(1, "cpu", "bf16", N, N, gradient_clipping=1.0), dict(
        speculates=True, keeps_copies_resident=True),
        id="resident copies under speculation (a tentative one is taken back before a read)"),
    pytest.param(Inputs(1, "cpu", "bf16", N, N, overlap_step_with_forward=True), dict(
        defers_updates=True, keeps_copies_resident=True),
        id="resident copies with the tail in the next forward (each fetch waits for its own)"),
    pytest.param(Inputs(2, "cpu", "bf16", N, N), dict(keeps_copies_resident=False),
                 id="no resident copies at two ranks (a shard is not the tensor)"),
    pytest.param(Inputs(1, "cuda", "bf16", N, N), dict(keeps_copies_resident=False),
                 id="no resident copies beside a GPU (not measured)"),
    pytest.param(Inputs(1, "cpu", "fp32", N, N), dict(keeps_copies_resident=False),
                 id="no resident copies where the master is the copy"),
    pytest.param(Inputs(1, "cpu", "bf16", N, H), dict(keeps_copies_resident=False),
                 id="no resident copies with masters in memory (cast from them)"),
]


@pytest.mark.parametrize(("inputs", "expect"), TABLE)
def test_plan_table(inputs: Inputs, expect: dict) -> None:
    plan = ExecutionPlan.derive(inputs)
    got = {name: getattr(plan, name) for name in expect}
    assert got == expect
    assert plan.staging_slots == STAGING_SLOTS


def test_every_decision_has_a_reason_and_reports_as_json() -> None:
    plan = ExecutionPlan.derive(Inputs(2, "cpu", "bf16", N, N))
    decisions = [f.name for f in dataclasses.fields(plan) if f.name not in ("inputs", "reasons")]
    assert list(plan.reasons) == decisions
    assert all(plan.reasons[name].strip() for name in decisions)
    js = plan.to_json()
    assert js["inputs"]["params"] == "nvme" and js["inputs"]["world_size"] == 2
    assert js["decisions"]["aligned_gather"] == {"value": True, "reason": plan.reasons[
        "aligned_gather"]}
    assert js["decisions"]["grad_tier"]["value"] == "host"
    text = str(plan)
    assert all(name in text for name in decisions)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.zero_copy = True  # type: ignore[misc]


def test_plan_needs_a_resolved_dtype() -> None:
    with pytest.raises(ValueError, match="auto"):
        ExecutionPlan.for_config(outcore.Config.from_dict({"dtype": "auto"}), 1, "cpu")


def test_engine_components_follow_the_plan(tmp_path) -> None:
    """What the engine's parts do is what ``engine.plan`` says, for the user to read."""
    cfg = outcore.Config.from_dict({
        "dtype": "bf16", "optimizer": {"type": "adamw", "lr": 1e-3},
        "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)},
        "zero": {"prefetch_bytes": 1 << 20}})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    with outcore.initialize(model, cfg) as engine:
        plan = engine.plan
        assert plan is engine.rt.plan and plan.inputs.dtype == "bf16"
        assert plan.inputs.params is N and plan.inputs.optimizer is N
        assert plan.zero_copy is False and plan.keeps_copies_resident is True
        # each group fits the budget: its copies stay in memory (build.py's keep_resident)
        assert all(g.zero_copy for g in engine.groups)
        assert engine.schedule.carry is plan.carries_head
        assert engine.scaler.enabled is plan.loss_scaling
        assert engine.sharded_optimizer.state_kinds == plan.state_kinds == AW
        loss = engine(torch.randn(8, 32).to(engine.device)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        # every trainable shard stepped once, counted by the optimizer that owns the count
        assert {engine.sharded_optimizer.step_of(sp) for sp in engine.params} == {1}
        report = engine.memory_report()
        assert report["plan"] == plan.to_json()
        assert report["plan"]["decisions"]["overlaps_optimizer"]["value"] is True


def test_initialize_after_init_rederives_the_plan_for_the_engine_config(tmp_path) -> None:
    """``outcore.init`` and ``initialize`` may differ in clipping (not in placement): the
    engine's plan is the one for the config it trains with."""
    base = {"dtype": "fp32",
            "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)}}
    with outcore.init(base):
        model = nn.Linear(16, 16)
    cfg = {**base, "gradient_clipping": 1.0, "zero": {"speculative_step": False}}
    with outcore.initialize(model, cfg) as engine:
        assert engine.plan.inputs.gradient_clipping == 1.0
        assert engine.plan.overlaps_optimizer is False
        assert "clipping" in engine.plan.reasons["overlaps_optimizer"]
