"""Checkpoints: per-rank safetensors shards plus a JSON manifest; no pickle anywhere.

A checkpoint is a folder: ``manifest.json`` (written last, by rank 0) and one
``rank{r:05d}-of-{W:05d}.safetensors`` per rank holding, for every parameter, the *valid*
part of that rank's shard (``<name>::master``, ``<name>::exp_avg`` ... or ``<name>::values``
for frozen parameters) and the rank's RNG state (``__rng__::torch_cpu``); rank 0's file also
holds the persistent buffers (``__buffer__::<name>``). Everything moves one parameter at a
time, so saving, loading and consolidating never hold more than one parameter's state.

[Note: atomicity protocol]
1. Rank 0 removes a stale ``<path>.partial`` (a save that died; the suffix is ours) and
   creates it fresh; all ranks agree before writing.
2. Each rank streams its file to ``<file>.tmp``, fsyncs it and renames it into place; sizes
   and checksums travel to rank 0 in one all-reduce, which is also the barrier.
3. Rank 0 writes ``manifest.json`` the same way (tmp, fsync, rename), fsyncs the folder,
   moves an existing ``<path>`` aside, renames ``<path>.partial`` to ``<path>``, fsyncs the
   parent, and only then deletes the old checkpoint.
A folder without a valid manifest is never a checkpoint, and ``.partial`` folders are never
candidates, so a process killed at any moment leaves the previous checkpoint as the latest.
Every rank returns only after step 3, and an I/O error on any rank (disk full) is raised on
every rank instead of leaving the others waiting in a collective.

[Note: valid-only shards make resharding a slice problem]
Rank r of W owns elements ``[r*s, r*s + valid)`` of each flattened parameter (s = ceil(n/W),
sharding.py), and the file stores exactly those, without padding. So the files of all ranks,
in rank order, are the flat parameter cut at known points, and a rank of another world size
W' finds its range ``[r'*s', r'*s' + valid')`` by reading the overlapping pieces of one or two
old files with ``get_slice``, then zero-fills its padding. The optimizer is elementwise, so
the re-cut state trains on exactly as the old one would have. Saving padding would have tied
the file to W for nothing.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import warnings
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from outcore.errors import ConfigError, OutcoreError, StorageError, limit_hint, user_stacklevel
from outcore.io import base_record
from outcore.io import safetensors_stream as sts
from outcore.io.agreement import agree
from outcore.io.client_state import check_client_state, group_value
from outcore.io.manifest import (
    FORMAT,
    VERSION,
    manifest_checksum,
    rank_file,
)
from outcore.io.publish import (
    MANIFEST,
    OWN_FILES,
    PARTIAL,
    check_replaceable,
    publish,
    remove_ours,
    settle,
)
from outcore.io.safetensors_stream import CHECKSUM, FileInfo, StreamWriter, TensorSpec
from outcore.offload.storage import load_now
from outcore.units import format_bytes

RNG_CPU, RNG_CUDA = "__rng__::torch_cpu", "__rng__::torch_cuda"
OPTIM = "__optimizer__::"  # replicated optimizer state (rank 0's file)


# -- save ----------------------------------------------------------------------------------------
def save(engine: Any, path: Path, client_state: dict[str, Any], *,
         replace_folder: bool = False, files: dict[str, Path] | None = None) -> Path:
    """``replace_folder``: a folder already at ``path`` goes whole once the new one is in
    place, other files included (a Trainer's ``checkpoint-N``, which the Trainer itself
    deletes whole); otherwise only the files of a checkpoint go (publish.py's [Note:
    replacing a folder]). ``files``: copied into the checkpoint by name (``check_files``)."""
    engine.sharded_optimizer.wait()  # updates running during backward must land before we read
    return _save(engine, path, client_state, replace_folder, files or {})


def check_save_arguments(comm: Any, client_state: dict[str, Any],
                         files: Mapping[str, str | bytes | os.PathLike] | None) -> dict[str, Path]:
    """``save_checkpoint``'s client state and ``files`` checked before any folder is made; a
    mistake is refused on every rank together (``comm.raise_together``), so no rank goes on to
    wait in the save's collectives. Returns ``check_files``' table."""
    try:
        check_client_state(client_state)
        copied, error = check_files(files), None
    except ConfigError as e:
        copied, error = {}, e
    comm.raise_together(error, ConfigError(
        "save_checkpoint() was refused on another rank (its error says why: client_state or "
        "files); this rank saved nothing either"))
    return copied


def check_files(files: Mapping[str, str | bytes | os.PathLike] | None) -> dict[str, Path]:
    """``save_checkpoint(files=)``: plain file names, none a checkpoint's own, to the files
    to copy (whether those exist is checked by the rank that copies, rank 0). A path may be
    what ``open`` takes: a str, bytes or a path object (whose ``__fspath__`` may give bytes)."""
    out = {}
    for name, src in (files or {}).items():
        if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name
                or os.sep in name or "\0" in name or OWN_FILES.match(name)):
            raise ConfigError(f"save_checkpoint(files=): {name!r} is not a file name a "
                              "checkpoint can hold (a plain name, not manifest.json or a "
                              "rank file)")
        try:
            path = os.fsdecode(src)
        except TypeError:  # not a str, bytes, nor a path object giving one
            path = None
        if path is None or "\0" in path:
            raise ConfigError(f"save_checkpoint(files=): {name!r} names {src!r}, which is "
                              "not a path")
        out[name] = Path(path)
    return out


def _save(engine: Any, path: Path, client_state: dict[str, Any],
          replace_folder: bool = False, files: dict[str, Path] | None = None) -> Path:
    """Write a complete checkpoint of ``engine`` to ``path`` (a collective; see the notes).

    ``path`` must be on a filesystem every rank sees. Rank 0's ``client_state`` is the one
    recorded. Save at an accumulation boundary: gradients of unfinished micro-steps are not kept.
    """
    comm, path, files = engine.rt.comm, Path(path), files or {}
    client_state = check_client_state(client_state)  # as stored (client_state.py's note)
    partial = path.with_name(path.name + PARTIAL)
    err: Exception | None = None
    if comm.rank == 0:
        try:
            for name, src in files.items():
                if not src.is_file():
                    raise ConfigError(f"save_checkpoint(files=): {name!r} names {src}, which "
                                      "is not a file")
            check_replaceable(path, replace_folder)
            path.parent.mkdir(parents=True, exist_ok=True)
            settle(path, replace_folder)  # what a save killed between its renames left aside
            remove_ours(partial, files)
            partial.mkdir()  # the umask decides who may read it, as for any file
        except Exception as e:  # noqa: BLE001 - every rank hears of it in agree
            err = _storage_error(e, path)
    try:  # the path's digest rides along: each rank writes into rank 0's folder; and the
        # client_state's, which is rank 0's alone in the checkpoint (said, not refused)
        where = agree(engine.rt, err, f"preparing {partial}", (
            zlib.crc32(os.path.abspath(path).encode()),
            zlib.crc32(json.dumps(client_state, sort_keys=True, default=str).encode())))
        if where[:, 0].unique().numel() > 1:
            raise ConfigError(f"save_checkpoint() was given another path on some rank (this "
                              f"rank's: {path}); every rank saves to the same folder")
        if where[:, 1].unique().numel() > 1 and comm.rank == 0:
            warnings.warn("save_checkpoint(): client_state differs between ranks; the "
                          "checkpoint keeps rank 0's, which every rank's load_checkpoint "
                          "returns (gather what each rank needs into it first, e.g. with "
                          "torch.distributed.all_gather_object)", stacklevel=user_stacklevel())
    except OutcoreError:  # another rank failed or died (CommError): take back the folder
        if comm.rank == 0 and err is None:
            remove_ours(partial)
        raise
    info, err = None, None
    try:
        info = _write_rank_file(engine, partial)
    except (OutcoreError, OSError) as e:
        err = _storage_error(e, partial)
    world = engine.rt.world_size
    try:
        table = agree(engine.rt, err, f"writing {partial}",
                       (info.nbytes, int(info.checksum, 16)) if info else (0, 0))
    except OutcoreError:
        if comm.rank == 0:  # every rank is past its write: give the space back (disk full)
            remove_ours(partial)
        raise
    sizes = {rank_file(r, world): {"bytes": int(n), "checksum": f"{int(c):08x}"}
             for r, (n, c) in enumerate(table.tolist())}
    if comm.rank == 0:
        try:
            for name, src in files.items():
                shutil.copyfile(src, partial / name)
            manifest = _manifest(engine, client_state, sizes, sorted(files))
            sts.write_json_durably(partial / MANIFEST, manifest)
            sts.fsync_dir(partial)
            publish(partial, path, replace_folder)
        except Exception as e:  # noqa: BLE001 - every rank hears of it in agree
            err = _storage_error(e, path)
            with contextlib.suppress(OSError):
                remove_ours(partial, files)  # (gone already where it was published)
    agree(engine.rt, err, f"publishing {path}")
    return path


def _state(engine: Any, sp: Any) -> list[tuple[str, Any]]:
    """(key suffix, StoredShard) saved for one parameter: master + optimizer states, or values."""
    state = engine.sharded_optimizer.state.get(sp)
    if base_record.in_place(sp):  # read from the base's own file: named, not stored
        return []
    if sp.trainable and sp.master_shard is not None:
        return [("master", sp.master_shard), *(state.moments.items() if state else ())]
    return [("values", sp.master_shard if sp.master_shard is not None else sp.compute_shard)]


def replicated_state(engine: Any) -> dict[str, torch.Tensor]:
    """Optimizer state every rank holds whole (Adafactor's row and column factors: rank 0
    saves them, every rank loads them), by ``<parameter>::<kind>``."""
    runner = engine.sharded_optimizer.adafactor
    return runner.replicated({id(sp): sp.name for sp in engine.params}) if runner else {}


def _rng_states(engine: Any) -> dict[str, torch.Tensor]:
    out = {RNG_CPU: torch.get_rng_state()}
    if engine.rt.accel.is_cuda:
        out[RNG_CUDA] = torch.cuda.get_rng_state(engine.rt.device)
    return out


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers by state-dict name (the live tensors, so load can copy into them)."""
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in module.state_dict(keep_vars=True).items()
            if k not in params and isinstance(v, torch.Tensor)}


