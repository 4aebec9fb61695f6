"""Running out of space on a real (small) filesystem: clear errors, nothing lost."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import outcore
from tests.distributed import run_world


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))


def test_swap_that_does_not_fit_is_a_clear_error_and_leaves_nothing(small_fs: Path) -> None:
    (small_fs / "keep.txt").write_text("someone else's file")
    # 2.1M parameters x 14 bytes (fp32 master and moments; the bf16 copies are cast from the
    # masters, stored nowhere) = 29.4 MB of states on NVMe, plus what ext4 keeps: too much
    # once most of the 48 MiB is taken by a filler file
    with open(small_fs / "filler", "wb") as f:
        f.write(b"\0" * (30 << 20))
    cfg = outcore.Config(dtype="bf16", offload={"params": "nvme", "optimizer": "nvme",
                                                "nvme_path": str(small_fs)})
    with pytest.raises(outcore.StorageError) as err:
        outcore.initialize(_model(), cfg)
    # the whole need, not the piece the swap file grew by when it failed (a few MiB)
    assert f"in {small_fs}: the model states kept there need 29.4 MB" in str(err.value)
    assert sorted(os.listdir(small_fs)) == ["filler", "keep.txt", "lost+found"]


def _one_rank_short(big: str, small: str) -> str:
    """Each rank its own swap disk (as on several nodes); rank 1's is too small."""
    rank = int(os.environ["RANK"])
    cfg = {"dtype": "bf16", "offload": {"params": "nvme", "optimizer": "nvme",
                                        "nvme_path": small if rank == 1 else big}}
    try:
        outcore.initialize(_model(), cfg)
    except outcore.StorageError as e:
        return str(e)
    return "built"


def test_one_ranks_swap_disk_too_small_is_refused_on_every_rank(small_fs: Path,
                                                                 tmp_path: Path) -> None:
    """The short rank left the build while the other waited in its collectives: gloo
    aborted that one (SIGABRT), its swap file left behind."""
    with open(small_fs / "filler", "wb") as f:
        f.write(b"\0" * (30 << 20))
    big = tmp_path / "big"
    big.mkdir()
    first, second = run_world(_one_rank_short, 2, str(big), str(small_fs))
    assert "refused on another rank" in first
    assert f"{small_fs} on rank 1: the model states kept there need" in second
    assert os.listdir(big) == [] and sorted(os.listdir(small_fs)) == ["filler", "lost+found"]


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


def _sharing(path: str) -> str:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # as torchrun sets it: both ranks on this host
    try:
        outcore.initialize(_model(), {"dtype": "bf16", "offload": {
            "params": "nvme", "optimizer": "nvme", "nvme_path": path}})
    except outcore.StorageError as e:
        return str(e)
    return "built"


def test_ranks_sharing_a_swap_disk_are_checked_together(small_fs: Path) -> None:
    """Each rank's half (14.7 MB) fits the free 18 MB; both together do not."""
    with open(small_fs / "filler", "wb") as f:
        f.write(b"\0" * (30 << 20))
    for message in run_world(_sharing, 2, str(small_fs)):
        assert "need 29.4 MB (14.7 MB for each of the 2 ranks on this host)" in message
    assert sorted(os.listdir(small_fs)) == ["filler", "lost+found"]


def test_outcore_train_refuses_a_swap_disk_too_small_before_building(small_fs: Path,
                                                                     tmp_path: Path) -> None:
    """``outcore train`` builds its model under ``outcore.init``, which no engine's check
    saw: the build failed in the middle, naming a piece of a few MiB."""
    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 2000)
    proc = subprocess.run(
        [sys.executable, "-m", "outcore", "train", "--model", "small", "--data", str(data),
         "--steps", "1", "--offload", "nvme", "--out", str(small_fs / "run")],
        capture_output=True, text=True, timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr
    assert last.startswith("outcore train: error: not enough free space for the NVMe swap in "
                           f"{small_fs / 'run' / 'swap'}: the model states kept there need"), last
    assert sorted(os.listdir(small_fs)) == ["lost+found"]
