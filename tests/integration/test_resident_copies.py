"""Training copies kept in host memory with everything on NVMe (zero/build.py's [Note:
training copies kept in memory across steps]): the run computes what a run with every copy
on disk computes, bit for bit, while only the optimizer state moves; a user's reads, writes,
checkpoints and a second engine see the copies as they are."""

from __future__ import annotations

import threading
import time
import warnings
from concurrent import futures
from pathlib import Path

import pytest
import torch

import outcore
from outcore.app.models import GPT, GPTConfig
from outcore.device.accel import default_device
from outcore.optim.optimizer import ShardedOptimizer
from outcore.optim.pipeline import InFlight
from tests.common import BATCH, SEQ, VOCAB, Quirky

STATE_BYTES = 12  # fp32 master, exp_avg and exp_avg_sq per element
_CPU_ONLY = pytest.mark.cpu_only("copies stay resident on a CPU device only "
                                 "(plan.keeps_copies_resident)")


def _cfg(tmp: Path, prefetch: int | None = None, resident: bool = True, **extra: object
         ) -> dict:
    zero: dict = {"resident_copies": resident}
    if prefetch is not None:
        zero["prefetch_bytes"] = prefetch
    return {"dtype": "bf16", "optimizer": {"lr": 1e-2}, "zero": zero,
            "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp)}, **extra}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def _train(engine, steps: range) -> tuple[list[float], list[tuple[int, int]]]:
    """Losses, and the bytes read and written by each step."""
    store = engine.rt.nvme
    losses, moved = [], []
    for s in steps:
        r, w = store.bytes_read, store.bytes_written
        loss = engine(*_batch(s), use_optional=s % 2 == 0)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        moved.append((store.bytes_read - r, store.bytes_written - w))
    return losses, moved


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _updated_elements(model, step: int) -> int:
    """Elements of the parameters that get a gradient at ``step`` in Quirky: all but the
    gate's bias (never used) and, on odd steps, the optional block."""
    out = 0
    for name, p in model.named_parameters():
        if name == "gate.bias" or (step % 2 and name.startswith("optional.")):
            continue
        out += p.numel()
    return out


@_CPU_ONLY
def test_only_the_optimizer_state_moves_and_the_run_is_the_same(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Quirky()
    twin = Quirky()
    twin.load_state_dict(model.state_dict())
    engine = outcore.initialize(model, _cfg(tmp_path / "a"))
    other = outcore.initialize(twin, _cfg(tmp_path / "b", resident=False))  # each on disk
    assert engine.plan.keeps_copies_resident and not other.plan.keeps_copies_resident
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert engine.schedule_stats()["resident_bytes"] == 2 * n  # bf16, the whole model
    assert other.schedule_stats()["resident_bytes"] == 0
    in_memory = outcore.initialize(Quirky(), {"dtype": "bf16", "offload": {"params": "cpu"}})
    assert in_memory.schedule_stats()["resident_bytes"] == 0  # zero-copy, but not this feature
    in_memory.close()

    losses, moved = _train(engine, range(4))
    twin_losses, twin_moved = _train(other, range(4))

    assert losses == twin_losses
    for step, ((read, written), (twin_read, twin_written)) in enumerate(
            zip(moved, twin_moved, strict=True)):
        updated = _updated_elements(model, step)
        assert (read, written) == (STATE_BYTES * updated,) * 2, step  # no copy on disk
        assert twin_written == (STATE_BYTES + 2) * updated, step  # each bf16 copy written
        assert twin_read > STATE_BYTES * updated, step  # and read back
    engine.close()
    other.close()
    for name, value in _weights(model).items():
        assert torch.equal(value, _weights(twin)[name]), name  # handed back the same


def test_reads_and_writes_of_weights_between_steps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, twin = Quirky(), Quirky()
    twin.load_state_dict(model.state_dict())
    engines = [outcore.initialize(model, _cfg(tmp_path / "a")),
               outcore.initialize(twin, _cfg(tmp_path / "b", resident=False))]
    seen = []
    for m, e in zip((model, twin), engines, strict=True):
        _train(e, range(2))
        w = m.blocks[0].fc1.weight
        before = w.detach().clone()  # the updated copy, as the next forward reads it
        with torch.no_grad():
            w.mul_(0.5)  # a user's write between steps
        after = w.detach().clone()
        losses, _ = _train(e, range(2, 4))
        seen.append((before, after, losses, m.gate.weight.detach().clone()))
    (b0, a0, l0, g0), (b1, a1, l1, g1) = seen
    assert torch.equal(b0, b1) and torch.equal(a0, a1)
    assert torch.equal(a0, (b0.float() * 0.5).to(a0.dtype))
    assert l0 == l1 and torch.equal(g0, g1)
    for e in engines:
        e.close()


@_CPU_ONLY
def test_a_checkpoint_round_trip_and_a_second_engine(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Quirky()
    engine = outcore.initialize(model, _cfg(tmp_path / "a"))
    _train(engine, range(2))
    engine.save_checkpoint(tmp_path / "ckpt")
    after, _ = _train(engine, range(2, 4))
    engine.load_checkpoint(tmp_path / "ckpt")
    again, _ = _train(engine, range(2, 4))
    assert again == after
    engine.close()
    kept = _weights(model)  # the fp32 masters, handed back

    def shows_kept() -> bool:  # in bf16, as an engine shows them
        return all(torch.equal(p.detach().float(), kept[n].bfloat16().float())
                   for n, p in model.named_parameters())

    # a second engine takes the model over with another placement, then a third on NVMe
    second = outcore.initialize(model, {"dtype": "bf16", "optimizer": {"lr": 1e-2}})
    assert shows_kept()
    second.close()
    third = outcore.initialize(model, _cfg(tmp_path / "c"))
    assert third.schedule_stats()["resident_bytes"] > 0
    assert shows_kept()
    third.close()
    assert all(torch.equal(v, kept[n]) for n, v in _weights(model).items())


@_CPU_ONLY
def test_the_budget_keeps_room_for_the_groups_left_on_disk(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(layers=4, hidden=64, heads=4, vocab=512, seq_len=32)
    model, twin = GPT(cfg), GPT(cfg)
    twin.load_state_dict(model.state_dict())
    budget = 160 * 1024
    cfg = _cfg(tmp_path / "a", prefetch=budget)
    cfg["zero"]["persistence_threshold_bytes"] = 0  # every group goes through the schedule
    engine = outcore.initialize(model, cfg)
    other = outcore.initialize(twin, _cfg(tmp_path / "b", resident=False))
    groups = engine.groups
    streamed = sorted((g.full_bytes for g in groups if not g.persistent), reverse=True)
    resident = engine.schedule_stats()["resident_bytes"]
    assert resident > 0 and streamed  # some stay, some stream
    assert resident + sum(streamed[:2]) <= budget
    assert engine.schedule_stats()["prefetch_bytes"] == budget - resident
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(3))
    for e in (engine, other):
        for _ in range(3):
            loss = e(x, x)
            e.backward(loss)
            e.step()
    assert torch.equal(engine(x, x).detach(), other(x, x).detach())
    engine.close()
    other.close()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 twin.state_dict().values(), strict=True))


@_CPU_ONLY
def test_a_read_right_after_backward_waits_for_the_update(tmp_path: Path) -> None:
    """The update a backward starts writes the resident copy the model shows, on the update
    thread: a read before ``step()`` waits for it, as a read of a copy on disk does, and
    never sees it half written."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(1 << 20, 8)  # 8M elements: an update that takes a while
    engine = outcore.initialize(emb, _cfg(tmp_path))
    assert engine.schedule_stats()["resident_bytes"] == 2 * emb.weight.numel()
    x = torch.arange(0, 1 << 20, 997)[None]
    engine.backward(engine(x).float().pow(2).mean())
    early = emb.weight.detach().clone()  # right after backward, before step()
    engine.step()
    assert torch.equal(early, emb.weight.detach())
    engine.close()


class _FrozenEnds(torch.nn.Module):
    """Trainable layers between two frozen embeddings, which always stay on disk."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.first = torch.nn.Embedding(640, 32).requires_grad_(False)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(layers))
        self.last = torch.nn.Embedding(640, 32).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        for layer in self.layers:
            h = h + layer(h)
        return (h + self.last(x)).float().pow(2).mean()


@_CPU_ONLY
@pytest.mark.parametrize("layers", [4, 40])
def test_the_groups_left_on_disk_keep_their_read_ahead(tmp_path: Path, layers: int) -> None:
    """Resident copies never take the room the schedule needs for the two largest groups
    still read from disk, frozen ones included (40 KiB each here, in a 96 KiB budget); a
    mostly frozen model (4 small layers) keeps every copy on disk and the whole budget."""
    torch.manual_seed(0)
    model = _FrozenEnds(layers)
    cfg = _cfg(tmp_path, prefetch=96 << 10)
    cfg["zero"]["persistence_threshold_bytes"] = 0
    engine = outcore.initialize(model, cfg)
    stats = engine.schedule_stats()
    streamed = sorted((g.full_bytes for g in engine.groups if not g.zero_copy), reverse=True)
    assert streamed[:2] == [640 * 32 * 2] * 2
    if layers == 4:
        assert stats["resident_bytes"] == 0 and stats["prefetch_bytes"] == 96 << 10
    else:
        assert stats["resident_bytes"] > 0
        assert stats["prefetch_bytes"] == (96 << 10) - stats["resident_bytes"]
        assert stats["prefetch_bytes"] >= sum(streamed[:2])
    x = torch.randint(0, 640, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        engine.backward(engine(x))
        engine.step()
    assert engine.schedule_stats()["prefetch_hits"] > 0
    engine.close()


def _tentative_run(model: Quirky, cfg: dict, forwards: bool) -> tuple[list, dict, dict]:
    """Six clipped steps, reading between backward and ``step()``: a weight, a group-mate of
    a weight shown by ``gathered_parameters`` and, with ``forwards``, an evaluation and a
    submodule called on its own. Returns what was seen, the optimizer's counts, the weights."""
    engine = outcore.initialize(model, cfg)
    assert engine.plan.speculates
    seen: list = []
    h = torch.randn(BATCH, SEQ, 32, generator=torch.Generator().manual_seed(5))
    for s in range(6):
        loss = engine(*_batch(s), use_optional=s % 2 == 0)
        before = model.blocks[0].fc1.weight.detach().clone()
        bias = model.blocks[0].fc1.bias.detach().clone()
        engine.backward(loss)
        assert torch.equal(model.blocks[0].fc1.weight.detach(), before), s  # as before step()
        with engine.gathered_parameters([model.blocks[0].fc1.weight]):
            assert torch.equal(model.blocks[0].fc1.bias.detach(), bias), s
        if forwards and s == 3:
            with torch.no_grad():
                seen.append(engine(*_batch(99)).item())  # an evaluation
                seen.append(model.blocks[1](h.to(default_device(), torch.bfloat16)).float())
        engine.step()
        seen.append(loss.item())
    stats = dict(engine.sharded_optimizer.stats)
    stats["shown"] = any(g.zero_copy for g in engine.groups)  # the model shows the copies
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    return seen, stats, weights


@pytest.mark.parametrize("forwards", [False, True])
def test_tentative_updates_never_show_before_step(tmp_path: Path, forwards: bool) -> None:
    """With clipping the updates during backward are tentative (the speculative step) and
    write the resident copies in place. What is read between backward and ``step()`` is the
    value from before the step, as torch's optimizer has it: a weight's own read comes from
    its master and keeps the tentative updates; a forward takes them back, for ``step()`` to
    redo. The run equals one with every copy on disk."""
    torch.manual_seed(0)
    model, twin = Quirky(), Quirky()
    twin.load_state_dict(model.state_dict())
    seen, stats, weights = _tentative_run(
        model, _cfg(tmp_path / "a", gradient_clipping=100.0), forwards)
    twin_seen, _, twin_weights = _tentative_run(
        twin, _cfg(tmp_path / "b", resident=False, gradient_clipping=100.0), forwards)
    assert stats["tentative_kept"] > 0
    # reads alone take nothing back, nor does an evaluation where no copy is shown (a GPU)
    assert (stats["tentative_redone"] > 0) is (forwards and stats["shown"])
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(seen, twin_seen, strict=True))
    assert all(torch.equal(w, twin_weights[n]) for n, w in weights.items())


def test_a_submodule_call_that_fails_before_it_runs_leaves_the_model_usable(
        tmp_path: Path) -> None:
    """What the model's call does first can fail (an update's error, raised by the wait):
    a submodule called on its own then raises that error alone, and its groups are
    released as after any forward."""
    torch.manual_seed(0)
    model = Quirky()
    engine = outcore.initialize(model, _cfg(tmp_path))

    def failing() -> None:
        raise RuntimeError("an update failed (test)")

    engine.rt.before_forward = failing
    h = torch.randn(BATCH, SEQ, 32).to(default_device(), torch.bfloat16)
    with warnings.catch_warnings(record=True) as seen, pytest.raises(
            RuntimeError, match="an update failed"):
        warnings.simplefilter("always")
        model.blocks[0](h)
    assert not [str(w.message) for w in seen if "silenced" in str(w.message)]  # the error alone
    assert all(g.holds == 0 for g in engine.groups) and not engine.hooks.frames
    engine.rt.before_forward = lambda: None
    assert model.blocks[0](h).shape == h.shape
    loss = engine(*_batch(0))
    engine.backward(loss)
    engine.step()
    engine.close()


@_CPU_ONLY
def test_the_step_tail_run_into_the_next_forward_keeps_the_copies_in_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``zero.overlap_step_with_forward`` with the copies kept in memory: ``step()`` returns
    while updates still write copies the model shows. The next forward waits for each
    group's own, and so does a read of a weight right after ``step()``: the run is the run
    whose step waits, bit for bit, and only the optimizer state moves."""
    release = _held_updates(monkeypatch)
    torch.manual_seed(0)
    model, twin = Quirky(), Quirky()
    twin.load_state_dict(model.state_dict())
    cfg = _cfg(tmp_path / "a")
    cfg["zero"]["overlap_step_with_forward"] = True
    engine = outcore.initialize(model, cfg)
    other = outcore.initialize(twin, _cfg(tmp_path / "b"))
    assert engine.plan.defers_updates and engine.plan.keeps_copies_resident
    assert not other.plan.defers_updates
    kept = engine.schedule_stats()["resident_bytes"]
    assert kept == other.schedule_stats()["resident_bytes"] > 0
    start = [(e.rt.nvme.bytes_read, e.rt.nvme.bytes_written) for e in (engine, other)]

    losses, _ = _train(engine, range(4))
    twin_losses, _ = _train(other, range(4))
    assert engine.schedule_stats()["updates_after_step"] > 0
    assert losses == twin_losses

    other.backward(other(*_batch(4)))
    other.step()
    release.clear()
    engine.backward(engine(*_batch(4)))
    engine.step()  # returns with the updates held
    assert not all(job.done.done() for job in engine.sharded_optimizer.pending_jobs)
    threading.Timer(0.2, release.set).start()
    for (name, value), want in zip(_weights(model).items(), _weights(twin).values(),
                                   strict=True):
        assert torch.equal(value, want), name  # read after the updates, never mid-way

    for e in (engine, other):
        e.synchronize()
    moved = [(e.rt.nvme.bytes_read - r, e.rt.nvme.bytes_written - w)
             for e, (r, w) in zip((engine, other), start, strict=True)]
    state = STATE_BYTES * sum(_updated_elements(model, s) for s in range(5))
    assert moved[0] == moved[1] == (state, state)  # no copy on disk in either
    assert engine.schedule_stats()["resident_bytes"] == kept
    engine.close()
    other.close()


def _held_updates(monkeypatch: pytest.MonkeyPatch,
                  only: list[torch.nn.Parameter] | None = None) -> threading.Event:
    """Slow every update a little, and hold each (each of ``only``'s parameters) while the
    returned event is clear."""
    apply = ShardedOptimizer.apply
    release = threading.Event()
    release.set()
    held = None if only is None else {id(p) for p in only}

    def slowed(self: ShardedOptimizer, work: InFlight, hp: dict) -> None:
        time.sleep(0.005)  # updates that outlast the step
        if held is None or any(id(sl.sp.param) in held for sl in work.params):
            release.wait(30)  # held while the test looks at a step that returned early
        apply(self, work, hp)

    monkeypatch.setattr(ShardedOptimizer, "apply", slowed)
    return release


class _Fused(torch.nn.Module):
    """Four layers whose weights it reads without calling them, as a fused projection does,
    and a scale of its own: frozen (so on disk, with no update to wait for) if asked."""

    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(32), requires_grad=not frozen)
        self.gates = torch.nn.ModuleList(torch.nn.Linear(32, 32, bias=False) for _ in range(4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        fused = torch.cat([g.weight for g in self.gates])  # read, never called
        return torch.tanh(h @ fused.T).unflatten(-1, (4, 32)).sum(-2) * self.scale


class _ReadNotCalled(torch.nn.Module):
    """A fused projection between two layers (its scale frozen with ``frozen``)."""

    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.block = torch.nn.Linear(32, 32)
        self.mix = _Fused(frozen)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.block(self.emb(idx)))
        h = h + self.mix(h)
        logits = self.head(h).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


@_CPU_ONLY
@pytest.mark.parametrize("frozen", [False, True], ids=["every group resident", "one on disk"])
def test_a_weight_read_without_its_module_waits_for_the_step_tail(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, frozen: bool) -> None:
    """The forward after a step that returned early reads the gates' weights directly, not
    through a call of their module: each read waits for that weight's update, whether every
    group keeps its copies in memory (no forward fetches anything) or some stream from disk,
    and so does the fused projection called on its own. The losses and its output are those
    of a step that waits."""
    torch.manual_seed(0)
    model, twin = _ReadNotCalled(frozen), _ReadNotCalled(frozen)
    twin.load_state_dict(model.state_dict())
    # the gates' updates are held past step(), the other layers' run, so the forward reaches
    # the gates while theirs still wait
    release = _held_updates(monkeypatch, only=[g.weight for g in model.mix.gates])
    cfg = _cfg(tmp_path / "a")
    cfg["zero"]["overlap_step_with_forward"] = True
    engine = outcore.initialize(model, cfg)
    other = outcore.initialize(twin, _cfg(tmp_path / "b"))
    assert engine.plan.defers_updates and engine.schedule_stats()["resident_bytes"] > 0
    assert engine.schedule.movable is frozen  # all resident: no group is ever released

    losses, twin_losses = [], []
    for s in range(4):
        for e, out in ((engine, losses), (other, twin_losses)):
            if e is engine and s == 3:
                release.clear()  # the last step's updates are held past step()
            loss = e(*_batch(s))
            e.backward(loss)
            e.step()
            out.append(loss.item())
            if e is engine and s == 3:
                assert not all(job.done.done() for job in engine.sharded_optimizer.pending_jobs)
                threading.Timer(0.2, release.set).start()
    for e, out in ((engine, losses), (other, twin_losses)):
        out.append(e(*_batch(4)).item())  # the forward behind the held updates
    assert losses == twin_losses

    h = torch.randn(BATCH, SEQ, 32, generator=torch.Generator().manual_seed(5)).bfloat16()
    release.clear()  # (only the engine's gates: the twin's are other parameters)
    for e in (engine, other):
        e.backward(e(*_batch(5)))
        e.step()
    assert not all(job.done.done() for job in engine.sharded_optimizer.pending_jobs)
    threading.Timer(0.2, release.set).start()
    with torch.no_grad():  # the submodule alone, which no access mode watches (its frozen
        alone = model.mix(h)  # scale has no update to wait for)
        assert torch.equal(alone, twin.mix(h))
    engine.close()
    other.close()


@_CPU_ONLY
def test_a_failed_update_of_a_weight_read_directly_is_raised_by_every_later_forward(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gates' update fails after ``step()`` returned: the next forward, which reads their
    weights without calling their modules, raises it, and so does the one after (their
    copies are not to be trusted), and a read of the weight; never a forward on them as
    they are."""
    torch.manual_seed(0)
    model = _ReadNotCalled(frozen=False)
    gates = {id(g.weight) for g in model.mix.gates}
    release = _held_updates(monkeypatch, only=[g.weight for g in model.mix.gates])
    held = ShardedOptimizer.apply
    failing = [False]

    def failing_apply(self: ShardedOptimizer, work: InFlight, hp: dict) -> None:
        held(self, work, hp)  # waits while held
        if failing[0] and any(id(sl.sp.param) in gates for sl in work.params):
            raise RuntimeError("injected update failure")

    monkeypatch.setattr(ShardedOptimizer, "apply", failing_apply)
    cfg = _cfg(tmp_path)
    cfg["zero"]["overlap_step_with_forward"] = True
    engine = outcore.initialize(model, cfg)
    assert not engine.schedule.movable
    engine.backward(engine(*_batch(0)))
    engine.step()
    engine.synchronize()  # that step's updates all land before the failure is armed
    failing[0] = True
    release.clear()  # before backward: the update of a layer may start while backward runs
    engine.backward(engine(*_batch(1)))
    engine.step()  # returns with the gates' update held
    release.set()
    futures.wait([job.done for job in engine.sharded_optimizer.pending_jobs])  # it failed
    for s in (2, 3):
        with pytest.raises(RuntimeError, match="injected update failure"):
            engine(*_batch(s))
    with pytest.raises(RuntimeError, match="injected update failure"):
        model.mix.gates[0].weight.float().sum()
    engine.close()
