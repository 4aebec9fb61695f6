"""Running out of space on a real (small) filesystem: clear errors, nothing lost."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import outcore


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))


def test_swap_that_does_not_fit_is_a_clear_error_and_leaves_nothing(small_fs: Path) -> None:
    (small_fs / "keep.txt").write_text("someone else's file")
    # 2.1M parameters x 16 bytes = 34 MB of states on NVMe, plus what ext4 keeps: too much
    # once most of the 48 MiB is taken by a filler file
    with open(small_fs / "filler", "wb") as f:
        f.write(b"\0" * (30 << 20))
    cfg = outcore.Config(dtype="bf16", offload={"params": "nvme", "optimizer": "nvme",
                                                "nvme_path": str(small_fs)})
    with pytest.raises(outcore.StorageError) as err:
        outcore.initialize(_model(), cfg)
    assert str(small_fs) in str(err.value) and "bytes" in str(err.value)
    assert sorted(os.listdir(small_fs)) == ["filler", "keep.txt", "lost+found"]


def test_checkpoint_folder_filling_up_keeps_the_previous_checkpoint(small_fs: Path) -> None:
    cfg = outcore.Config(dtype="fp32", optimizer={"lr": 1e-3})
    engine = outcore.initialize(_model(), cfg)  # states in memory; 2.1M params: 25 MB ckpt
    x = torch.randn(4, 1024, device=engine.device)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    first = engine.save_checkpoint(small_fs / "ckpt" / "step-1")
    with engine.gathered_parameters():
        saved = [p.data.clone() for p in engine.module.parameters()]
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    with pytest.raises(outcore.StorageError) as err:
        engine.save_checkpoint(small_fs / "ckpt" / "step-2")
    assert str(small_fs) in str(err.value)
    assert outcore.latest_checkpoint(small_fs / "ckpt") == first
    assert not (small_fs / "ckpt" / "step-2").exists()
    assert not (small_fs / "ckpt" / "step-2.partial").exists()
    engine.load_checkpoint(first)  # the previous checkpoint is intact and loads
    with engine.gathered_parameters():
        for p, q in zip(engine.module.parameters(), saved, strict=True):
            assert torch.equal(p.data, q)
    engine.close()
