"""Swap folders left behind by runs that were killed (SIGKILL, power loss) are removed.

[Note: what counts as ours and dead]
A run's swap lives in ``<nvme_path>/outcore-<pid>-<8 hex>/rank<r>.swap``. A killed process
cannot delete it, nor can a run whose filesystem turned read-only under it (ext4 after disk
errors; it says so as it ends). The next run on the same ``nvme_path`` does, once the
filesystem is writable again (until then it says it cannot), but only a folder that
(1) has exactly that name shape, (2) holds nothing but ``rank<r>.swap`` files, (3) names a
pid that is not running on this machine, and (4) holds no swap file that a process keeps
locked. A pid alone proves nothing about a run in another pid namespace (a container sharing
the disk) or on another machine sharing the filesystem: its pid looks dead here. So a live run
keeps an exclusive ``flock`` on its swap file (nvme.py), which the kernel drops when the run
dies; the sweep takes those locks itself and keeps them while it deletes. An empty folder (a
run between making its folder and its file) is left alone for a minute. Anything else in
``nvme_path`` is never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import time
from pathlib import Path

log = logging.getLogger("outcore")

_FOLDER = re.compile(r"^outcore-(\d+)-[0-9a-f]{8}$")
_FILE = re.compile(r"^rank\d+\.swap$")
_EMPTY_GRACE_S = 60.0


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one owned by another user
    counts: it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _younger_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime < seconds
    except OSError:
        return True  # gone already, or not ours to look at: leave it


def _claim(file: Path, stack: contextlib.ExitStack) -> bool:
    """False if a live run holds ``file``'s lock; else True, keeping the lock until ``stack``
    closes (or holding nothing where it cannot be told: no flock here, no permission)."""
    try:
        fd = os.open(file, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return True
    stack.callback(os.close, fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        pass
    return True


def remove_stale_swap(root: str | os.PathLike[str]) -> list[Path]:
    """Delete dead runs' swap folders under ``root``; return what was removed."""
    removed: list[Path] = []
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return removed
    for folder in entries:
        m = _FOLDER.match(folder.name)
        if not m or not folder.is_dir() or folder.is_symlink() or pid_alive(int(m.group(1))):
            continue
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        if not all(_FILE.match(n) and (folder / n).is_file() for n in names):
            continue
        with contextlib.ExitStack() as held:
            if not names and _younger_than(folder, _EMPTY_GRACE_S):
                continue
            if not all(_claim(folder / n, held) for n in names):
                continue  # a live run whose pid is not visible here
            shutil.rmtree(folder, ignore_errors=True)
        if folder.exists():  # e.g. a filesystem that is read-only until it is repaired
            log.warning("outcore: could not remove %s, the swap of a run that ended without "
                        "deleting it; it is kept until that filesystem is writable", folder)
            continue
        removed.append(folder)
        log.warning("outcore: removed %s, the swap of a run that ended without deleting it",
                    folder)
    return removed
