"""Swap folders left behind by runs that were killed (SIGKILL, power loss) are removed.

[Note: what counts as ours and dead]
A run's swap lives in ``<nvme_path>/outcore-<pid>-<8 hex>/rank<r>.swap``. A killed process
cannot delete it, so the next run on the same ``nvme_path`` does, but only a folder that
(1) has exactly that name shape, (2) holds nothing but ``rank<r>.swap`` files, and (3) names a
pid that is no longer running on this machine (or, on a shared filesystem, was written by a
process that is not ours to judge: folders whose pid is alive are always left alone). Anything
else in ``nvme_path`` is never touched.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger("outcore")

_FOLDER = re.compile(r"^outcore-(\d+)-[0-9a-f]{8}$")
_FILE = re.compile(r"^rank\d+\.swap$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
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
        if not m or not folder.is_dir() or folder.is_symlink() or _alive(int(m.group(1))):
            continue
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        if not all(_FILE.match(n) and (folder / n).is_file() for n in names):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
        log.warning("outcore: removed %s, the swap of a run that was killed", folder)
    return removed