def _write_rank_file(engine: Any, folder: Path) -> FileInfo:
    """Stream this rank's valid shard state, RNG state and (rank 0) buffers to its file."""
    rank, world = engine.rt.rank, engine.rt.world_size
    extra = _rng_states(engine)
    if rank == 0:
        extra.update({f"__buffer__::{k}": v for k, v in persistent_buffers(engine.module).items()})
        extra.update({f"{OPTIM}{k}": v for k, v in replicated_state(engine).items()})
    specs = [TensorSpec(f"{sp.name}::{kind}", st.dtype, (sp.layout.valid_numel,))
             for sp in engine.params for kind, st in _state(engine, sp)]
    specs += [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in extra.items()]
    meta = {"format": "pt", "outcore": FORMAT, "rank": str(rank), "world_size": str(world)}
    need, free = sum(s.nbytes for s in specs), shutil.disk_usage(folder).free
    if need > free:
        raise StorageError(f"not enough space for checkpoint file {folder / rank_file(rank, world)}"
                           f": it needs {format_bytes(need)}, {format_bytes(free)} is free")
    with torch.no_grad(), StreamWriter(folder / rank_file(rank, world), specs, meta) as w:
        for sp in engine.params:
            n = sp.layout.valid_numel
            for kind, st in _state(engine, sp):
                w.write(f"{sp.name}::{kind}", load_now(st)[:n])
        for k, t in extra.items():
            w.write(k, t)
        return w.finish()


