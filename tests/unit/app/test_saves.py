"""``outcore train``'s save of a step that fails for lack of space says where the run can go
on from (app/saves.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import outcore
from outcore.app import saves
from outcore.app.data import BatchSampler


def test_a_save_on_a_full_disk_names_the_last_complete_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = outcore.initialize(torch.nn.Linear(4, 4), {"dtype": "fp32"})
    sampler = BatchSampler(torch.arange(100), 2, 8, seed=0)
    job = {"out": tmp_path, "model": "tiny"}
    state = {"seed": 0, "run": "r", "elapsed": 1.0}
    full = outcore.StorageError("not enough space for checkpoint file x: it needs 9 bytes")

    def no_room(*args: object, **kwargs: object) -> None:
        raise full

    monkeypatch.setattr(engine, "save_checkpoint", no_room)
    with pytest.raises(outcore.StorageError, match="no checkpoint of this run is complete yet"):
        saves.save(engine, sampler, job, 2, state)
    monkeypatch.undo()
    saves.save(engine, sampler, job, 2, state)
    monkeypatch.setattr(engine, "save_checkpoint", no_room)
    with pytest.raises(outcore.StorageError) as e:
        saves.save(engine, sampler, job, 4, state)
    assert str(e.value) == (f"{full}; the last complete checkpoint, {tmp_path}/checkpoints/"
                            "step-00000002, is intact: once that is mended, run the same "
                            "command with --resume")
    engine.close()
