"""What a checkpoint records about a base read in place, and the check a resume makes.

[Note: a checkpoint names its base instead of storing it]
Parameters read in place from the model's own files (offload/file_shard.py) are not written
into a checkpoint: it records the folder, and for each file its size, modification time and
xxh3-128 content hash; each such parameter's manifest entry names its tensor. Hashing reads
the base once, so it is done once per file per process (the first save), by rank 0, with a
progress bar for a large base. A resume compares each file the new run reads: a different
size, or a different hash, is refused, naming the file. Where size and modification time
both equal the record, the file is taken as unchanged without hashing (the quick check
``make`` and ``rsync`` use); a base copied elsewhere gets a new time and is hashed.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from tqdm import tqdm

from outcore.errors import ConfigError
from outcore.offload.source_file import Identity, content_hash

_HASHES: dict[tuple[Path, Identity], str] = {}  # the process's cache, by file and identity
_LOCK = threading.Lock()
_QUIET_BELOW = 1 << 30  # bytes: hashing less is too quick to need a progress bar


def in_place(sp: Any) -> bool:
    """Whether a sharded parameter's values are read in place from a base file."""
    return sp.master_shard is None and sp.compute_shard is not None and sp.compute_shard.read_only


def base_files(engine: Any) -> list[Path]:
    """The files this engine's parameters are read from in place, in a fixed order."""
    return sorted({sp.compute_shard.path for sp in engine.params
                   if sp.compute_shard is not None and sp.compute_shard.read_only})


def file_hash(path: Path) -> str:
    """The content hash of ``path``, computed once per identity in this process."""
    key = (path, Identity.of(path))
    with _LOCK:
        if key in _HASHES:
            return _HASHES[key]
    size = key[1].size
    with tqdm(total=size, unit="B", unit_scale=True, desc=f"hashing {path.name}",
              file=sys.stderr, disable=size < _QUIET_BELOW, leave=False) as bar:
        value = content_hash(path, bar.update)
    with _LOCK:
        _HASHES[key] = value
    return value


def record(files: list[Path]) -> dict[str, Any] | None:
    """The manifest's ``base`` entry for ``files`` (None when nothing is read in place)."""
    if not files:
        return None
    entry = {}
    for f in files:
        ident = Identity.of(f)
        entry[f.name] = {"bytes": ident.size, "mtime_ns": ident.mtime_ns, "xxh3_128": file_hash(f)}
    return {"folder": str(files[0].parent), "files": entry}


def check(saved: dict[str, Any] | None, files: list[Path], checkpoint: Path) -> None:
    """Refuse to resume over a base other than the one ``checkpoint`` trained over."""
    if not files:
        return
    if saved is None:
        raise ConfigError(f"{checkpoint} was saved with the base parameters in it; this model "
                          f"reads them from {files[0].parent}, which the checkpoint cannot vouch "
                          "for")
    for f in files:
        was = saved["files"].get(f.name)
        if was is None:
            raise ConfigError(f"{checkpoint} was trained over the base in {saved['folder']}, "
                              f"which has no {f.name}; give the same --model folder")
        ident = Identity.of(f)
        if ident.size != was["bytes"] or (ident.mtime_ns != was["mtime_ns"]
                                          and file_hash(f) != was["xxh3_128"]):
            raise ConfigError(f"the base file {f} changed since {checkpoint} was saved (its "
                              f"{'size' if ident.size != was['bytes'] else 'content'} differs "
                              f"from the one in {saved['folder']}); resume over the same base "
                              "weights, or start a new run")


def check_engine(engine: Any, man: dict[str, Any], by_name: dict[str, tuple[str, dict]],
                 checkpoint: Path) -> None:
    """Parameters the checkpoint names in its base must be read from that base now, and the
    base must be unchanged (see the note above); ``by_name`` maps names to manifest entries."""
    folder = (man.get("base") or {}).get("folder")
    for sp in engine.params:
        tensor = by_name[sp.name][1].get("base") if sp.name in by_name else None
        if tensor is not None and not (in_place(sp) and sp.compute_shard.entry.name == tensor):
            raise ConfigError(f"the checkpoint does not hold {sp.name}: it was read from the "
                              f"base model in {folder} (tensor {tensor}); build the model from "
                              f"that folder: outcore.init(cfg, frozen=True, weights=\"{folder}\")"
                              " or outcore train --model FOLDER")
    named = {Path(sp.compute_shard.path) for sp in engine.params
             if in_place(sp) and sp.name in by_name and by_name[sp.name][1].get("base")}
    check(man.get("base"), sorted(named), checkpoint)
