"""Parameters on NVMe with their masters in memory: a trainable parameter's training copy is
cast from its master at each fetch and never stored (storage.py's [Note: the training copy is
derived from masters in memory]); a frozen one keeps its 16-bit shard on NVMe."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.offload.storage import CastShard, NvmeShard
from outcore.sizing import placement
from outcore.sizing.placement import prefetch_share
from tests.common import square_loss_steps
from tests.distributed import run_world


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 8))


def _cfg(params: str, optimizer: str, swap: Path, dtype: str = "bf16",
         opt: str = "adamw") -> outcore.Config:
    return outcore.Config.from_dict({
        "dtype": dtype, "optimizer": {"type": opt, "lr": 1e-2},
        "offload": {"params": params, "optimizer": optimizer, "nvme_path": str(swap)}})


def _losses(engine: outcore.Engine, steps: int = 4) -> list[float]:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    return square_loss_steps(engine, x, steps)


@pytest.mark.parametrize("dtype, opt", [("bf16", "adamw"), ("fp32", "adamw"),
                                        ("bf16", "adafactor")])
def test_trainable_params_on_nvme_move_no_bytes_and_train_as_on_the_host(
        dtype: str, opt: str, tmp_path: Path) -> None:
    """The losses equal those with the parameters in host memory, bit for bit, and the swap
    file is neither written nor read for them: not at the build, not in any step."""
    with outcore.initialize(_model(), _cfg("cpu", "cpu", tmp_path, dtype, opt)) as engine:
        reference = _losses(engine)
    with outcore.initialize(_model(), _cfg("nvme", "cpu", tmp_path, dtype, opt)) as engine:
        assert engine.plan.derives_compute_copy
        assert all(isinstance(sp.compute_shard, CastShard) for sp in engine.params)
        store = engine.rt.nvme
        assert store.bytes_written == 0 and store.bytes_allocated == 0
        assert _losses(engine) == reference
        assert store.bytes_read == 0 and store.bytes_written == 0
        assert engine.memory_report()["nvme"] == 0  # nothing of theirs on the ledger's disk


def test_a_frozen_param_stays_on_nvme_beside_derived_ones(tmp_path: Path) -> None:
    """A frozen layer has no master: its bf16 shard lives on NVMe and every fetch reads it,
    while the trainable layers' copies are cast; training matches the host run."""
    def frozen_first() -> nn.Sequential:
        model = _model()
        model[0].requires_grad_(False)
        return model

    with outcore.initialize(frozen_first(), _cfg("cpu", "cpu", tmp_path)) as engine:
        reference = _losses(engine)
    fetched_each_use = {"zero": {"persistence_threshold_bytes": 0}}  # small layers too
    with outcore.initialize(frozen_first(), _cfg("nvme", "cpu", tmp_path).with_overrides(
            fetched_each_use)) as engine:
        kinds = {sp.name: type(sp.compute_shard) for sp in engine.params}
        assert kinds["0.weight"] is NvmeShard and kinds["2.weight"] is CastShard
        store = engine.rt.nvme
        read0, written0 = store.bytes_read, store.bytes_written
        assert _losses(engine) == reference
        frozen = sum(sp.numel for sp in engine.params if not sp.trainable) * 2
        # read from its shard on NVMe (as forward's head it may stay gathered over a step:
        # schedule.py's carry), never written after the build
        assert written0 == frozen and store.bytes_read - read0 >= frozen
        assert store.bytes_written == written0


def test_a_write_of_values_reaches_the_next_forward(tmp_path: Path) -> None:
    """A user's write between steps goes to the master, and the next forward casts it."""
    with outcore.initialize(_model(), _cfg("nvme", "cpu", tmp_path)) as engine:
        _losses(engine, 2)
        x = torch.randn(4, 64).to(engine.device)
        with engine.gathered_parameters(modify=True):
            for p in engine.module.parameters():
                p.data.zero_()
        assert torch.count_nonzero(engine(x)).item() == 0
        engine.module[4].bias.data.fill_(0.5)  # a write outside the context, as on a model
        assert torch.equal(engine(x).float(), torch.full((4, 8), 0.5, device=engine.device))


def test_a_second_engine_that_freezes_a_param_gives_it_a_stored_shard(tmp_path: Path) -> None:
    """Frozen by the user before a second engine takes the model, a parameter whose copy was
    cast gets a real bf16 shard on NVMe (it has no master any more); values are kept."""
    model = _model()
    with outcore.initialize(model, _cfg("nvme", "cpu", tmp_path)) as first:
        _losses(first, 1)
        before = first.module[0].weight.detach().clone()
    model[0].requires_grad_(False)
    with outcore.initialize(model, _cfg("nvme", "cpu", tmp_path)) as second:
        sp = next(sp for sp in second.params if sp.name == "0.weight")
        assert isinstance(sp.compute_shard, NvmeShard) and sp.master_shard is None
        assert torch.equal(second.module[0].weight.detach(), before)
        _losses(second, 1)


