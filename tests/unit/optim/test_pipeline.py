"""The optimizer's update pipeline with its state on NVMe: order of transfers, and results.

The pipeline reads a sub-group while the one before is updated and written, across jobs too
(optim.py's [Note: one pipeline across submissions]); these tests pin that order down from the
transfers actually issued, and check that the updates are still exactly torch's.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.offload.storage import NvmeShard
from outcore.optim.optimizer import ShardedOptimizer
from tests.distributed import run_world


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 1))


def _slowed(seconds: float):
    """ShardedOptimizer.apply, sleeping first: the worker is then surely behind when
    ``step()`` returns, so the updates it leaves running are really there."""
    update = ShardedOptimizer.apply

    def slow_update(self: ShardedOptimizer, work, hp: dict) -> None:
        time.sleep(seconds)
        update(self, work, hp)

    return slow_update


def _record(monkeypatch: pytest.MonkeyPatch, events: list[tuple[str, int]]) -> None:
    """Log each master-weight read and write as it is issued, by the stored's identity."""
    load, save = NvmeShard.load_range, NvmeShard.save_range

    def logged_load(self: NvmeShard, start: int, out: torch.Tensor):
        if self._kind == "master":
            events.append(("read", id(self)))
        return load(self, start, out)

    def logged_save(self: NvmeShard, start: int, src: torch.Tensor):
        if self._kind == "master":
            events.append(("write", id(self)))
        return save(self, start, src)

    monkeypatch.setattr(NvmeShard, "load_range", logged_load)
    monkeypatch.setattr(NvmeShard, "save_range", logged_save)


def test_the_next_job_is_read_before_the_last_one_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three param groups make three jobs, all queued at the step (no overlap with backward,
    so the order is fixed): the second job's read is issued before the first job's write, so
    the disk does not wait for an update (it did when each job drained before the next)."""
    model = _model()
    layers = [model[0], model[2], model[4]]
    cfg = outcore.Config(dtype="fp32", optimizer={"lr": 0.1}, zero={"overlap_optimizer": False},
                         offload={"optimizer": "nvme", "nvme_path": str(tmp_path)})
    engine = outcore.initialize(model, cfg,
                                param_groups=[{"params": list(m.parameters())} for m in layers])
    masters = {id(outcore.zero.registry.managed(m.weight).master_shard): i
               for i, m in enumerate(layers)}
    events: list[tuple[str, int]] = []
    _record(monkeypatch, events)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(engine.device)
    engine.backward(engine(x).pow(2).mean())
    assert engine.step()
    order = [(op, masters[key]) for op, key in events if key in masters]
    assert order.index(("read", 1)) < order.index(("write", 0))
    assert order.index(("read", 2)) < order.index(("write", 1))
    assert sorted(order) == sorted([(op, i) for i in range(3) for op in ("read", "write")])
    engine.close()


def _losses(swap: str, steps: int, **zero: object) -> list[float]:
    cfg = outcore.Config(dtype="fp32", optimizer={"lr": 1e-2}, zero=zero,
                         offload={"params": "nvme", "optimizer": "nvme", "nvme_path": swap,
                                  "host_buffer_bytes": 1 << 20})
    engine = outcore.initialize(_model(), cfg)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(engine.device)
    losses = []
    for _ in range(steps):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses


def test_updates_equal_torch_adamw(tmp_path: Path, device: torch.device) -> None:
    """Whatever the order of transfers, each step is torch's AdamW on fp32 weights."""
    model = _model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(device)
    want = []
    for _ in range(4):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for overlap in (True, False):
        got = _losses(str(tmp_path), 4, overlap_optimizer=overlap)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), overlap


