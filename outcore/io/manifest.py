"""A checkpoint's manifest and files: reading and checking them, and finding the latest
complete checkpoint under a root (checkpoint.py writes them)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from outcore.errors import CorruptCheckpointError, StorageError
from outcore.io import safetensors_stream as sts
from outcore.io.client_state import decode
from outcore.io.publish import ASIDE, MANIFEST, PARTIAL, asides
from outcore.io.safetensors_stream import CHECKSUM

FORMAT, VERSION = "outcore-checkpoint", 1


def rank_file(rank: int, world: int) -> str:
    return f"rank{rank:05d}-of-{world:05d}.safetensors"  # rank's file of a world-rank save


def manifest_checksum(man: dict) -> str:
    """Checksum of the manifest's own content (all keys but this one), so a flipped digit in
    a shape, step or learning rate is caught like a flipped bit in a tensor."""
    body = {k: v for k, v in man.items() if k != "manifest_checksum"}
    return sts.checksum_hex(sts.checksum_update(0, json.dumps(body, sort_keys=True).encode()))


def _holds_checkpoints(folder: Path) -> str:
    """What a refusal adds where ``folder`` is a root of checkpoints, not one (DeepSpeed's
    ``load_checkpoint(load_dir, tag)`` habit; ``outcore consolidate`` given the root)."""
    try:
        inside = sorted((p.name for p in folder.iterdir() if (p / MANIFEST).is_file()),
                        key=lambda name: (len(name), name))  # step-2 before step-10
    except OSError:
        return ""
    if not inside:
        return ""
    return (f"; it holds checkpoints ({', '.join(inside[-3:])}): give one of them, such as "
            f"outcore.latest_checkpoint({str(folder)!r}); a checkpoint is its folder, with no "
            "tag beside it")


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder, checked for format and version."""
    mf = Path(folder) / MANIFEST
    try:
        man = json.loads(mf.read_text())
    except FileNotFoundError:
        raise StorageError(f"{folder} is not a complete checkpoint (no {MANIFEST})"
                           + _holds_checkpoints(Path(folder))) from None
    except (OSError, ValueError) as e:
        raise StorageError(f"{mf} is unreadable or not JSON: {e}") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise StorageError(f"{mf} is not an outcore checkpoint manifest")
    if man.get("version") != VERSION:
        raise StorageError(f"{mf}: format version {man.get('version')}, this outcore reads "
                           f"version {VERSION}")
    if man.get("checksum") != CHECKSUM:
        raise StorageError(f"{mf}: unknown checksum algorithm {man.get('checksum')!r}")
    if man.get("manifest_checksum") != manifest_checksum(man):
        raise CorruptCheckpointError(f"{mf} is corrupt: its content does not match its checksum")
    return man


def read_client_state(folder: Path) -> dict[str, Any]:
    """The ``client_state`` a checkpoint folder's manifest records, as it was saved
    (client_state.py's [Note: what JSON would change on the way])."""
    return decode(read_manifest(folder).get("client_state") or {})


def check_file(folder: Path, man: dict, name: str, full: bool = True) -> None:
    """Check checkpoint file ``name`` against the manifest ``man``: its size always, with
    ``full`` also its checksum (reads the whole file once). ``StorageError`` names the file."""
    rec, path = man["files"].get(name), folder / name
    if rec is None or not path.is_file():
        raise CorruptCheckpointError(f"checkpoint file {path} is missing")
    size = path.stat().st_size
    if size != rec["bytes"]:
        raise CorruptCheckpointError(f"checkpoint file {path} has {size} bytes, the manifest says "
                           f"{rec['bytes']}: truncated or replaced")
    if full and (digest := sts.file_checksum(path)[1]) != rec["checksum"]:
        raise CorruptCheckpointError(f"checkpoint file {path} is corrupt: {CHECKSUM} {digest}, the "
                           f"manifest says {rec['checksum']}")


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest global step among ``root``'s subfolders.

    Complete means: a valid manifest and every rank file present at its recorded size
    (checksums are verified by ``load``, not here, so this stays cheap). A checkpoint that a
    save killed between its renames left aside counts as its folder (publish.py's notes).
    """
    root, best = Path(root), None
    if not root.is_dir():
        return None
    for child in sorted(root.iterdir()):
        if not child.is_dir() or child.name.endswith(PARTIAL):
            continue
        if ASIDE in child.name:  # a save killed between its renames moved it aside
            base = child.with_name(child.name[:child.name.rindex(ASIDE)])
            if base.exists() or asides(base)[0] != child:
                continue  # (publish.py's [Note: what a kill between the renames leaves])
        try:
            man = read_manifest(child)
            for r in range(man["world_size"]):
                check_file(child, man, rank_file(r, man["world_size"]), full=False)
            key = (int(man["global_steps"]), child.name)
        except (StorageError, KeyError, TypeError, ValueError):
            continue
        if best is None or key > best[0]:
            best = (key, child)
    return None if best is None else best[1]


def align_empty_groups(man: dict[str, Any], groups: list[dict[str, Any]],
                       stored: Callable[[int, dict[str, Any]], dict[str, Any]]) -> None:
    """Give ``man`` (read) an entry for each of the engine's ``groups`` that holds no
    parameter where it has none: ``OutcoreTrainer`` dropped Trainer's empty group (a LoRA
    run's, whose every parameter decays) before 2026-11-29, and keeps it now, as plain
    Trainer's optimizer and scheduler state have it. The entry is the engine's own
    settings (``stored``) and no members."""
    empty = [i for i, g in enumerate(groups) if not g["params"]]
    if not empty or len(man["param_groups"]) != len(groups) - len(empty):
        return
    man["param_groups"] = with_empty(man["param_groups"], empty, lambda i: stored(i, groups[i]))
    if man.get("group_members") is not None:
        man["group_members"] = with_empty(man["group_members"], empty, lambda i: [])


def with_empty(items: list[Any], empty: list[int], make: Callable[[int], Any]) -> list[Any]:
    """``items``, one per group but the empty groups at the (ascending) indices ``empty``,
    with ``make(i)`` standing in at each of those: an older checkpoint's list, as long as the
    engine's groups now (``align_empty_groups``; OutcoreTrainer's optimizer.pt and
    scheduler.pt)."""
    out = list(items)
    for i in empty:
        out.insert(i, make(i))
    return out

