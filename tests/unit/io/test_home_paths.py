"""Paths spelled with ``~`` mean the home folder everywhere outcore takes a path, as they do
for ``nvme_path``. Found by a user-style probe: ``engine.save_checkpoint("~/ckpt")`` and
``outcore.consolidate(..., "~/w.safetensors")`` made a folder literally named ``~`` in the
working folder (one ``rm -rf ~`` away from the user's home), and a relative ``--nvme-path``
was recorded as given, so ``--resume`` from another folder put the swap elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import outcore
from outcore.app.job import same_setting


def test_checkpoint_and_consolidate_read_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    engine = outcore.initialize(model, {"dtype": "fp32"})
    saved = engine.save_checkpoint("~/ckpt/step-1")
    assert saved == home / "ckpt" / "step-1" and saved.is_dir()
    engine.load_checkpoint("~/ckpt/step-1")
    engine.close()
    out = outcore.consolidate("~/ckpt/step-1", "~/w.safetensors")
    assert out == home / "w.safetensors"
    got = safetensors.torch.load_file(out)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    plain = nn.Linear(4, 4)
    outcore.load_pretrained(plain, "~/w.safetensors")
    assert torch.equal(plain.weight, want["weight"])
    assert list(work.iterdir()) == []  # no folder named "~"


def test_a_relative_swap_folder_is_recorded_resolved(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """It does not exist yet when the run records it (the run makes it)."""
    monkeypatch.chdir(tmp_path)
    assert same_setting("nvme_path", "relswap", str(tmp_path / "relswap"))
    monkeypatch.chdir(tmp_path.parent)
    assert not same_setting("nvme_path", "relswap", str(tmp_path / "relswap"))
