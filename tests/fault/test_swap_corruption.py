"""A bit flipped in the swap file is detected on the next read, never trained on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import outcore


def _flip(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0x10]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("target", ["params", "master"])
def test_flipped_byte_in_swap_extent_is_a_storage_error(target: str, tmp_path: Path) -> None:
    cfg = outcore.Config(dtype="bf16", optimizer={"lr": 1e-3},
                         offload={"params": "nvme", "optimizer": "nvme",
                                  "nvme_path": str(tmp_path)},
                         # no prefetch: the next forward's reads must come after the flip
                         zero={"overlap_optimizer": False, "prefetch_bytes": 0})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    engine = outcore.initialize(model, cfg)
    x = torch.randn(8, 256)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()  # the optimizer wrote slices: their digests must verify too
    sp = engine.params[0]
    stored = sp.compute_shard if target == "params" else sp.master_shard
    _flip(Path(engine.rt.nvme.path), stored.extent.offset + 1000)
    with pytest.raises(outcore.StorageError, match=r"checksum mismatch in .*rank0\.swap at "
                                                   r"offset \d+"):
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    engine.close()
    assert not list(tmp_path.iterdir())  # cleaned up after the error too


def test_verify_swap_off_neither_hashes_nor_checks(tmp_path: Path, monkeypatch) -> None:
    """``offload.verify_swap: false`` trades the check for a core: no digest is computed,
    and the same flipped byte that is an error by default goes unnoticed."""
    import outcore.offload.storage as storage

    hashed = []
    real = storage.digest
    monkeypatch.setattr(storage, "digest", lambda t: hashed.append(t.nbytes) or real(t))

    def run(verify: bool) -> None:
        cfg = outcore.Config(dtype="bf16", optimizer={"lr": 1e-3},
                             offload={"params": "nvme", "optimizer": "nvme",
                                      "nvme_path": str(tmp_path), "verify_swap": verify},
                             zero={"overlap_optimizer": False, "prefetch_bytes": 0})
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
        x = torch.randn(8, 256)
        with outcore.initialize(model, cfg) as engine:
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
            _flip(Path(engine.rt.nvme.path), engine.params[0].compute_shard.extent.offset + 1000)
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()

    run(False)
    assert hashed == []
    with pytest.raises(outcore.StorageError, match="checksum mismatch"):
        run(True)
    assert hashed


def test_untouched_swap_file_verifies_every_step(tmp_path: Path) -> None:
    cfg = outcore.Config(dtype="bf16", offload={"params": "nvme", "optimizer": "nvme",
                                                "nvme_path": str(tmp_path),
                                                "host_buffer_bytes": 64 * 1024})
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 2))
    with outcore.initialize(model, cfg) as engine:
        for _ in range(3):
            engine.backward(engine(torch.randn(4, 300)).float().sum())
            engine.step()


def test_write_whose_source_is_dropped_at_once_still_lands(tmp_path: Path) -> None:
    """The I/O engine must own a write's source until the bytes are on disk, even when the
    caller drops it right after submitting (an aligned source goes to disk without a copy)."""
    from outcore.offload.aio import AioEngine
    from outcore.offload.buffers import BufferPool, aligned_empty
    from outcore.offload.nvme import NvmeStore

    n = 1 << 18  # 1 MiB of fp32, written in 64 KiB blocks by 4 threads
    with AioEngine(threads=4, block_bytes=64 * 1024) as engine, \
            NvmeStore(tmp_path, rank=0, engine=engine, pool=BufferPool(1 << 20, 1 << 16)) as store:
        writes = []
        for i in range(24):
            extent = store.allocate(n * 4)
            writes.append((extent, store.write(extent, aligned_empty(n * 4).view(torch.float32)
                                               .fill_(float(i)))))
            churn = [aligned_empty(n * 4).view(torch.float32).fill_(-1.0) for _ in range(3)]
            del churn
        for i, (extent, fut) in enumerate(writes):
            fut.result()
            back = torch.empty(n, dtype=torch.float32)
            store.read(extent, back).result()
            assert bool((back == float(i)).all()), f"write {i} landed wrong bytes"
