"""Stale swap folders (stale.py's [Note: what counts as ours and dead]): under ``nvme_path``
only a folder named ``outcore-<pid>-<8 hex>``, holding nothing but ``rank<r>.swap`` files,
whose pid is not running here and none of whose files a live process keeps ``flock``ed, is
removed (and said so); a live pid's folder, a locked file, a foreign file, another name, a
symlink, and an empty folder younger than a minute are kept."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outcore.offload.stale import pid_alive, remove_stale_swap


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not pid_alive(proc.pid)
    return proc.pid


def _run_folder(root: Path, pid: int, tag: str = "0123abcd", ranks: tuple[int, ...] = (0,)
                ) -> Path:
    folder = root / f"outcore-{pid}-{tag}"
    folder.mkdir()
    for r in ranks:
        (folder / f"rank{r}.swap").write_bytes(b"\0" * 4096)
    return folder


@pytest.fixture
def locked(tmp_path: Path, dead_pid: int) -> Iterator[Path]:
    """A dead pid's folder whose swap file a live run (this process) keeps locked."""
    folder = _run_folder(tmp_path, dead_pid, "feedbeef")
    fd = os.open(folder / "rank0.swap", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    yield folder
    os.close(fd)


def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    assert pid_alive(1)  # init: exists, whoever owns it


def test_a_dead_runs_folder_is_removed_and_reported(
        tmp_path: Path, dead_pid: int, caplog: pytest.LogCaptureFixture) -> None:
    folder = _run_folder(tmp_path, dead_pid, ranks=(0, 1, 12))
    with caplog.at_level(logging.WARNING, logger="outcore"):
        assert remove_stale_swap(tmp_path) == [folder]
    assert not folder.exists()
    assert f"removed {folder}" in caplog.text


def test_a_live_pids_folder_is_kept(tmp_path: Path) -> None:
    folder = _run_folder(tmp_path, os.getpid())
    assert remove_stale_swap(tmp_path) == []
    assert (folder / "rank0.swap").is_file()


def test_a_locked_swap_file_is_kept_though_its_pid_looks_dead(locked: Path) -> None:
    assert remove_stale_swap(locked.parent) == []
    assert (locked / "rank0.swap").is_file()


def test_the_lock_is_dropped_when_the_run_ends(tmp_path: Path, dead_pid: int) -> None:
    folder = _run_folder(tmp_path, dead_pid)
    fd = os.open(folder / "rank0.swap", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert remove_stale_swap(tmp_path) == []
    os.close(fd)  # what the kernel does for a run that died
    assert remove_stale_swap(tmp_path) == [folder]


def test_only_dead_folders_go_among_many(tmp_path: Path, dead_pid: int) -> None:
    dead = _run_folder(tmp_path, dead_pid, "aaaaaaaa")
    live = _run_folder(tmp_path, os.getpid(), "bbbbbbbb")
    assert remove_stale_swap(tmp_path) == [dead]
    assert live.is_dir() and not dead.exists()


def test_a_folder_holding_anything_else_is_never_touched(tmp_path: Path, dead_pid: int) -> None:
    folder = _run_folder(tmp_path, dead_pid)
    (folder / "notes.txt").write_text("mine")
    nested = _run_folder(tmp_path, dead_pid, "cccccccc")
    (nested / "rank1.swap").mkdir()  # a folder named like a swap file
    assert remove_stale_swap(tmp_path) == []
    assert (folder / "notes.txt").read_text() == "mine"
    assert (nested / "rank1.swap").is_dir()


@pytest.mark.parametrize("name", ["outcore-{pid}-0123ABCD", "outcore-{pid}-0123abc",
                                  "outcore-{pid}", "xoutcore-{pid}-0123abcd", "run-{pid}"])
def test_other_names_are_never_touched(tmp_path: Path, dead_pid: int, name: str) -> None:
    folder = tmp_path / name.format(pid=dead_pid)
    folder.mkdir()
    (folder / "rank0.swap").write_bytes(b"x")
    assert remove_stale_swap(tmp_path) == []
    assert (folder / "rank0.swap").is_file()


def test_a_file_or_symlink_with_the_name_shape_is_never_touched(
        tmp_path: Path, dead_pid: int) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "rank0.swap").write_bytes(b"x")
    link = tmp_path / f"outcore-{dead_pid}-11111111"
    link.symlink_to(target, target_is_directory=True)
    plain = tmp_path / f"outcore-{dead_pid}-22222222"
    plain.write_text("a file")
    assert remove_stale_swap(tmp_path) == []
    assert (target / "rank0.swap").is_file() and link.is_symlink() and plain.is_file()


def test_an_empty_folder_is_kept_for_a_minute_then_removed(
        tmp_path: Path, dead_pid: int) -> None:
    folder = _run_folder(tmp_path, dead_pid, ranks=())
    assert remove_stale_swap(tmp_path) == []
    assert folder.is_dir()
    old = time.time() - 120
    os.utime(folder, (old, old))
    assert remove_stale_swap(tmp_path) == [folder]
    assert not folder.exists()


def test_a_missing_root_removes_nothing(tmp_path: Path) -> None:
    assert remove_stale_swap(tmp_path / "nowhere") == []
