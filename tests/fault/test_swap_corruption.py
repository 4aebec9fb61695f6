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
                         zero={"overlap_optimizer": False})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    engine = outcore.initialize(model, cfg)
    x = torch.randn(8, 256)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()  # the optimizer wrote slices: their digests must verify too
    sp = engine.params[0]
    stored = sp.compute if target == "params" else sp.master
    _flip(Path(engine.rt.nvme.path), stored.extent.offset + 1000)
    with pytest.raises(outcore.StorageError, match=r"checksum mismatch in .*rank0\.swap at "
                                                   r"offset \d+"):
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    engine.close()
    assert not list(tmp_path.iterdir())  # cleaned up after the error too


def test_untouched_swap_file_verifies_every_step(tmp_path: Path) -> None:
    cfg = outcore.Config(dtype="bf16", offload={"params": "nvme", "optimizer": "nvme",
                                                "nvme_path": str(tmp_path),
                                                "host_buffer_bytes": 64 * 1024})
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 2))
    with outcore.initialize(model, cfg) as engine:
        for _ in range(3):
            engine.backward(engine(torch.randn(4, 300)).float().sum())
            engine.step()
