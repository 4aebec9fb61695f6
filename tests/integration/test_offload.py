"""Offload tiers: identical results for none / cpu / nvme, bytes really on disk, clean-up."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import outcore
from outcore.device.accel import default_device
from outcore.offload.storage import NvmeShard
from outcore.zero.registry import managed
from tests.common import ADAMW, VOCAB, Quirky, resident_bytes
from tests.distributed import run_world

PLACEMENTS = [("none", "none"), ("cpu", "cpu"), ("nvme", "none"), ("none", "nvme"),
              ("nvme", "nvme")]


def _losses(params: str, optimizer: str, swap: str, dtype: str, steps: int) -> dict:
    cfg = outcore.Config.from_dict({
        "dtype": dtype, "optimizer": ADAMW,
        "zero": {"persistence_threshold_bytes": 0},
        # a small host budget forces the streamed optimizer through several sub-groups
        "offload": {"params": params, "optimizer": optimizer, "nvme_path": swap,
                    "host_buffer_bytes": 64 * 1024, "io_block_bytes": 16 * 1024},
    })
    torch.manual_seed(0)
    with outcore.init(cfg):
        model = Quirky()
    engine = outcore.initialize(model, cfg)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for step in range(steps):
        idx = torch.randint(0, VOCAB, (2, 8), generator=gen).to(engine.device)
        loss = engine(idx, idx.roll(1, 1), step % 2 == 0)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    report = engine.memory_report()
    store = engine.rt._nvme
    swap_files = sorted(str(p) for p in Path(store.folder).iterdir()) if store else []
    engine.close()
    # the I/O pool and the optimizer's staging buffers are given back, and the ledger says so
    assert engine.rt.ledger.snapshot().get("host.io_buffers", 0) == 0
    # each rank owns one run folder; after close nothing of this rank's remains
    left = sorted(str(p) for p in Path(store.folder).rglob("*")) if store else []
    if store is not None and Path(store.folder).exists():
        left.append(str(store.folder))
    return {"losses": losses, "nvme": report["nvme"], "device": report["device"],
            "host": report["host"], "swap_files": swap_files, "left_after_close": left}


@pytest.mark.parametrize("world", [1, 2])
def test_every_placement_gives_identical_fp32_losses(world: int, tmp_path: Path) -> None:
    results = {}
    for params, optimizer in PLACEMENTS:
        swap = tmp_path / f"{params}-{optimizer}"
        swap.mkdir()
        results[(params, optimizer)] = run_world(_losses, world, params, optimizer, str(swap),
                                                 "fp32", 4)
    # bit-identical where the optimizer computes on the same device; on a GPU the host's
    # optimizer (state in host memory or on NVMe) rounds otherwise than the device's kernels
    on_host = default_device().type == "cpu"
    bases = {where: results[key][0]["losses"] for where, key in
             (("device", ("none", "none")), ("host", ("cpu", "cpu")))}
    for key, per_rank in results.items():
        base = bases["device" if key[1] == "none" or on_host else "host"]
        for r in per_rank:
            assert r["losses"] == base, f"{key}: {r['losses']} != {base}"
            assert r["losses"] == pytest.approx(bases["device"], rel=1e-5), key
            assert r["left_after_close"] == [], f"{key}: left behind {r['left_after_close']}"
            on_disk = "nvme" in key
            # the swap file exists wherever NVMe is placed; bytes are in it only for state on
            # NVMe: with masters in memory the params' copies are cast from them (CastShard)
            assert (r["nvme"] > 0) == (key[1] == "nvme"), key
            assert (len(r["swap_files"]) == 1) == on_disk, key


def test_bf16_placements_agree(tmp_path: Path) -> None:
    a = run_world(_losses, 2, "none", "none", str(tmp_path), "bf16", 3)[0]["losses"]
    b = run_world(_losses, 2, "nvme", "nvme", str(tmp_path), "bf16", 3)[0]["losses"]
    assert a == b


def test_swap_file_holds_the_shards(tmp_path: Path) -> None:
    """Read a master shard back from the swap file itself and compare with the engine's view."""
    # every copy on disk, not kept in memory (zero/build.py's keep_resident)
    cfg = outcore.Config(dtype="bf16", offload={"params": "nvme", "optimizer": "nvme",
                                                "nvme_path": str(tmp_path)},
                         zero={"resident_copies": False})
    torch.manual_seed(0)
    with outcore.init(cfg):
        model = Quirky()
    engine = outcore.initialize(model, cfg)
    sp = next(p for p in engine.params if p.name == "blocks.0.fc1.weight")
    assert isinstance(sp.master_shard, NvmeShard) and isinstance(sp.compute_shard, NvmeShard)
    store = engine.rt.nvme
    swap = Path(store.path)
    assert swap.stat().st_mode & 0o777 == 0o600
    assert swap.parent.stat().st_mode & 0o777 == 0o700
    with open(swap, "rb") as f:
        f.seek(sp.master_shard.extent.offset)
        raw = f.read(sp.master_shard.nbytes)
    on_disk = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    with engine.gathered_parameters([model.blocks[0].fc1.weight]):
        expected = model.blocks[0].fc1.weight.data.reshape(-1).cpu()
    assert torch.equal(on_disk, expected)
    # and the bf16 training copy sits in its own extent
    with open(swap, "rb") as f:
        f.seek(sp.compute_shard.extent.offset)
        raw = f.read(sp.compute_shard.nbytes)
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.bfloat16),
                       expected.to(torch.bfloat16))
    engine.close()
    assert not swap.exists() and not swap.parent.exists()
    assert tmp_path.exists()