def _two_rank_losses(swap: str, params: str) -> list[float]:
    with outcore.initialize(_model(), _cfg(params, "cpu", Path(swap))) as engine:
        return _losses(engine, 3)


def test_two_ranks_cast_their_shards_into_the_gather_buffer(tmp_path: Path) -> None:
    """At two ranks each rank casts its masters' shards into the all-gather buffer: the
    losses equal those of parameters in host memory."""
    derived = run_world(_two_rank_losses, 2, str(tmp_path), "nvme")
    host = run_world(_two_rank_losses, 2, str(tmp_path), "cpu")
    assert derived == host


@pytest.mark.cpu_only("forces the accelerator's staged path on the CPU device")
def test_on_an_accelerator_a_cast_from_a_host_master_is_staged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetch for an accelerator casts a host master into a page-locked host tensor and
    copies that (half the master's bytes) on the copy stream; a master in device memory is
    cast in place (group.py's [Note: disk reads reach the device through host memory]). The
    staged path, forced on the CPU, trains exactly as the direct one."""
    from outcore.device.accel import Accelerator
    from outcore.zero.group import GatherGroup

    with outcore.initialize(_model(), _cfg("nvme", "cpu", tmp_path)) as engine:
        reference = _losses(engine)
        group = engine.groups[0]
        shard = group.params[0].compute_shard
        assert isinstance(shard, CastShard) and shard.master_on_host
        assert not group._stages(shard)  # the CPU device stages nothing
        monkeypatch.setattr(Accelerator, "is_cuda", property(lambda self: True))
        assert group._stages(shard)
        monkeypatch.undo()

    staged: list[bool] = []
    decide = GatherGroup._stages

    def forced(self: GatherGroup, shard: object) -> bool:
        out = isinstance(shard, CastShard) or decide(self, shard)
        staged.append(out)
        return out

    monkeypatch.setattr(GatherGroup, "_stages", forced)
    with outcore.initialize(_model(), _cfg("nvme", "cpu", tmp_path)) as engine:
        assert _losses(engine) == reference
    assert staged and all(staged)


@pytest.mark.filterwarnings("ignore:zero.prefetch_bytes=1 is smaller")
def test_the_budget_decides_how_often_a_copy_is_cast(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """build.py's [Note: a budget for parameters on NVMe follows the free memory]: a tight
    budget casts
    copies twice a step (forward, and again for backward, all but the last layer's, which
    backward uses first); one that holds the model
    fetches nothing: its groups stay gathered from forward into backward and through the
    step, which refreshes them from the masters once (schedule.py's [Note: carrying the head
    across iterations]). At its default value the budget is what the free memory affords."""
    casts: list[CastShard] = []
    load = CastShard.load
    monkeypatch.setattr(CastShard, "load", lambda self, out: casts.append(self) or load(self, out))

    def casts_per_step(**zero: int) -> tuple[int, int]:
        cfg = _cfg("nvme", "cpu", tmp_path).with_overrides(
            {"zero": {"persistence_threshold_bytes": 0, **zero}})
        with outcore.initialize(_model(), cfg) as engine:
            _losses(engine, 2)  # the first iteration traces the order
            casts.clear()
            _losses(engine, 1)
            return len(casts), len(engine.params)

    roomy, n = casts_per_step(prefetch_bytes=1 << 30)
    tight, _ = casts_per_step(prefetch_bytes=1)
    assert roomy == 0 and n < tight <= 2 * n  # (the last layer of forward stays for backward)

    monkeypatch.setattr(placement, "device_free", lambda device: 20 << 30)
    with outcore.initialize(_model(), _cfg("nvme", "cpu", tmp_path)) as engine:
        assert engine.memory_report()["schedule"]["prefetch_bytes"] == prefetch_share(20 << 30)
    with outcore.initialize(_model(), _cfg("nvme", "nvme", tmp_path)) as engine:  # reads disk
        schedule = engine.memory_report()["schedule"]  # copies kept in memory take their share
        assert schedule["prefetch_bytes"] + schedule["resident_bytes"] == prefetch_share(20 << 30)
    with outcore.initialize(_model(), _cfg("cpu", "nvme", tmp_path)) as engine:
        assert engine.memory_report()["schedule"]["prefetch_bytes"] == 128 << 20
