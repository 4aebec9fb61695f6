"""The traced prefetch schedule: same results with prefetch on and off, across divergence;
the byte budget is a hard cap; a budget smaller than a group never deadlocks."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import outcore
from outcore.zero.group import GroupState
from tests.common import DIVERGENT_DIM as DIM  # noqa: F401
from tests.common import MoE, Path_  # noqa: F401
from tests.common import run_divergent as _run
from tests.distributed import run_world


@pytest.mark.parametrize("world", [1, 2])
def test_prefetch_on_equals_off_across_divergence(world: int, tmp_path: Path) -> None:
    off = run_world(_run, world, "path", 0, "nvme", str(tmp_path), 8)
    on = run_world(_run, world, "path", 3 * 16640, "nvme", str(tmp_path), 8)
    for a, b in zip(off, on, strict=True):
        assert a["losses"] == b["losses"]
        assert a["stats"]["prefetches"] == 0
        s = b["stats"]
        assert s["prefetches"] > 0 and s["prefetch_hits"] > 0
        assert s["divergences"] > 0 and s["retraces"] > 0
        assert s["peak_ahead_bytes"] <= 3 * 16640


def test_static_model_follows_its_trace_without_divergence(tmp_path: Path) -> None:
    r = run_world(_run_fixed, 1, str(tmp_path))[0]
    s = r["stats"]
    assert s["divergences"] == 0 and s["retraces"] == 0
    # after the tracing iteration, every block is prefetched before it is needed
    assert s["prefetch_hits"] >= 6 * (s["iterations"] - 1)


def _run_fixed(swap: str) -> dict:
    cfg = outcore.Config.from_dict({
        "dtype": "fp32", "zero": {"persistence_threshold_bytes": 0,
                                  "prefetch_bytes": 2 * 16640},
        "offload": {"params": "nvme", "nvme_path": swap},
    })
    torch.manual_seed(0)
    engine = outcore.initialize(Path_(), cfg)
    for _ in range(4):
        engine.backward(engine(torch.randn(4, 8).to(engine.device), [0, 1, 2, 3, 4, 5]))
        engine.step()
    stats = engine.schedule_stats()
    engine.close()
    return {"stats": stats}


def test_mixture_of_experts_routing_changes_are_divergences(tmp_path: Path, caplog) -> None:
    off = run_world(_run, 1, "moe", 0, "nvme", str(tmp_path), 10)[0]
    with caplog.at_level(logging.INFO, logger="outcore"):
        on = _run("moe", 4 * 16640, "nvme", str(tmp_path), 10)
    assert on["losses"] == off["losses"]
    assert on["stats"]["divergences"] >= 1
    # the divergence is logged once, however many times it happens
    assert sum("differs from the recorded trace" in r.message for r in caplog.records) <= 1


def test_budget_smaller_than_a_group_fetches_on_demand_and_warns_once(tmp_path: Path) -> None:
    small = run_world(_run, 1, "path", 1000, "nvme", str(tmp_path), 6)[0]
    off = run_world(_run, 1, "path", 0, "nvme", str(tmp_path), 6)[0]
    assert small["losses"] == off["losses"]
    # only the 260-byte output layer fits the 1000-byte budget; the 16 KiB blocks do not
    assert small["stats"]["peak_ahead_bytes"] <= 1000
    assert len(small["warnings"]) == 1


def _overlap(swap: str, overlap: bool, clip: float) -> dict:
    cfg = outcore.Config.from_dict({
        "dtype": "fp32", "optimizer": {"lr": 1e-2}, "gradient_clipping": clip,
        "track_grad_norm": True,
        "zero": {"persistence_threshold_bytes": 0, "overlap_optimizer": overlap},
        "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": swap,
                    "host_buffer_bytes": 1 << 20},
        "gradient_accumulation_steps": 2,
    })
    torch.manual_seed(0)
    engine = outcore.initialize(Path_(), cfg)
    gen = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(6):
        x = torch.randn(4, 8, generator=gen).to(engine.device)
        loss = engine(x[engine.rank * 2 : engine.rank * 2 + 2], [0, 1, 2, 3])
        engine.backward(loss)
        if engine.step():
            norms.append(engine.last_grad_norm)
        losses.append(loss.item())
    stats = engine.schedule_stats()
    grads_left = engine.memory_report()["by_kind"].get("host.grads", 0)
    engine.close()
    return {"losses": losses, "stats": stats, "norms": norms, "grads_left": grads_left}


@pytest.mark.parametrize("world", [1, 2])
def test_optimizer_overlapped_with_backward_gives_identical_results(world: int,
                                                                     tmp_path: Path) -> None:
    on = run_world(_overlap, world, str(tmp_path), True, 0.0)
    off = run_world(_overlap, world, str(tmp_path), False, 0.0)
    for a, b in zip(on, off, strict=True):
        assert a["losses"] == b["losses"]
        # 3 boundary steps; every parameter that got a gradient was updated during backward
        assert a["stats"]["updates_during_backward"] > 0
        assert a["stats"]["updates_at_step"] == 0
        assert b["stats"]["updates_during_backward"] == 0
        # the global norm is still reported, assembled from gradients freed after their update
        assert a["norms"] == pytest.approx(b["norms"], rel=1e-6)
        assert a["grads_left"] == 0 and b["grads_left"] == 0


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("clip", [1e3, 1e-3])
def test_with_clipping_the_overlapped_updates_are_tentative(world: int, clip: float,
                                                            tmp_path: Path) -> None:
    """Clipping with the state on NVMe: after a step that needed no clipping, the updates
    during backward are tentative and kept at ``step()`` (speculation.py's [Note: a
    speculative step]); where every step clips, none starts. Either way the losses and norms
    equal those of the updates all at ``step()``, at one rank and at two."""
    on = run_world(_overlap, world, str(tmp_path), True, clip)
    off = run_world(_overlap, world, str(tmp_path), False, clip)
    for a, b in zip(on, off, strict=True):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        stats = a["stats"]
        if clip > 1:  # every step fits: all but the first speculate, and are kept
            assert stats["updates_during_backward"] == stats["tentative_kept"] > 0
        else:
            assert min(a["norms"]) > clip and stats["updates_during_backward"] == 0
        assert stats["tentative_redone"] == 0
        assert b["stats"]["updates_during_backward"] == 0 and b["stats"]["updates_at_step"] > 0
        assert a["grads_left"] == 0


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises the first time: a fault in the middle of backward."""

    armed = True

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise RuntimeError("injected backward fault")
        return g


