"""Putting a finished checkpoint folder in the place of an old one, and what a crash there
leaves behind.

[Note: replacing a folder]
The old folder is renamed aside (``<path>.replaced-<hex>``) first, the finished one renamed
into place, and only then is the old one deleted, so a crash leaves either checkpoint whole.
Only the files a checkpoint consists of are deleted from the old folder (its rank files and
manifest, and the files its manifest lists as copied in, ``files=`` of ``save_checkpoint``),
and a folder still holding others (someone else's notes, a ``config.json`` a user put there)
is left with a warning, unless the caller owns the whole folder: under ``OutcoreTrainer``
the ``checkpoint-N`` folders are the Trainer's, with its own files in them, and a second run
into the same ``output_dir`` replaces them whole, as the Trainer's own rotation deletes them.
Once the new folder is in place the save has succeeded: a failure to delete the old one (a
read-only folder) is a warning naming it, not an error, as the new checkpoint is published.

[Note: what a kill between the renames leaves]
Killed between the two renames, a save leaves no ``<path>`` and the old checkpoint aside,
whole; killed after them, before the old one is deleted, it leaves both. ``latest_checkpoint``
takes an aside folder whose ``<path>`` is missing as that checkpoint, so a resume finds it,
and the next save into ``<path>`` first puts it back (``settle``), or deletes a leftover copy
aside of a published one. A run's last save, or a step's folder, is never saved into again:
so any save into the same folder also deletes the copies aside of its other published
checkpoints (``settle_others``), the folder being this job's alone while it saves there
(guard/lock.py). A copy aside whose checkpoint is missing is the only one, and is left for
``latest_checkpoint`` and the save into its own path.
"""

from __future__ import annotations

import glob
import json
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path

from outcore.errors import StorageError, user_stacklevel
from outcore.io import safetensors_stream as sts

MANIFEST = "manifest.json"
PARTIAL, ASIDE = ".partial", ".replaced-"
OWN_FILES = re.compile(  # the files outcore writes into every checkpoint folder
    r"^(rank\d{5}-of-\d{5}\.safetensors|manifest\.json)(\.tmp)?$")


def file_above(path: Path) -> Path | None:
    """The nearest existing folder above ``path``, where it is a file instead (nothing can
    be made under it); else None."""
    above = next((p for p in path.parents if p.exists()), None)
    return above if above is not None and not above.is_dir() else None


def check_replaceable(path: Path, whole: bool = False) -> None:
    """Refuse to replace anything but an empty folder or an outcore checkpoint (any folder
    where the caller owns it ``whole``), and a path under a file."""
    if (above := file_above(path)) is not None:
        raise StorageError(f"checkpoint path {path}: {above} is a file, not a folder")
    if path.exists() and not path.is_dir():
        raise StorageError(f"checkpoint path {path} exists and is not a folder")
    if not whole and path.is_dir() and any(path.iterdir()) and not (path / MANIFEST).exists():
        raise StorageError(f"{path} exists and is not an outcore checkpoint; not replacing it")


def asides(path: Path) -> list[Path]:
    """The folders a save into ``path`` moved aside and a crash left, newest first."""
    found = [p for p in path.parent.glob(glob.escape(path.name + ASIDE) + "*") if p.is_dir()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def settle(path: Path, whole: bool = False) -> None:
    """Before a save into ``path``: an old checkpoint a killed save left aside goes back to
    ``path`` if nothing is there, a copy aside of a published one goes ([Note: what a kill
    between the renames leaves]), and so do those of the folder's other checkpoints
    (``settle_others``)."""
    settle_others(path, whole)
    for aside in asides(path):
        try:
            restore = not path.exists() and (aside / MANIFEST).is_file()
        except OSError as e:  # unreadable: neither put back nor deleted, and the save goes on
            warnings.warn(f"left {aside}, a copy of {path.name} set aside by an earlier save, "
                          f"which could not be read ({e.strerror or e}); look at it before "
                          "deleting it", stacklevel=user_stacklevel())
            continue
        try:
            if restore:
                os.replace(aside, path)
            else:
                remove_ours(aside)
        except OSError as e:  # one undeletable old copy must not stop every later save
            warnings.warn(f"left {aside}, " + (
                f"the only complete copy of {path.name} (a save was killed between its "
                f"renames); moving it back failed ({e.strerror or e}): move it to {path} by "
                "hand before deleting anything" if restore else
                f"an older copy of {path.name} that could not be deleted "
                f"({e.strerror or e}); delete it by hand"), stacklevel=user_stacklevel())


_ASIDE_NAME = re.compile(r"(.+)" + re.escape(ASIDE) + r"[0-9a-f]{8}")


def settle_others(path: Path, whole: bool = False) -> None:
    """Delete the copies aside of ``path``'s sibling checkpoints that are published again,
    as the saves into their paths would ([Note: what a kill between the renames leaves]).
    Not where the caller owns ``path`` ``whole`` (``replace_folder``): that says nothing of
    its siblings, whose asides may hold files of the caller's own, as a Trainer's do."""
    if whole:
        return
    for aside in path.parent.iterdir():
        found = _ASIDE_NAME.fullmatch(aside.name)
        if found is None or found[1] == path.name:
            continue  # (path's own are settle's)
        try:
            stale = aside.is_dir() and (path.parent / found[1] / MANIFEST).is_file()
            if stale:
                remove_ours(aside)
        except OSError as e:  # as settle: one undeletable copy must not stop every save
            warnings.warn(f"left {aside}, an older copy of {found[1]} that could not be "
                          f"deleted ({e.strerror or e}); delete it by hand",
                          stacklevel=user_stacklevel())


def publish(partial: Path, path: Path, replace_folder: bool = False) -> None:
    """Move the finished folder into place; delete the old checkpoint only afterwards
    ([Note: replacing a folder])."""
    aside = None
    if path.exists():
        aside = path.with_name(path.name + ASIDE + secrets.token_hex(4))
        os.replace(path, aside)
    os.replace(partial, path)
    sts.fsync_dir(path.parent)
    if aside is None:
        return
    try:
        if replace_folder:
            shutil.rmtree(aside)
        else:
            remove_ours(aside)
    except OSError as e:
        warnings.warn(f"saved {path}; the checkpoint it replaced is left at {aside}: deleting "
                      f"it failed ({e.strerror or e})", stacklevel=user_stacklevel())


def remove_ours(folder: Path, extra: Iterable[str] = ()) -> None:
    """Delete the files a checkpoint consists of (those its manifest lists as copied in,
    and ``extra``), then the folder if nothing else is left."""
    if not folder.is_dir():
        return
    names = {*extra, *copied_files(folder)}
    for f in folder.iterdir():
        if f.is_file() and (OWN_FILES.match(f.name) or f.name in names):
            f.unlink()
    try:
        folder.rmdir()
    except OSError:
        warnings.warn(f"left {folder}: it holds files outcore did not write",
                      stacklevel=user_stacklevel())


def copied_files(folder: Path) -> list[str]:
    """The names a checkpoint's manifest lists as copied in by ``save_checkpoint(files=)``."""
    try:
        man = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return []
    # (a manifest from before files were listed: outcore train had copied its config.json)
    names = man.get("copied_files", ["config.json"]) if isinstance(man, dict) else []
    return [n for n in names if isinstance(n, str) and "/" not in n and n not in ("", ".", "..")]