def _queued_at_each_submit(engine: outcore.Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One step; after each submission during backward, how many updates were unfinished."""
    queued: list[int] = []
    submit = ShardedOptimizer.submit

    def counted(self: ShardedOptimizer, sps, unseen: int = 0, grad_scale: float = 1.0) -> None:
        submit(self, sps, unseen, grad_scale)
        queued.append(sum(not job.done.done() for job in self.pipeline.pending))

    monkeypatch.setattr(ShardedOptimizer, "submit", counted)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(engine.device)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    return queued


@pytest.mark.parametrize("limit", [0, None])  # none may wait / the default limit kept
def test_backward_waits_when_pending_gradients_pass_their_limit(
        limit: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradients waiting for a background update hold host memory, so a backward that would
    queue more than ``pending_grad_limit`` bytes first waits for the oldest update."""
    monkeypatch.setattr(ShardedOptimizer, "apply", _slowed(0.05))
    cfg = outcore.Config(dtype="fp32", optimizer={"lr": 1e-2},
                         offload={"optimizer": "nvme", "nvme_path": str(tmp_path)})
    engine = outcore.initialize(_model(), cfg)
    if limit is not None:
        engine.sharded_optimizer.pipeline.pending_grad_limit = limit
    queued = _queued_at_each_submit(engine, monkeypatch)
    assert len(queued) == 3 and engine.schedule_stats()["updates_during_backward"] == 6
    # with no room every submission first waits for the one before; with room they pile up
    assert max(queued) == (1 if limit == 0 else 3), queued
    engine.close()


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_backward_is_paced_only_where_updates_free_gradients(
        home: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pipeline.py's [Note: paced only where updates free gradients]: with the state in
    memory every gradient buffer is kept, so gradients waiting for an update cost nothing and
    backward never waits for one, however small the host buffers; on NVMe the limit holds
    (the test above). Updates overlap backward with the state in memory only on a GPU, so
    on the CPU this checks the limit the pipeline was given."""
    monkeypatch.setattr(ShardedOptimizer, "apply", _slowed(0.05))
    offload = {"optimizer": home, "nvme_path": str(tmp_path)}
    if home == "cpu":
        offload["host_buffer_bytes"] = 4096  # a limit of 8 KiB, if it applied
    engine = outcore.initialize(_model(), outcore.Config(dtype="fp32", optimizer={"lr": 1e-2},
                                                         offload=offload))
    limit = engine.sharded_optimizer.pipeline.pending_grad_limit
    assert limit == (None if home == "cpu" else 2 * outcore.Config().offload.host_buffer_bytes)
    if home == "cpu" and engine.plan.overlaps_optimizer:  # a GPU
        queued = _queued_at_each_submit(engine, monkeypatch)
        assert max(queued) == 3, queued  # none waited for the one before
    engine.close()


def _deferred(swap: str, defer: bool) -> dict:
    """Train with the step's tail running into the next forward (or not), the update slowed
    so the worker is surely behind when ``step()`` returns, and the learning rate changed
    right after each step (a schedule); return losses, the weights read right after a step
    and the optimizer's counts."""
    update = ShardedOptimizer.apply
    ShardedOptimizer.apply = _slowed(0.02)  # (a spawned rank: no monkeypatch here)
    try:
        cfg = outcore.Config(
            dtype="fp32", optimizer={"lr": 1e-2}, gradient_accumulation_steps=2,
            zero={"persistence_threshold_bytes": 0, "overlap_step_with_forward": defer},
            offload={"params": "nvme", "optimizer": "nvme", "nvme_path": swap,
                     "host_buffer_bytes": 1 << 20})
        engine = outcore.initialize(_model(), cfg)
        gen = torch.Generator().manual_seed(1)
        losses, weights = [], []
        for i in range(8):
            x = torch.randn(8, 64, generator=gen)[engine.rank * 4 : engine.rank * 4 + 4]
            x = x.to(engine.device)
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            if engine.step():
                for g in engine.param_groups:
                    g["lr"] = 1e-2 * 0.5 ** (i + 1)
                if i == 3:
                    with engine.gathered_parameters():
                        weights = [p.data.clone() for p in engine.module.parameters()]
            losses.append(loss.item())
        stats = engine.schedule_stats()
        engine.close()
    finally:
        ShardedOptimizer.apply = update
    return {"losses": losses, "weights": weights, "stats": stats}


@pytest.mark.parametrize("world", [1, 2])
def test_the_step_returning_before_its_updates_changes_nothing(world: int,
                                                               tmp_path: Path) -> None:
    """pipeline.py's [Note: the step's tail runs into the next forward]: the forward waits for
    each group's own updates, readers after the step see them, and the learning rate set after
    ``step()`` does not reach updates still running. Results equal the step that waits."""
    on = run_world(_deferred, world, str(tmp_path), True)
    off = run_world(_deferred, world, str(tmp_path), False)
    for a, b in zip(on, off, strict=True):
        assert a["losses"] == b["losses"]
        for p, q in zip(a["weights"], b["weights"], strict=True):
            assert (p == q).all()
        assert a["stats"]["updates_after_step"] > 0
        assert b["stats"]["updates_after_step"] == 0
        assert a["stats"]["updates_during_backward"] == b["stats"]["updates_during_backward"]


def test_weights_loaded_right_after_a_step_are_not_overwritten_by_its_updates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_pretrained`` after a step that returned early waits for the step's updates:
    otherwise an update still running would write its result over the loaded weights."""
    from safetensors.torch import save_file

    monkeypatch.setattr(ShardedOptimizer, "apply", _slowed(0.05))
    torch.manual_seed(5)
    other = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 1))
    save_file({k: v.contiguous() for k, v in other.state_dict().items()},
              str(tmp_path / "w.safetensors"))
    cfg = outcore.Config(dtype="fp32", optimizer={"lr": 1e-2},
                         zero={"overlap_step_with_forward": True},
                         offload={"params": "nvme", "optimizer": "nvme",
                                  "nvme_path": str(tmp_path / "swap"),
                                  "host_buffer_bytes": 1 << 20})
    with outcore.initialize(_model(), cfg) as engine:
        engine.backward(engine(torch.randn(8, 64).to(engine.device)).pow(2).mean())
        assert engine.step()
        assert engine.schedule_stats()["updates_after_step"] > 0
        outcore.load_pretrained(engine.module, tmp_path / "w.safetensors")
        with engine.gathered_parameters():
            for p, q in zip(engine.module.parameters(), other.parameters(), strict=True):
                assert torch.equal(p.data, q.data.to(p.device))


def test_an_update_failing_after_the_step_raises_from_every_later_fetch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first layer's update is the step's last, so it runs after ``step()`` returned; a
    write failure in it is raised by the next forward that fetches the layer, again by the
    one after (its shards are not to be trusted), and by ``close()``: never swallowed."""
    from outcore.errors import StorageError

    save = NvmeShard.save_range

    model = _model()
    cfg = outcore.Config(dtype="fp32", optimizer={"lr": 1e-2},
                         zero={"overlap_step_with_forward": True},
                         offload={"params": "nvme", "optimizer": "nvme",
                                  "nvme_path": str(tmp_path), "host_buffer_bytes": 1 << 20})
    engine = outcore.initialize(model, cfg)
    target = outcore.zero.registry.managed(model[0].weight).master_shard
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(engine.device)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    engine.synchronize()  # that step's updates all land before the failure is armed

    def failing_save(self: NvmeShard, start: int, src: torch.Tensor):
        if self is target:
            raise StorageError("injected write failure")
        return save(self, start, src)

    monkeypatch.setattr(ShardedOptimizer, "apply", _slowed(0.05))
    monkeypatch.setattr(NvmeShard, "save_range", failing_save)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    assert engine.schedule_stats()["updates_after_step"] > 0
    for _ in range(2):
        with pytest.raises(StorageError, match="injected write failure"):
            engine(x)
    with pytest.raises(StorageError, match="injected write failure"):
        engine.close()  # and once more, after the clean-up: a run ending here hears of it
    assert not list(tmp_path.iterdir())  # the clean-up happened all the same


@pytest.mark.parametrize(("params", "zero", "track", "expect"), [
    ("nvme", {"overlap_step_with_forward": True}, False, True),
    ("nvme", {}, False, False),  # off unless asked
    ("cpu", {"overlap_step_with_forward": True}, False, "cuda"),  # one rank, CPU: a host
    # shard is the full tensor (not on CUDA: it is copied to the device)
    ("nvme", {"overlap_step_with_forward": True}, True, False),  # the norm sums gradients
    # the updates free
    ("nvme", {"overlap_step_with_forward": True, "overlap_optimizer": False}, False, False),
])
def test_when_the_step_may_return_early(params: str, zero: dict, track: bool,
                                        expect: bool | str, tmp_path: Path) -> None:
    cfg = outcore.Config(dtype="fp32", zero=zero, track_grad_norm=track,
                         offload={"params": params, "optimizer": "nvme",
                                  "nvme_path": str(tmp_path)})
    with outcore.initialize(_model(), cfg) as engine:
        if isinstance(expect, str):  # true on that device only
            expect = engine.device.type == expect
        assert engine.defers_updates is expect