def test_failed_boundary_backward_leaves_a_consistent_engine(tmp_path: Path) -> None:
    """With updates overlapped, a backward that raises may leave some parameters already
    updated (their gradients were final): the step is not atomic, as documented. What must
    hold: nothing half-done survives, the retried step updates every parameter exactly once,
    and training goes on normally."""
    cfg = outcore.Config(dtype="fp32", optimizer={"lr": 0.1},
                         zero={"persistence_threshold_bytes": 0},
                         offload={"optimizer": "nvme", "nvme_path": str(tmp_path)})
    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 1)
    engine = outcore.initialize(nn.ModuleList([a, b]), cfg)
    x = torch.randn(4, 8).to(engine.device)

    def loss() -> torch.Tensor:
        with engine.hooks.forward_context():
            return b(_FailOnce.apply(a(x))).pow(2).mean()

    def weights() -> list[torch.Tensor]:
        with engine.gathered_parameters():
            return [p.data.clone() for p in engine.module.parameters()]

    before = weights()
    _FailOnce.armed = True
    with pytest.raises(RuntimeError, match="injected backward fault"):
        engine.backward(loss())
    assert not engine.hooks.pending and engine.micro_steps == 0
    engine.backward(loss())  # the retry
    assert engine.step()
    updated = engine.schedule_stats()["updates_during_backward"]
    assert updated == 4  # a.weight, a.bias, b.weight, b.bias: each exactly once
    after = weights()
    assert all(not torch.equal(p, q) for p, q in zip(before, after, strict=True))
    assert engine.memory_report()["by_kind"].get("host.grads", 0) == 0
    for _ in range(2):  # and it trains on
        engine.backward(loss())
        assert engine.step()
    engine.close()


def _lonely_release(swap: str) -> dict:
    cfg = outcore.Config(dtype="fp32", comm={"timeout_s": 20},
                         zero={"persistence_threshold_bytes": 0},
                         offload={"params": "nvme", "nvme_path": swap})
    torch.manual_seed(0)
    engine = outcore.initialize(Path_(), cfg)
    g = engine.groups[1]
    if engine.rank == 0:  # a prefetch only this rank issued, then dropped: no collective
        g.unshard()
        g.reshard()
    losses = []
    for _ in range(2):
        loss = engine(torch.ones(2, 8, device=engine.device), [0, 1])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return {"state": g.state.value, "losses": losses}


