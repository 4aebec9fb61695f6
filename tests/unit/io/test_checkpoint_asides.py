"""Copies of checkpoints that a save killed after its renames left aside, where nothing saves
into their paths again (io/publish.py's [Note: what a kill between the renames leaves])."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.io.publish import ASIDE
from tests.unit.io.test_checkpoint_user_cases import _trained


def test_a_save_deletes_the_stale_copies_aside_of_other_checkpoints(tmp_path: Path) -> None:
    """The last save of a run (or a step's folder) killed after both renames left the old
    copy beside the new one for good: only a save into that very path deleted it. A save
    into any path of the folder now deletes those whose checkpoint is published; the only
    copy of a missing checkpoint, and a folder of the user's, stay."""
    torch.manual_seed(0)
    engine = _trained(tmp_path, nn.Linear(4, 4))
    root = tmp_path / "ckpts"
    engine.save_checkpoint(root / "step-1")
    engine.save_checkpoint(root / "step-2")
    stale = root / f"step-1{ASIDE}0000beef"
    shutil.copytree(root / "step-1", stale)  # killed after both renames of a save to step-1
    only = root / f"step-2{ASIDE}0000dead"
    os.replace(root / "step-2", only)  # killed between the renames: the only copy of step-2
    user = root / f"notes{ASIDE}keep"
    user.mkdir()
    (user / "todo.txt").write_text("mine")
    assert outcore.latest_checkpoint(root) == only
    engine.save_checkpoint(root / "step-3")
    assert sorted(p.name for p in root.iterdir()) == [
        ".outcore-lock", "notes.replaced-keep", "step-1", "step-2.replaced-0000dead", "step-3"]
    assert (user / "todo.txt").read_text() == "mine"
    engine.load_checkpoint(only)  # still whole
    engine.close()


@pytest.mark.parametrize("whole", [False, True])
def test_a_copy_aside_holding_other_files_keeps_them(tmp_path: Path, whole: bool) -> None:
    """Only outcore's files go, with a warning, as for the save into the path itself; and
    nothing where the save owns its own folder whole (``replace_folder=True``): that says
    nothing of its siblings, and such a copy lost the user's file with no word."""
    torch.manual_seed(0)
    engine = _trained(tmp_path, nn.Linear(4, 4))
    engine.save_checkpoint(tmp_path / "a")
    stale = tmp_path / f"a{ASIDE}0000beef"
    shutil.copytree(tmp_path / "a", stale)
    (stale / "notes.txt").write_text("mine")
    if whole:
        engine.save_checkpoint(tmp_path / "b", replace_folder=True)
        assert (stale / "manifest.json").is_file()
    else:
        with pytest.warns(UserWarning, match=r"left .*a\.replaced-0000beef: it holds files"):
            engine.save_checkpoint(tmp_path / "b")
        assert [p.name for p in stale.iterdir()] == ["notes.txt"]
    assert (stale / "notes.txt").read_text() == "mine"
    engine.close()


def test_loading_a_root_of_checkpoints_names_them(tmp_path: Path) -> None:
    """DeepSpeed's load_checkpoint(load_dir, tag) habit: the root was refused as "not a
    complete checkpoint" with no word of the checkpoints it holds."""
    torch.manual_seed(0)
    engine = _trained(tmp_path, nn.Linear(4, 4))
    root = tmp_path / "ckpts"
    engine.save_checkpoint(root / "step-1")
    with pytest.raises(outcore.StorageError, match=r"not a complete checkpoint .*it holds "
                       r"checkpoints \(step-1\): give one of them, such as "
                       r"outcore.latest_checkpoint"):
        engine.load_checkpoint(root)
    engine.load_checkpoint(outcore.latest_checkpoint(root))
    engine.close()