def stored_group(i: int, hp: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings as the manifest keeps them (client_state.py); one with no
    stored form (a user's object) is left out, said: a load keeps the engine's own."""
    out = {}
    for k, v in ((k, v) for k, v in hp.items() if k != "params"):
        try:
            out[k] = group_value(v, f"param_groups[{i}][{k!r}]")
        except ConfigError as e:
            warnings.warn(f"{e}; a load keeps the engine's own value", stacklevel=user_stacklevel())
    return out


def _manifest(engine: Any, client_state: dict[str, Any], files: dict[str, dict],
              copied: list[str]) -> dict:
    aliases: dict[int, list[str]] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    params = {}
    for sp in engine.params:
        names = aliases.get(id(sp.param), [sp.name])
        params[sp.name] = {"shape": list(sp.shape), "numel": sp.numel, "trainable": sp.trainable,
                           "step": engine.sharded_optimizer.step_of(sp),
                           "aliases": [n for n in names if n != sp.name]}
        if base_record.in_place(sp):
            params[sp.name]["base"] = sp.compute_shard.entry.name
    groups = [stored_group(i, hp) for i, hp in enumerate(engine.param_groups)]  # (members below)
    man = {"format": FORMAT, "version": VERSION, "world_size": engine.rt.world_size,
           "dtype": engine.cfg.dtype, "dtype_reason": engine.dtype_choice.reason,
           "global_steps": engine.global_steps,
           "optimizer": {"type": engine.sharded_optimizer.kind,
                         "states": list(engine.sharded_optimizer.state_kinds),
                         "replicated": sorted(replicated_state(engine))},
           "params": params, "buffers": list(persistent_buffers(engine.module)),
           "scaler": engine.scaler.state_dict(), "param_groups": groups,
           "config": engine.cfg.model_dump(mode="json"), "client_state": client_state,
           "checksum": CHECKSUM, "files": files, "copied_files": copied,
           "group_members": [[sp.name for sp in members]
                             for members in engine.sharded_optimizer.members],
           "base": base_record.record(base_record.base_files(engine),
                                      lambda f: engine.rt.reader.opened(f))}  # (made if used)
    return {**man, "manifest_checksum": manifest_checksum(man)}


def _storage_error(e: Exception, path: Path) -> Exception:
    """An ``OSError`` of the save as a ``StorageError`` naming ``path`` and what ran out: the
    disk's free bytes where it is full, else the process limit that refused it (a file-size
    or open-file limit also reads "File too large", "Too many open files")."""
    if isinstance(e, OSError) and not isinstance(e, StorageError):
        why = limit_hint(e)
        if e.errno in (errno.ENOSPC, errno.EDQUOT) and path.parent.exists():
            why = f" ({format_bytes(shutil.disk_usage(path.parent).free)} free on that filesystem)"
        return StorageError(f"writing checkpoint {path} failed: {e.strerror or e}{why}")
    return e