def test_releasing_an_unused_prefetch_issues_no_collective(tmp_path: Path) -> None:
    r0, r1 = run_world(_lonely_release, 2, str(tmp_path))
    assert r0["losses"] == r1["losses"]


class _MostlyFrozen(nn.Module):
    """A trainable first layer, then frozen layers that backward must pass through (their
    weights give the input's gradient) and a trainable head: fine-tuning's shape."""

    def __init__(self, reuse: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reuse = reuse
        self.inp = nn.Linear(64, 256)
        self.body = nn.ModuleList(nn.Linear(256, 256) for _ in range(6))
        self.body.requires_grad_(False)
        self.head = nn.Linear(256, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.body:
            h = torch.tanh(layer(h))
        if self.reuse:  # a frozen weight used again outside its (checkpointed) module
            h = torch.tanh(F.linear(h, self.body[1].weight))
        return self.head(h).pow(2).mean()


def test_frozen_groups_are_released_during_backward(tmp_path: Path) -> None:
    """backward_holds.py's [Note: frozen groups in backward]: a frozen layer fetched by backward is
    released once backward moved past it, not held until backward ends; losses unchanged."""
    layer = 256 * 256 * 4 + 256 * 4
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))

    def run(params: str, prefetch: int) -> tuple[list[float], list[int], dict]:
        cfg = outcore.Config(dtype="fp32", optimizer={"lr": 1e-2},
                             offload={"params": params, "nvme_path": str(tmp_path)},
                             zero={"persistence_threshold_bytes": 0, "prefetch_bytes": prefetch})
        losses, peaks = [], []
        with outcore.initialize(_MostlyFrozen(), cfg) as engine:
            for _ in range(4):
                loss = engine(x.to(engine.device))
                engine.rt.ledger.reset_peaks()  # what backward adds on top of forward's end
                engine.backward(loss)
                peaks.append(engine.memory_report()["by_kind"].get("peak.device.unsharded", 0))
                engine.step()
                losses.append(loss.item())
            return losses, peaks, engine.schedule_stats()

    reference, _, _ = run("none", 0)
    on_demand, od_peaks, _ = run("nvme", 0)
    prefetched, pf_peaks, stats = run("nvme", layer + 4096)
    assert on_demand == prefetched == reference
    # all six frozen layers gathered at once would be 6 * layer; here the one in use, the one
    # being released, and (with prefetch) the next
    assert max(od_peaks) <= 2 * layer + 100_000, od_peaks
    assert max(pf_peaks) <= 3 * layer + 100_000, pf_peaks
    assert stats["divergences"] == 0 and stats["prefetch_hits"] > 0


def test_frozen_groups_with_checkpointed_blocks_keep_exact_losses(tmp_path: Path) -> None:
    """A frozen layer both recomputed by activation checkpointing and unpacked by outcore's
    hooks: the recomputation's group stays gathered, the losses equal the model in memory."""
    from outcore.memory.activations import checkpoint_activations

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))

    def run(params: str) -> list[float]:
        cfg = outcore.Config(dtype="fp32", optimizer={"lr": 1e-2},
                             offload={"params": params, "nvme_path": str(tmp_path)},
                             zero={"persistence_threshold_bytes": 0, "prefetch_bytes": 300_000})
        model = _MostlyFrozen(reuse=True)
        checkpoint_activations(model, lambda name, _: name in ("body.1", "body.2"), "none")
        with outcore.initialize(model, cfg) as engine:
            return _train_steps(engine, x, 4)

    assert run("nvme") == run("none")


def _train_steps(engine: outcore.Engine, x: torch.Tensor, steps: int) -> list[float]:
    losses, x = [], x.to(engine.device)
    for _ in range(steps):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_groups_released_outside_the_schedule_stop_counting_against_its_budget(
        tmp_path: Path) -> None:
    """``gathered_parameters`` releases groups the schedule had kept or carried over the
    step; their bytes stop counting against the budget at once, and the next step reads
    them again ahead of use."""
    cfg = outcore.Config.from_dict({
        "dtype": "fp32", "zero": {"persistence_threshold_bytes": 0,
                                  "prefetch_bytes": 2 * 16640},
        "offload": {"params": "nvme", "nvme_path": str(tmp_path)},
    })
    torch.manual_seed(0)
    x = torch.randn(4, 8)

    def step(engine: outcore.Engine) -> dict:
        before = engine.schedule_stats()
        engine.backward(engine(x.to(engine.device), [0, 1, 2, 3, 4, 5]))
        engine.step()
        return {k: v - before[k] for k, v in engine.schedule_stats().items()}

    with outcore.initialize(Path_(), cfg) as engine:
        assert engine.schedule.carry
        for _ in range(3):
            usual = step(engine)
        assert usual["carried"] > 0
        assert engine.schedule_stats()["ahead_bytes"] > 0  # carried, and the head being read
        with outcore.gathered_parameters(engine.module):
            pass  # every group released, the carried ones included
        assert engine.schedule_stats()["ahead_bytes"] == 0
        after = step(engine)
        assert after["divergences"] == 0 and after["prefetch_hits"] >= usual["prefetch_hits"]
        # only the first group, which the step had carried, is read on the spot
        assert after["fetches"] == usual["fetches"] + 1, (after, usual)