@pytest.mark.cpu_only("a CUDA run's pool is pinned, and pinned pages are never given back")
def test_io_pool_keeps_no_pages_once_the_engine_is_built(tmp_path: Path) -> None:
    """Building the model, and each checkpoint, stage every shard through the I/O pool;
    after them its pages are given back, and a later transfer borrows a buffer as before
    (buffers.py's [Note: a pool idle in training keeps no pages])."""
    # no group kept gathered: nothing is re-read right after a checkpoint load, so no buffer
    # is lent when the pages go (a lent one keeps its pages: test_tiers_buffers.py)
    cfg = outcore.Config(dtype="bf16", optimizer=ADAMW, zero={"persistence_threshold_bytes": 0},
                         offload={"params": "nvme", "optimizer": "nvme",
                                  "nvme_path": str(tmp_path), "host_buffer_bytes": 16 << 20,
                                  "io_block_bytes": 1 << 20})
    torch.manual_seed(0)
    with outcore.init(cfg):
        model = Quirky()
    pool = next(managed(p) for p in model.parameters()).rt.nvme.pool
    assert pool.peak_in_use > 0 and sum(resident_bytes(b) for b in pool._buffers) > 0
    engine = outcore.initialize(model, cfg)
    assert sum(resident_bytes(b) for b in pool._buffers) == 0
    idx = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    idx = idx.to(engine.device)
    staged, pool.peak_in_use = engine.rt.nvme.bytes_staged, 0
    losses = []
    for _ in range(3):
        loss = engine(idx, idx.roll(1, 1), True)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # this model's shards have ragged tails, so training borrows the pool again, and pages
    # come back for the buffers it borrowed only
    assert engine.rt.nvme.bytes_staged > staged and pool.peak_in_use > 0
    assert 0 < sum(resident_bytes(b) for b in pool._buffers) <= (
        pool.peak_in_use * pool.buffer_bytes)
    assert losses[-1] < losses[0]
    # a checkpoint stages every shard through the pool again, and gives the pages back after
    for act in (engine.save_checkpoint, engine.load_checkpoint):
        before = engine.rt.nvme.bytes_staged
        act(tmp_path / "ckpt")
        assert engine.rt.nvme.bytes_staged > before, act
        assert sum(resident_bytes(b) for b in pool._buffers) == 0, act
    engine.close()


def test_swap_files_removed_when_training_raises(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("not ours")
    cfg = outcore.Config(dtype="fp32", offload={"params": "nvme", "optimizer": "nvme",
                                                "nvme_path": str(tmp_path)})
    with pytest.raises(ZeroDivisionError), outcore.initialize(Quirky(), cfg) as engine:
        zeros = torch.zeros(1, 4, dtype=torch.long, device=engine.device)
        engine(zeros, zeros)
        raise ZeroDivisionError
    assert sorted(os.listdir(tmp_path)) == ["keep.txt"]


def test_missing_nvme_path_is_a_clear_error(tmp_path: Path) -> None:
    target = tmp_path / "file-not-dir"
    target.write_text("x")
    cfg = outcore.Config(dtype="fp32", offload={"params": "nvme", "nvme_path": str(target)})
    with pytest.raises(outcore.StorageError, match="file-not-dir"):
        outcore.initialize(Quirky(), cfg)


@pytest.mark.parametrize("opt", [{"type": "adamw", "lr": 1e-2, "weight_decay": 0.1},
                                 {"type": "sgd", "lr": 0.1, "momentum": 0.9}])
def test_streamed_optimizer_slices_large_shards_exactly(opt: dict, tmp_path: Path) -> None:
    """A 64 KiB host budget gives the optimizer its smallest sub-groups (2048 elements);
    10,000-element shards are cut into slices, and the result is bit-identical to the
    in-memory optimizer."""

    def run(optimizer: str) -> list[float]:
        cfg = outcore.Config.from_dict({
            "dtype": "bf16", "optimizer": opt,
            "offload": {"optimizer": optimizer, "params": optimizer, "nvme_path": str(tmp_path),
                        "host_buffer_bytes": 64 * 1024},
        })
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Tanh(),
                                    torch.nn.Linear(100, 3))
        engine = outcore.initialize(model, cfg)
        x = torch.randn(8, 100).to(engine.device)
        losses = []
        for _ in range(4):
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.close()
        return losses

    assert run("nvme") == run("none")
