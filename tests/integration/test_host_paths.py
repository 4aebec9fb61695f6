"""The host side of offload: aligned memory, reused buffers, memory given back.

These pin down the properties that make offloaded steps cheap on the host: NVMe bytes move
between disk and the tensors that use them without staging copies, gradient buffers are not
re-allocated every step where they must all exist at once anyway, the head of the next
forward is read during the step, and large freed blocks go back to the operating system.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.offload.buffers import ALIGN, AlignedRegions
from tests.common import square_loss_steps
from tests.distributed import run_world
from tests.heap import FREED_RSS, glibc_only, run_fresh, settled, step_faults


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                         nn.Linear(1024, 512), nn.GELU(), nn.Linear(512, 4))


def _train(engine: outcore.Engine, steps: int, x: torch.Tensor | None = None) -> list[float]:
    if x is None:
        x = torch.randn(16, 512, generator=torch.Generator().manual_seed(1))
    return square_loss_steps(engine, x, steps)


@pytest.mark.cpu_only("NVMe reads land in page-aligned full tensors on a CPU device only "
                      "(plan.aligned_full)")
def test_nvme_transfers_need_no_staging_copies(tmp_path: Path) -> None:
    """Full tensors (one rank) and optimizer sub-groups are page-aligned, so O_DIRECT reads
    and writes go straight to them; only ragged tails pass through the I/O pool. (Every
    training copy on disk: kept in memory, none would be read into a full tensor.)"""
    cfg = outcore.Config(dtype="bf16", offload={"params": "nvme", "optimizer": "nvme",
                                                "nvme_path": str(tmp_path)},
                         zero={"resident_copies": False})
    with outcore.initialize(_mlp(), cfg) as engine:
        store = engine.rt.nvme
        # building the shards is a one-off through the pool; count the training steps only
        moved0, staged0 = store.bytes_read + store.bytes_written, store.bytes_staged
        _train(engine, 3)
        moved = store.bytes_read + store.bytes_written - moved0
        staged = store.bytes_staged - staged0
        assert moved > 100 * 2**20
        assert staged < 0.001 * moved, (staged, moved)  # a few bias-sized tails
        regions = engine.rt.full_regions
        assert regions is not None
        assert regions.mapped < regions.fills / 2  # most full tensors reuse released memory
        # a gathered full tensor sits on a page boundary
        first = engine.groups[0]
        first.wait_unshard()
        assert first.params[0].full.data_ptr() % ALIGN == 0


def _staged_share(swap: str) -> float:
    cfg = outcore.Config(dtype="bf16", offload={"params": "nvme", "optimizer": "nvme",
                                                "nvme_path": swap})
    with outcore.initialize(_mlp(), cfg) as engine:
        store = engine.rt.nvme
        moved0, staged0 = store.bytes_read + store.bytes_written, store.bytes_staged
        _train(engine, 2)
        return (store.bytes_staged - staged0) / (store.bytes_read + store.bytes_written - moved0)


def test_two_ranks_read_shards_into_the_packed_buffer_directly(tmp_path: Path) -> None:
    """At two ranks the shards of a group are packed at page-aligned offsets of an aligned
    buffer before the all-gather, so their reads need no staging either."""
    for share in run_world(_staged_share, 2, str(tmp_path)):
        assert share < 0.005, share  # bias-sized shards (under a page) still pass the pool


@pytest.mark.skipif(not AlignedRegions.supported(), reason="this torch cannot swap storages")
def test_aligned_regions_recycle_memory_by_size_within_the_cap() -> None:
    regions = AlignedRegions(cap_bytes=3 * 2**20)
    full = torch.empty(512, 1024, dtype=torch.float32)  # 2 MiB
    view = full.t()  # a view autograd might hold: must see the memory the storage gets
    storage = full.untyped_storage()
    storage.resize_(0)
    regions.fill(storage, full.nbytes)
    assert full.data_ptr() % ALIGN == 0
    full.fill_(2.0)
    assert view[5, 7].item() == 2.0
    first = full.data_ptr()
    regions.release(storage)
    assert storage.nbytes() == 0 and regions.cached_bytes == full.nbytes
    regions.fill(storage, full.nbytes)
    assert full.data_ptr() == first and regions.cached_bytes == 0  # reused, not re-mapped
    assert (regions.fills, regions.mapped) == (2, 1)
    other = torch.empty(0, dtype=torch.uint8).untyped_storage()
    regions.fill(other, 2 * full.nbytes)
    regions.release(storage)
    regions.release(other)  # 4 MiB more would pass the 3 MiB cap: unmapped instead
    assert regions.cached_bytes == full.nbytes
    roomy = AlignedRegions(cap_bytes=8 * 2**20)
    storages = [torch.empty(0, dtype=torch.uint8).untyped_storage() for _ in range(3)]
    for s in storages:
        roomy.fill(s, 2 * 2**20)
    for s in storages:
        roomy.release(s)
    assert roomy.cached_bytes == 6 * 2**20
    roomy.set_cap(2 * 2**20)  # a lower cap gives back what is kept beyond it, at once
    assert roomy.cached_bytes == 2 * 2**20
    roomy.fill(storages[0], 2 * 2**20)
    roomy.fill(storages[1], 2 * 2**20)
    assert roomy.mapped == 4  # one kept, one mapped afresh


@pytest.mark.parametrize("optimizer", ["none", "nvme"])
def test_gradient_buffers_reused_in_memory_freed_after_nvme_updates(optimizer: str,
                                                                     tmp_path: Path) -> None:
    # 1 MiB of host buffers caps gradients waiting for their update at 2 MiB (optim.py)
    cfg = outcore.Config(dtype="bf16", offload={"params": optimizer, "optimizer": optimizer,
                                                "nvme_path": str(tmp_path),
                                                "host_buffer_bytes": 1 << 20})
    with outcore.initialize(_mlp(), cfg) as engine:
        x = torch.randn(16, 512).to(engine.device)
        grads, after_step = [], []
        for _ in range(2):
            engine.backward(engine(x).float().pow(2).mean())
            # the kept buffer, not `.grad`: on CUDA the update overlaps backward and may
            # have consumed (and dropped) the gradient already, leaving the buffer for next step
            grads.append(engine.params[0]._grad_buffer if optimizer == "none"
                         else engine.params[0].grad)
            engine.step()
            engine.synchronize()  # the step may return with updates (and their grads) left
            after_step.append(engine.params[0].grad)
        by_kind = engine.memory_report()["by_kind"]
    trainable = sum(sp.shard_numel for sp in engine.params) * 4
    if optimizer == "none":  # the state is resident: the same gradient tensor every step
        assert grads[0] is grads[1] is not None
        assert by_kind["device.grads"] == by_kind["peak.device.grads"] == trainable
    else:  # consumed by the update overlapped with backward and freed at once
        assert after_step == [None, None]
        assert by_kind.get("host.grads", 0) == 0
        # at most the 2 MiB cap (or one group above it) waiting, plus the group just reduced
        first, second = sorted(g.shard_numel * 4 for g in engine.groups)[-2:][::-1]
        assert 0 < by_kind["peak.host.grads"] <= max(2 << 20, first) + second < trainable


@pytest.mark.cpu_only("gradients are held as backward made them on a CPU device only "
                      "(plan.holds_raw_grads)")
@pytest.mark.parametrize("accumulate", [1, 2])
def test_nvme_optimizer_holds_bf16_gradients_without_copying(accumulate: int,
                                                              tmp_path: Path) -> None:
    """param.py's [Note: gradients are held, not copied]: with the optimizer on NVMe a bf16
    gradient waits for its update as backward made it (half the bytes of an fp32 copy),
    accumulation turns it into fp32 first, and losses and gradient norms equal the optimizer
    in memory, which keeps fp32 gradient buffers."""
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(1))

    def run(optimizer: str, overlap: bool) -> tuple[list[float], list[float], list[int], set]:
        cfg = outcore.Config(dtype="bf16", gradient_accumulation_steps=accumulate,
                             track_grad_norm=True, zero={"overlap_optimizer": overlap},
                             offload={"optimizer": optimizer, "nvme_path": str(tmp_path)})
        losses, norms, held, dtypes = [], [], [], set()
        with outcore.initialize(_mlp(), cfg) as engine:
            for _ in range(3):
                for micro in range(accumulate):
                    loss = engine(x * (1 + micro)).float().pow(2).mean()
                    engine.backward(loss)
                    losses.append(loss.item())
                held.append(engine.memory_report()["by_kind"].get("host.grads", 0))
                dtypes.update(sp.grad.dtype for sp in engine.params if sp.grad is not None)
                engine.step()
                norms.append(engine.last_grad_norm)
            trainable = sum(sp.numel for sp in engine.params)
        return losses, norms, [h // trainable for h in held], dtypes

    ref_losses, ref_norms, _, ref_dtypes = run("cpu", False)
    losses, norms, bytes_per_elem, dtypes = run("nvme", False)
    assert losses == ref_losses
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    # what waits for the step: bf16 as backward made it, or fp32 once accumulated
    assert bytes_per_elem == [2 if accumulate == 1 else 4] * 3
    assert dtypes == {torch.bfloat16 if accumulate == 1 else torch.float32}
    assert ref_dtypes == {torch.float32}  # kept fp32 buffers where the state is in memory
    overlapped_losses, overlapped_norms, _, _ = run("nvme", True)  # updates during backward
    assert overlapped_losses == ref_losses
    assert overlapped_norms == pytest.approx(ref_norms, rel=1e-6)


def test_next_forward_head_is_read_during_the_step(tmp_path: Path) -> None:
    """Masters on NVMe: the head cannot be carried over the step, so it is read during it.
    (With ``overlap_step_with_forward`` the head would be read once its updates finish, after
    the step: it is off here, as by default, to see the read start inside the step.)"""
    cfg = outcore.Config(dtype="fp32", offload={"params": "nvme", "optimizer": "nvme",
                                                "nvme_path": str(tmp_path)},
                         zero={"persistence_threshold_bytes": 0, "prefetch_bytes": 8 * 2**20,
                               "overlap_step_with_forward": False})
    with outcore.initialize(_mlp(), cfg) as engine:
        assert not engine.schedule.carry
        _train(engine, 1)  # traces the order
        fetched = engine.schedule_stats()["fetches"] + engine.schedule_stats()["on_demand_fetches"]
        assert engine.groups[0].state.value == "fetching"  # its read started in step()
        losses = _train(engine, 3)
        s = engine.schedule_stats()
        # after the traced iteration, nothing is ever waited for on demand
        assert s["fetches"] + s["on_demand_fetches"] == fetched
        assert s["divergences"] == 0
    cfg_off = cfg.with_overrides({"zero": {"prefetch_bytes": 0}})
    with outcore.initialize(_mlp(), cfg_off) as engine:
        _train(engine, 1)
        assert _train(engine, 3) == losses


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_head_groups_carried_over_the_step_are_not_read_again(dtype: str,
                                                               tmp_path: Path) -> None:
    """Masters in memory at one rank: the groups the next forward starts with stay gathered
    through the step and are refreshed from the masters (schedule.py's [Note: carrying the
    head across iterations]), so they are not fetched again; the losses are bit-identical to
    not carrying them and to no prefetch at all. The second linear is frozen: its shard lives
    on NVMe (the trainable ones are cast from their masters), so its reads show what carrying
    saves."""
    size = 2 if dtype == "bf16" else 4
    linears = [m for m in _mlp() if isinstance(m, nn.Linear)]
    first, second = (sum(p.numel() for p in m.parameters()) * size for m in linears[:2])
    # room for the first two linears: the first is not used by backward (its input needs no
    # gradient), the second is backward's last, so it is what gets carried
    budget = first + second + 4096
    cfg = outcore.Config(dtype=dtype, offload={"params": "nvme", "nvme_path": str(tmp_path)},
                         zero={"persistence_threshold_bytes": 0, "prefetch_bytes": budget})

    def run(carry: bool, prefetch: bool = True) -> tuple[list[float], int, dict]:
        c = cfg if prefetch else cfg.with_overrides({"zero": {"prefetch_bytes": 0}})
        model = _mlp()
        model[2].requires_grad_(False)  # the second linear: see the docstring
        with outcore.initialize(model, c) as engine:
            engine.schedule.carry = carry
            store = engine.rt.nvme
            _train(engine, 2)
            store.wait_idle()  # the next forward's prefetches are in flight after a step
            read0 = store.bytes_read
            losses = _train(engine, 4)
            store.wait_idle()
            return losses, (store.bytes_read - read0) // 4, engine.schedule_stats()

    carried, read_carried, stats = run(True)
    plain, read_plain, plain_stats = run(False)
    assert carried == plain == run(False, prefetch=False)[0]
    assert stats["carried"] >= 4 and plain_stats["carried"] == 0
    assert stats["divergences"] == 0
    assert read_plain - read_carried == second  # the carried linear is never read again


def test_large_frees_return_to_the_os() -> None:
    """With the glibc threshold fixed, freed multi-MiB blocks leave RSS at once even when a
    small live object sits above them in the heap (host_memory.py's note). In a fresh process:
    the policy is process-wide, and a heap that an earlier engine let keep its frees would
    serve the blocks from pages already resident."""
    result = run_fresh(_RETURNED_RSS)
    if result is None:
        pytest.skip("not glibc")
    before, grown, after = result
    assert grown - before > 200 * 2**20
    assert after - before < 32 * 2**20, (before, grown, after)


_RETURNED_RSS = """
import gc, json
import psutil, torch
from outcore.offload.host_memory import return_large_frees_to_os
if not return_large_frees_to_os():
    print("null")
    raise SystemExit
proc = psutil.Process()
warm = torch.ones(4 << 20, dtype=torch.uint8)  # would raise glibc's dynamic threshold
del warm
gc.collect()
before = proc.memory_info().rss
blocks = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(64)]  # 256 MiB, touched
pin = torch.ones(16, dtype=torch.uint8)  # a small live allocation after them
grown = proc.memory_info().rss
del blocks
gc.collect()
print(json.dumps([before, grown, proc.memory_info().rss]))
"""


@glibc_only
@pytest.mark.cpu_only("counts the page faults of steps computed in host memory")
def test_in_memory_steps_reuse_pages_instead_of_faulting_them_in() -> None:
    """With the optimizer state in memory, a step's activations and gradients reuse the last
    step's pages (host_memory.py's [Note: page faults are the other cost]); a config that
    asks for large frees to be given back (``offload.reuse_freed_memory: false``) faults
    them in again every step."""
    keep = step_faults({})
    given_back = step_faults({"reuse_freed_memory": False})
    assert keep["policy"] == "keep" and given_back["policy"] == "return"
    assert settled(given_back["faults"]) > 20_000, given_back
    assert settled(keep["faults"]) * 3 < settled(given_back["faults"]), (keep, given_back)


@glibc_only
@pytest.mark.cpu_only("counts the page faults of steps computed in host memory")
def test_small_host_reuses_pages_when_it_has_room_or_is_asked(tmp_path: Path) -> None:
    """With the optimizer state on NVMe large frees go back to the system while the model is
    built and in the first step. Then a host with room for it reuses them, as
    ``offload.reuse_freed_memory: true`` does on any host, and a host without room, or a
    config saying ``false``, keeps giving them back (host_memory.py's [Note: reuse on a small
    host, when asked] and [Note: reuse decided by the first step])."""
    nvme = {"optimizer": "nvme", "nvme_path": str(tmp_path)}
    roomy = step_faults(nvme, room=1 << 50)
    short = step_faults(nvme, room=64 << 20)
    refused = step_faults({**nvme, "reuse_freed_memory": False}, room=1 << 50)
    asked = step_faults({**nvme, "reuse_freed_memory": True}, room=64 << 20)
    assert [r["policy"] for r in (roomy, short, refused, asked)] == [
        "reuse", "return", "return", "reuse"]
    for r in (roomy, short, refused, asked):  # the build's frees are not kept (the note)
        assert r["at_build"] == "return"
    for given_back in (short, refused):
        assert settled(given_back["faults"]) > 20_000, given_back
        for reused in (roomy, asked):
            assert settled(reused["faults"]) * 3 < settled(given_back["faults"]), (
                reused, given_back)
    assert not any(tmp_path.iterdir())  # each run's swap files are gone




@glibc_only
def test_small_host_reuse_gives_back_what_exceeds_its_bound() -> None:
    """Under the small-host reuse policy, a free heap top beyond ``REUSE_TRIM_BYTES`` goes
    back to the system; the in-memory policy keeps it (host_memory.py's notes). The bound
    is on the heap's top only: a freed block below a live one stays either way."""
    for policy, kept in (("reuse", False), ("keep", True)):
        before, grown, after = run_fresh(FREED_RSS, policy)
        assert grown - before > 500 * 2**20, (policy, before, grown)
        assert (after - before > 500 * 2**20) is kept, (policy, before, grown, after)


@pytest.mark.parametrize("opt", [{"type": "adamw", "lr": 1e-2, "weight_decay": 0.1},
                                 {"type": "sgd", "lr": 0.1, "momentum": 0.9}])
def test_slots_rotate_over_many_sub_groups_of_many_slices(opt: dict, tmp_path: Path) -> None:
    """A budget for 8192-element sub-groups: each holds slices of several parameters at
    padded, non-zero offsets, and the three slots rotate over many sub-groups; the result
    is bit-identical to the optimizer in memory."""
    # fp32 master + states + the held bf16 gradient's fp32 cast, bf16 copy
    per_elem = 4 * (3 if opt["type"] == "adamw" else 2) + 4 + 2
    host = 2 * 3 * 8192 * per_elem

    def run(where: str) -> list[float]:
        cfg = outcore.Config.from_dict({
            "dtype": "bf16", "optimizer": opt,
            "offload": {"optimizer": where, "params": where, "nvme_path": str(tmp_path),
                        "host_buffer_bytes": -(-host // 4096) * 4096},
        })
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(60, 50), nn.Tanh(), nn.Linear(50, 70), nn.Tanh(),
                              nn.Linear(70, 90), nn.Tanh(), nn.Linear(90, 3))
        with outcore.initialize(model, cfg) as engine:
            if where == "nvme":
                so = engine.sharded_optimizer
                chunks = list(so.subgroups(list(so.params)))
                assert len(chunks) >= 3 and max(len(c) for c in chunks) >= 3
            return _train(engine, 4, torch.randn(8, 60))

    assert run("nvme") == run("none")


@pytest.mark.cpu_only("the table is the CPU device's: on CUDA the default state is in "
                      "device memory, not host memory")
@pytest.mark.parametrize("offload, at_build, at_training", [
    ({}, ["keep force=False"], []),
    ({"reuse_freed_memory": True}, ["keep force=True"], []),
    ({"reuse_freed_memory": False}, ["return"], []),
    ({"optimizer": "nvme"}, ["return"], []),
    ({"optimizer": "nvme", "reuse_freed_memory": True}, ["return"], ["reuse"]),
    ({"optimizer": "nvme", "reuse_freed_memory": False}, ["return"], []),
])
def test_which_malloc_policy_each_config_asks_for(offload: dict, at_build: list[str],
                                                  at_training: list[str], tmp_path: Path,
                                                  monkeypatch) -> None:
    """The policy a runtime applies while the model is built and once training begins, for
    each ``offload.reuse_freed_memory`` with the state in memory or on NVMe (runtime/context.py)."""
    from outcore.runtime import context as rt_mod

    calls: list[str] = []
    monkeypatch.setattr(rt_mod, "return_large_frees_to_os", lambda: calls.append("return"))
    monkeypatch.setattr(rt_mod, "keep_freed_memory_for_reuse",
                        lambda force=False: calls.append(f"keep force={force}"))
    monkeypatch.setattr(rt_mod, "reuse_freed_memory_on_small_host",
                        lambda: calls.append("reuse"))
    if offload.get("optimizer") == "nvme":
        offload = {**offload, "nvme_path": str(tmp_path)}
    rt = rt_mod.Runtime(outcore.Config.from_dict({"offload": offload}))
    try:
        assert calls == at_build
        rt.begin_training()
        assert calls == at_build + at_training
    finally:
        rt.close()


@pytest.mark.cpu_only("the table is the CPU device's: on CUDA the default state is in "
                      "device memory, not host memory")
@pytest.mark.parametrize("offload, trainable, watched", [
    ({"optimizer": "nvme"}, 1.0, True),
    ({"optimizer": "nvme", "reuse_freed_memory": True}, 1.0, True),  # for the heap's top
    ({"optimizer": "nvme", "reuse_freed_memory": False}, 1.0, False),
    ({}, 1.0, False),  # the state in memory: its heap is kept from the build on
    ({"params": "nvme"}, 0.01, False),  # a frozen base on disk: given back for good
])
def test_the_first_step_decides_reuse_where_the_config_leaves_it_open(
        offload: dict, trainable: float, watched: bool, tmp_path: Path, monkeypatch) -> None:
    """Which runtimes wait for the first step to decide (host_memory.py's [Note: reuse
    decided by the first step]), and the decision: reuse when the room available to this
    rank is ``REUSE_ROOM`` working sets or more, the room shared by the ranks on the host,
    decided once. Asked for, reuse stands whatever the room, and the room the first step
    leaves bounds the heap's kept top in both cases."""
    from outcore.offload.host_memory import REUSE_ROOM
    from outcore.runtime import context as rt_mod

    calls: list[object] = []
    monkeypatch.setattr(rt_mod, "reuse_freed_memory_on_small_host",
                        lambda: calls.append("reuse") or True)
    monkeypatch.setattr(rt_mod, "bound_reused_top",
                        lambda top_bytes: calls.append(("bound", top_bytes)) or True)
    if "nvme" in offload.values():
        offload = {**offload, "nvme_path": str(tmp_path)}
    cfg = outcore.Config.from_dict({"offload": offload})

    def runtime() -> rt_mod.Runtime:
        rt = rt_mod.Runtime(cfg, trainable_fraction=trainable)
        rt.begin_training(trainable)
        calls.clear()
        return rt

    rt = runtime()
    try:
        assert (rt.working_set == 0) is watched
        rt.sample_working_set()
        if not watched:
            rt.settle_reuse(1 << 60)
            assert calls == [] and rt.working_set is None
            return
        held = rt.working_set
        assert held > 0
        # asked for, the room only bounds the heap's kept top: a REUSE_ROOM-th of it
        asked = [("bound", held - 1)] if offload.get("reuse_freed_memory") else []
        rt.settle_reuse(REUSE_ROOM * held - 1)  # just short of room
        assert calls == asked and rt.working_set is None
        rt.settle_reuse(1 << 60)  # decided once: a later step changes nothing
        assert calls == asked
    finally:
        rt.close()
    if asked:
        return
    for ranks, room, reused in ((1, REUSE_ROOM, True), (2, REUSE_ROOM, False),
                                (2, 2 * REUSE_ROOM, True)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
        rt = runtime()
        try:
            rt.working_set = 100 << 20
            rt.settle_reuse(room * (100 << 20))
            share = room * (100 << 20) // ranks // REUSE_ROOM
            assert calls == (["reuse", ("bound", share)] if reused else []), (ranks, room)
        finally:
            rt.close()


@pytest.mark.cpu_only("the state is in host memory by default only on the CPU device")
def test_a_mostly_frozen_model_gives_large_frees_back(tmp_path: Path, monkeypatch) -> None:
    """With the state in memory but most parameters frozen (LoRA) and on NVMe, the host is
    not sized for the model: large frees go back, from the build when the builder knows, else
    once the engine sees the model (host_memory.py's [Note: a frozen base does not size the
    host])."""
    from outcore.runtime import context as rt_mod

    calls: list[str] = []
    monkeypatch.setattr(rt_mod, "return_large_frees_to_os", lambda: calls.append("return"))
    monkeypatch.setattr(rt_mod, "keep_freed_memory_for_reuse",
                        lambda force=False: calls.append(f"keep force={force}"))
    cfg = outcore.Config.from_dict({"offload": {"params": "nvme",
                                                "nvme_path": str(tmp_path)}})
    rt = rt_mod.Runtime(cfg, trainable_fraction=0.0)
    rt.begin_training(0.01)
    rt.close()
    assert calls == ["return", "return"]
    calls.clear()
    rt = rt_mod.Runtime(cfg)  # outcore.init without frozen=True, then peft froze the base
    rt.begin_training(0.01)
    rt.close()
    assert calls == ["keep force=False", "return"]
    calls.clear()
    rt = rt_mod.Runtime(cfg.with_overrides({"offload": {"reuse_freed_memory": True}}),
                        trainable_fraction=0.0)
    rt.begin_training(0.01)  # an explicit choice stands
    rt.close()
    assert calls == ["keep force=True"]
    with outcore.init(cfg, frozen=True) as built:
        torch.nn.Linear(4, 4)
    assert calls[-1] == "return"
    built.runtime.close()
    calls.clear()
    rt = rt_mod.Runtime(outcore.Config(), trainable_fraction=0.0)  # the base in memory: kept
    rt.begin_training(0.01)
    rt.close()
    assert calls == ["keep force=False"]