class _FusedFrozen(nn.Module):
    """A frozen fused projection whose one weight three consecutive backward nodes read
    (a QKV projection's shape)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(64, 96)
        self.qkv = nn.Linear(96, 3 * 96)
        self.qkv.requires_grad_(False)
        self.head = nn.Linear(96, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        q, k, v = self.qkv.weight.chunk(3)
        h = torch.tanh(F.linear(h, q)) + torch.tanh(F.linear(h, k)) * torch.tanh(F.linear(h, v))
        return self.head(h).pow(2).mean()


def test_frozen_group_used_by_consecutive_nodes_is_fetched_once_per_backward(
        tmp_path: Path) -> None:
    cfg = outcore.Config(dtype="fp32", optimizer={"lr": 1e-2},
                         offload={"params": "nvme", "nvme_path": str(tmp_path)},
                         zero={"persistence_threshold_bytes": 0, "prefetch_bytes": 0})
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    with outcore.initialize(_FusedFrozen(), cfg) as engine:
        for _ in range(3):
            loss = engine(x.to(engine.device))
            before = engine.schedule_stats()["on_demand_fetches"]
            engine.backward(loss)
            # the head's weight (for the input's gradient) and the frozen projection, once
            assert engine.schedule_stats()["on_demand_fetches"] - before == 2
            engine.step()


class _TiedLM(nn.Module):
    """An embedding whose weight is also the output head, larger than a block: the schedule's
    most expensive group is needed at both ends of forward and of backward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, DIM)  # 65536 bytes in fp32
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(6))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        logits = F.linear(h, self.emb.weight)
        # the embedding's own backward needs only the ids, not its weight
        return F.cross_entropy(logits.view(-1, 256), ids.roll(1, dims=1).view(-1))


def _tied_run(tmp_path: Path, prefetch: int, steps: int = 5) -> tuple[list[float], list[int], dict]:
    """Losses, reads of the embedding's group per step, and the schedule's stats."""
    cfg = outcore.Config(dtype="fp32", optimizer={"lr": 1e-2},
                         offload={"params": "nvme", "nvme_path": str(tmp_path)},
                         zero={"persistence_threshold_bytes": 0, "prefetch_bytes": prefetch})
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    losses, reads = [], []
    with outcore.initialize(_TiedLM(), cfg) as engine:
        emb = next(g for g in engine.groups if g.name == "emb")
        read = emb.unshard
        count = [0]

        def counting_unshard() -> None:
            count[0] += emb.state is GroupState.SHARDED
            read()

        emb.unshard = counting_unshard
        ids = ids.to(engine.device)
        for _ in range(steps):
            count[0] = 0
            loss = engine(ids)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            reads.append(count[0])
        stats = engine.schedule_stats()
    return losses, reads, stats


def test_the_group_needed_first_gets_the_budget(tmp_path: Path) -> None:
    """See schedule.py's [Note: the budget goes to what is needed first]: with room for the
    embedding and two blocks, the embedding is kept from the head's forward into its backward
    and from the end of backward into the next forward, in place of blocks that were kept
    before it but are needed after it. It is read once per step (for the head), not three
    times (as before: also at the start of forward and of backward)."""
    budget = 65536 + 2 * 16640
    off, _, _ = _tied_run(tmp_path / "off", 0)
    on, reads, stats = _tied_run(tmp_path / "on", budget)
    assert on == off
    assert reads[2:] == [1, 1, 1], reads  # the first steps trace and warm up
    assert stats["displaced"] > 0 and stats["divergences"] == 0
    assert stats["peak_ahead_bytes"] <= budget
