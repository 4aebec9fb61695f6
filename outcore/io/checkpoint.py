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
import json
import os
import shutil
import warnings
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from outcore.errors import ConfigError, OutcoreError, StorageError, user_stacklevel
from outcore.io import base_record
from outcore.io import safetensors_stream as sts
from outcore.io.agreement import agree
from outcore.io.client_state import check_client_state, decode, group_value
from outcore.io.manifest import (
    FORMAT,
    VERSION,
    align_empty_groups,
    check_file,
    manifest_checksum,
    rank_file,
    read_manifest,
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
from outcore.optim.param_groups import HP_KEYS

_RNG_CPU, _RNG_CUDA = "__rng__::torch_cpu", "__rng__::torch_cuda"
_OPTIM = "__optimizer__::"  # replicated optimizer state (rank 0's file)


# -- save ----------------------------------------------------------------------------------------
def save(engine: Any, path: Path, client_state: dict[str, Any], *,
         replace_folder: bool = False, files: dict[str, Path] | None = None) -> Path:
    """``replace_folder``: a folder already at ``path`` goes whole once the new one is in
    place, other files included (a Trainer's ``checkpoint-N``, which the Trainer itself
    deletes whole); otherwise only the files of a checkpoint go (publish.py's [Note:
    replacing a folder]). ``files``: copied into the checkpoint by name (``check_files``)."""
    engine.sharded_optimizer.wait()  # updates running during backward must land before we read
    return _save(engine, path, client_state, replace_folder, files or {})


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


def _replicated(engine: Any) -> dict[str, torch.Tensor]:
    """Optimizer state every rank holds whole (Adafactor's row and column factors: rank 0
    saves them, every rank loads them), by ``<parameter>::<kind>``."""
    runner = engine.sharded_optimizer.adafactor
    return runner.replicated({id(sp): sp.name for sp in engine.params}) if runner else {}


def _rng_states(engine: Any) -> dict[str, torch.Tensor]:
    out = {_RNG_CPU: torch.get_rng_state()}
    if engine.rt.accel.is_cuda:
        out[_RNG_CUDA] = torch.cuda.get_rng_state(engine.rt.device)
    return out


def _buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers by state-dict name (the live tensors, so load can copy into them)."""
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in module.state_dict(keep_vars=True).items()
            if k not in params and isinstance(v, torch.Tensor)}


def _write_rank_file(engine: Any, folder: Path) -> FileInfo:
    """Stream this rank's valid shard state, RNG state and (rank 0) buffers to its file."""
    rank, world = engine.rt.rank, engine.rt.world_size
    extra = _rng_states(engine)
    if rank == 0:
        extra.update({f"__buffer__::{k}": v for k, v in _buffers(engine.module).items()})
        extra.update({f"{_OPTIM}{k}": v for k, v in _replicated(engine).items()})
    specs = [TensorSpec(f"{sp.name}::{kind}", st.dtype, (sp.layout.valid_numel,))
             for sp in engine.params for kind, st in _state(engine, sp)]
    specs += [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in extra.items()]
    meta = {"format": "pt", "outcore": FORMAT, "rank": str(rank), "world_size": str(world)}
    need, free = sum(s.nbytes for s in specs), shutil.disk_usage(folder).free
    if need > free:
        raise StorageError(f"not enough space for checkpoint file {folder / rank_file(rank, world)}"
                           f": it needs {need} bytes, {free} bytes are free")
    with torch.no_grad(), StreamWriter(folder / rank_file(rank, world), specs, meta) as w:
        for sp in engine.params:
            n = sp.layout.valid_numel
            for kind, st in _state(engine, sp):
                w.write(f"{sp.name}::{kind}", load_now(st)[:n])
        for k, t in extra.items():
            w.write(k, t)
        return w.finish()


def _stored_group(i: int, hp: dict[str, Any]) -> dict[str, Any]:
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
    groups = [_stored_group(i, hp) for i, hp in enumerate(engine.param_groups)]  # (members below)
    man = {"format": FORMAT, "version": VERSION, "world_size": engine.rt.world_size,
           "dtype": engine.cfg.dtype, "dtype_reason": engine.dtype_choice.reason,
           "global_steps": engine.global_steps,
           "optimizer": {"type": engine.sharded_optimizer.kind,
                         "states": list(engine.sharded_optimizer.state_kinds),
                         "replicated": sorted(_replicated(engine))},
           "params": params, "buffers": list(_buffers(engine.module)),
           "scaler": engine.scaler.state_dict(), "param_groups": groups,
           "config": engine.cfg.model_dump(mode="json"), "client_state": client_state,
           "checksum": CHECKSUM, "files": files, "copied_files": copied,
           "group_members": [[sp.name for sp in members]
                             for members in engine.sharded_optimizer.members],
           "base": base_record.record(base_record.base_files(engine),
                                      lambda f: engine.rt.reader.opened(f))}  # (made if used)
    return {**man, "manifest_checksum": manifest_checksum(man)}


def _storage_error(e: Exception, path: Path) -> Exception:
    if isinstance(e, OSError) and not isinstance(e, StorageError):
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else -1
        return StorageError(f"writing checkpoint {path} failed: {e.strerror or e} "
                            f"({free} bytes free on that filesystem)")
    return e


# -- load ----------------------------------------------------------------------------------------
def load(engine: Any, path: Path, keep_settings: bool = False) -> dict[str, Any]:
    engine.sharded_optimizer.wait()  # a background update must not overwrite what we load
    return _load(engine, path, keep_settings)


def _load(engine: Any, path: Path, keep_settings: bool = False) -> dict[str, Any]:
    """Restore ``engine`` from the checkpoint at ``path``, at any world size; return client_state.

    Two phases, each ending in an agreement among ranks: first check the manifest against the
    model and verify every file this rank will read (size and checksum), so a bad checkpoint
    changes nothing; then stream the state in, one parameter at a time.
    """
    folder, err, man, plan = Path(path), None, {}, {}
    try:
        man = read_manifest(folder)
        plan = _plan(engine, man, folder)
        for r in sorted(plan["ranks"]):
            check_file(folder, man, rank_file(r, man["world_size"]))
        _check_buffers(engine, folder, man)
    except OutcoreError as e:
        err = e
    ids = agree(engine.rt, err, f"checking checkpoint {folder}",
                (int(str(man.get("manifest_checksum", "0"))[:15] or "0", 16),))
    if ids.unique().numel() > 1:  # each rank would load its slices of another checkpoint
        raise ConfigError(f"load_checkpoint() was given another checkpoint on some rank (this "
                          f"rank's: {folder}, step {man.get('step')}); every rank loads one")
    try:
        with torch.no_grad(), contextlib.ExitStack() as stack:
            old = man["world_size"]
            handles = {r: stack.enter_context(safe_open(folder / rank_file(r, old), "pt"))
                       for r in plan["ranks"]}
            # no read may be in flight into a shard while it is rewritten (prefetches issued
            # by the last step, persistent groups' refresh): cancel them all first
            for g in engine.groups:
                g.reshard()
            engine.schedule.end_iteration()
            for sp in engine.params:
                _load_param(engine.sharded_optimizer, sp, plan["entries"][sp.name], man, handles,
                            plan["base"])
            for name, buf in _buffers(engine.module).items():
                buf.copy_(handles[0].get_tensor(f"__buffer__::{name}"))
            for key, target in _replicated(engine).items():
                name, kind = key.rsplit("::", 1)  # saved under the checkpoint's name for it
                saved = f"{_OPTIM}{plan['entries'][name][0]}::{kind}"
                target.copy_(handles[0].get_tensor(saved))
            rng = handles[plan["rng_rank"]]
            torch.set_rng_state(rng.get_tensor(_RNG_CPU))
            if engine.rt.accel.is_cuda and _RNG_CUDA in rng.keys():  # noqa: SIM118
                torch.cuda.set_rng_state(rng.get_tensor(_RNG_CUDA), engine.rt.device)
    except (OutcoreError, OSError) as e:
        err = e
    agree(engine.rt, err, f"loading checkpoint {folder}")
    if not keep_settings:  # (kept: the groups' settings stay this engine's own)
        _warn_replaced_settings(engine, man)
        for hp, saved in zip(engine.param_groups, man["param_groups"], strict=True):
            for k, v in saved.items():  # a tensor stays one (torch shares one lr tensor
                mine, v = hp.get(k), decode(v)  # between groups: a new one each, not filled)
                if isinstance(mine, torch.Tensor) and isinstance(v, (int, float, list)):
                    hp[k] = torch.tensor(v, dtype=mine.dtype, device=mine.device)
                else:
                    hp[k] = tuple(v) if isinstance(mine, tuple) else v
    engine.scaler.load_state_dict(man["scaler"])
    engine.global_steps, engine.micro_steps = int(man["global_steps"]), 0
    engine.sharded_optimizer.zero_grad()
    for g in engine.groups:
        g.refresh_after_step()
    return decode(man["client_state"])


def _warn_replaced_settings(engine: Any, man: dict) -> None:
    """A resume takes the optimizer's hyper-parameters from the checkpoint, as torch's
    ``load_state_dict`` does (a scheduler's learning rate must go on from where it was); a
    config that sets other values than the saved run's says so once, on rank 0, so a run
    resumed "with a lower learning rate" does not silently keep the old one."""
    saved = (man.get("config") or {}).get("optimizer") or {}
    mine = engine.cfg.optimizer.model_dump(mode="json")
    differ = [f"{k} {mine[k]} -> {saved[k]}" for k in HP_KEYS
              if k in saved and k in mine and saved[k] != mine[k]]
    if differ and engine.rt.rank == 0:
        warnings.warn(f"load_checkpoint(): the checkpoint's optimizer settings replace this "
                      f"engine's config ({', '.join(differ)}), as torch's load_state_dict "
                      "does; to keep this engine's, pass load_checkpoint(keep_settings=True), "
                      "or set engine.optimizer.param_groups after loading",
                      stacklevel=user_stacklevel())


def _check_buffers(engine: Any, folder: Path, man: dict) -> None:
    """Each persistent buffer's saved shape is the model's: ``copy_`` would broadcast a
    smaller one without a word, or fail after the weights were written."""
    bufs = _buffers(engine.module)
    if not bufs:
        return
    with safe_open(folder / rank_file(0, man["world_size"]), "pt") as f:
        differ = [f"{name}: checkpoint {list(shape)}, model {list(buf.shape)}"
                  for name, buf in bufs.items()
                  if list(shape := f.get_slice(f"__buffer__::{name}").get_shape())
                  != list(buf.shape)]
    if differ:
        raise ConfigError(f"checkpoint buffer shapes differ from the model's: {differ}; "
                          "nothing was loaded")


def _check_groups(engine: Any, man: dict, by_name: dict[str, tuple[str, dict]]) -> None:
    """The checkpoint's param groups hold the engine's groups' parameters, group by group:
    matched by position alone, groups built in another order would swap their learning
    rates and weight decays without a word (torch refuses such a load too). Only parameters
    trainable on both sides are compared: groups hold trainable parameters only, so one
    frozen or unfrozen since the save is in one side's groups and in neither's of the
    other, and that is a change of what trains, not of which group is which. Checkpoints
    from before the groups' members were recorded are matched by count only."""
    saved = man.get("group_members")
    if saved is None:
        return
    mine = [{by_name[sp.name][0] for sp in members}
            for members in engine.sharded_optimizer.members]
    both = set().union(*mine) & set().union(*map(set, saved))
    for i, (ours, names) in enumerate(zip(mine, saved, strict=True)):
        ours, theirs = ours & both, set(names) & both
        if ours != theirs:
            only_model = sorted(ours - theirs)[:3]
            only_saved = sorted(theirs - ours)[:3]
            raise ConfigError(
                f"checkpoint's param group {i} holds other parameters than this engine's "
                f"group {i} (only in the engine's: {only_model}, only in the checkpoint's: "
                f"{only_saved}); build the groups in the order and with the members they "
                "had when saved")


def _plan(engine: Any, man: dict, folder: Path) -> dict[str, Any]:
    """Match the model against the manifest (ConfigError naming what differs) and list the
    old rank files this rank must read."""
    by_name = {}
    for canon, entry in man["params"].items():
        for n in (canon, *entry["aliases"]):
            by_name[n] = (canon, entry)
    model = [sp.name for sp in engine.params]
    missing = [n for n in model if n not in by_name]
    extra = sorted(set(man["params"]) - {by_name[n][0] for n in model if n in by_name})
    if missing or extra:
        raise ConfigError(f"checkpoint does not match the model: parameters missing from the "
                          f"checkpoint {missing}, in the checkpoint but not the model {extra}")
    base_tensors = base_record.check_engine(engine, man, by_name, folder)
    shapes = [f"{sp.name}: checkpoint {by_name[sp.name][1]['shape']}, model {list(sp.shape)}"
              for sp in engine.params if by_name[sp.name][1]["shape"] != list(sp.shape)]
    if shapes:
        raise ConfigError(f"checkpoint shapes differ from the model: {shapes}")
    bufs, saved_bufs = list(_buffers(engine.module)), man["buffers"]
    if set(bufs) != set(saved_bufs):
        raise ConfigError(f"checkpoint buffers differ from the model's: missing "
                          f"{sorted(set(bufs) - set(saved_bufs))}, "
                          f"extra {sorted(set(saved_bufs) - set(bufs))}")
    kinds = {man["optimizer"]["type"], engine.sharded_optimizer.kind}
    if "adafactor" in kinds and len(kinds) > 1:  # its state has another shape altogether
        raise ConfigError(f"checkpoint holds {man['optimizer']['type']} state; this engine "
                          f"runs {engine.sharded_optimizer.kind}")
    need = set(engine.sharded_optimizer.state_kinds) - set(man["optimizer"]["states"])
    if need:
        raise ConfigError(f"checkpoint has optimizer states {man['optimizer']['states']}, this "
                          f"optimizer ({engine.sharded_optimizer.kind}) also needs {sorted(need)}")
    align_empty_groups(man, engine.param_groups, _stored_group)
    if len(man["param_groups"]) != len(engine.param_groups):
        raise ConfigError(f"checkpoint has {len(man['param_groups'])} param groups, the engine "
                          f"{len(engine.param_groups)}")
    _check_groups(engine, man, by_name)
    old, rank = man["world_size"], engine.rt.rank
    rng_rank = rank if rank < old else 0  # a new rank past the old world takes rank 0's RNG
    ranks = {rng_rank}
    if bufs or man["optimizer"].get("replicated"):
        ranks.add(0)
    if _replicated(engine) and not man["optimizer"].get("replicated"):
        raise ConfigError(f"checkpoint has no Adafactor factors (optimizer "
                          f"{man['optimizer']['type']}); this engine's Adafactor needs them")
    for sp in engine.params:
        ranks.update(sts.pieces_overlapping(sp.numel, old, sp.layout.start, sp.layout.valid_numel))
    return {"entries": {sp.name: by_name[sp.name] for sp in engine.params}, "ranks": ranks,
            "rng_rank": rng_rank, "base": base_tensors}


def _load_param(optimizer: Any, sp: Any, found: tuple[str, dict], man: dict,
                handles: dict[int, Any], base: dict[str, Any]) -> None:
    """Re-cut one parameter's saved state into this rank's shard and write it to its tiers."""
    canon, entry = found
    lay, old = sp.layout, man["world_size"]

    def read(kind: str, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(lay.shard_numel, dtype=dtype)
        end = lay.start + lay.valid_numel
        sts.read_flat_range(handles, old, f"{canon}::{kind}", sp.numel, lay.start, end, out)
        return out

    src = "master" if entry["trainable"] else "values"
    if entry.get("base") in base:  # not read in place now: its values from the base's file
        base_record.load_values(sp, base[entry["base"]])
    elif entry.get("base"):  # read in place, checked unchanged by base_record.check_engine
        pass
    elif sp.master_shard is None and sp.compute_shard.read_only:  # saved values win
        base_record.stored_over_base(sp, read(src, torch.float32))
    elif sp.master_shard is not None:
        sp.write_shard(read(src, torch.float32))  # the master, and the copy that follows it
    else:
        sp.compute_shard.save(read(src, sp.compute_shard.dtype)).result()
    state = optimizer.state.get(sp)
    if state is None:
        return
    for kind, stored in state.moments.items():
        stored.save(read(kind, torch.float32) if entry["trainable"]
                    else torch.zeros(lay.shard_numel)).result()
    optimizer.restore_step(sp, int(entry["step"]) if entry["trainable"] else 0)
