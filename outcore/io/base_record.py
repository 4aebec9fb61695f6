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
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from outcore.errors import ConfigError
from outcore.offload.source_file import Identity, TensorEntry, content_hash, read_header

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


def file_hash(path: Path, opened: Any = None) -> str:
    """The content hash of ``path`` (of ``opened``, the file a reader holds open there, when
    given), computed once per identity in this process."""
    key = (path, opened.identity if opened is not None else Identity.of(path))
    with _LOCK:
        if key in _HASHES:
            return _HASHES[key]
    size = key[1].size
    with tqdm(total=size, unit="B", unit_scale=True, desc=f"hashing {path.name}",
              file=sys.stderr, disable=size < _QUIET_BELOW, leave=False) as bar:
        value = content_hash(path, bar.update, opened=opened)
    with _LOCK:
        _HASHES[key] = value
    return value


def record(files: list[Path], opened: Callable[[Path], Any] | None = None
           ) -> dict[str, Any] | None:
    """The manifest's ``base`` entry for ``files`` (None when nothing is read in place).

    ``opened``: the open file a reader reads at a path (``SourceReader.opened``). The record
    is of that file, the one the run trained over: a base replaced under the run (a tool
    writing a new file and renaming it over the old) was recorded as the new file, so a
    resume over it was taken as a resume over the same base; a base removed failed the save
    in words about the checkpoint, and the run lost its steps (found by a user's probe)."""
    if not files:
        return None
    entry = {}
    for f in files:
        of = opened(f) if opened is not None else None
        ident = of.identity if of is not None else Identity.of(f)
        if of is not None and _moved_on(f, ident):
            warnings.warn(f"the base file {f} was replaced or removed since this run opened "
                          "it; the checkpoint records the file the run reads (still open), so "
                          "a resume over other bytes at that path is refused", stacklevel=2)
        entry[f.name] = {"bytes": ident.size, "mtime_ns": ident.mtime_ns,
                         "xxh3_128": file_hash(f, of)}
    return {"folder": str(files[0].parent), "files": entry}


def _moved_on(path: Path, was: Identity) -> bool:
    """Whether ``path`` no longer names the file whose identity was ``was`` (another inode,
    or none; a new time alone is the same file, whose changed bytes its reads would catch)."""
    try:
        return Identity.of(path).inode != was.inode
    except OSError:
        return True


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
                 checkpoint: Path) -> dict[str, TensorEntry]:
    """Check the base a checkpoint names against the files this run reads (see the note
    above); return the base's tensors by name where parameters the checkpoint does not hold
    are not read in place now (another placement): those are loaded from the base's files."""
    saved = man.get("base")
    files: set[Path] = set()
    elsewhere = []
    for sp in engine.params:
        tensor = by_name[sp.name][1].get("base") if sp.name in by_name else None
        if tensor is None:
            continue
        if in_place(sp) and sp.compute_shard.entry.name == tensor:
            files.add(Path(sp.compute_shard.path))
        else:
            elsewhere.append(sp.name)
    tensors: dict[str, TensorEntry] = {}
    if elsewhere:
        assert saved is not None  # entries name a base only where the manifest records it
        tensors = named_tensors(saved, f"the checkpoint does not hold {elsewhere[0]}")
        files |= {t.path for t in tensors.values()}
    check(saved, sorted(files), checkpoint)
    return tensors


def named_tensors(saved: dict[str, Any], what: str) -> dict[str, TensorEntry]:
    """The tensors of the files a checkpoint's ``base`` entry names (and only those, whatever
    else is in the folder); ``what`` opens the error if they cannot be read."""
    tensors: dict[str, TensorEntry] = {}
    try:
        for name in saved["files"]:
            tensors.update(read_header(Path(saved["folder"]) / name))
    except ConfigError as e:
        raise ConfigError(f"{what}: it was read from the base model in {saved['folder']}, "
                          f"which cannot be read now ({e})") from None
    return tensors


def load_values(sp: Any, tensor: TensorEntry) -> None:
    """Write this rank's slice of ``tensor`` (a base file's) into a sharded parameter."""
    shard = torch.zeros(sp.layout.shard_numel)
    sp.rt.reader.read_now(tensor, sp.layout.start, shard[: sp.layout.valid_numel])
    sp.write_shard(shard)


def stored_over_base(sp: Any, values: torch.Tensor) -> None:
    """A checkpoint that stores values for a parameter read in place (saved before bases
    were named, or after a user's write): the values win, in a shard of the parameter's
    own (param.py's ``write_shard``), which costs swap space the base did not; say so once."""
    warnings.warn("the checkpoint stores values of parameters this model reads in place from "
                  "its base files; they are loaded into the swap file (save a new checkpoint "
                  "to name the base instead)", stacklevel=2)
    sp.write_shard(values)
