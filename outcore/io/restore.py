"""Loading a checkpoint (checkpoint.py's format), at any world size: check, then stream in.

A bad checkpoint changes nothing: the manifest is matched against the model and every file
this rank will read is verified before the first byte is written into a shard, and each phase
ends in an agreement among ranks, so one rank's refusal is every rank's. The re-cut of each
parameter's saved range into this rank's shard is checkpoint.py's [Note: valid-only shards
make resharding a slice problem].
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from outcore.errors import ConfigError, OutcoreError, user_stacklevel
from outcore.io import base_record
from outcore.io import safetensors_stream as sts
from outcore.io.agreement import agree
from outcore.io.checkpoint import (
    OPTIM,
    RNG_CPU,
    RNG_CUDA,
    persistent_buffers,
    replicated_state,
    stored_group,
)
from outcore.io.client_state import decode
from outcore.io.manifest import align_empty_groups, check_file, rank_file, read_manifest
from outcore.optim.param_groups import HP_KEYS


def load(engine: Any, path: Path, keep_settings: bool = False) -> dict[str, Any]:
    engine.sharded_optimizer.wait()  # a background update must not overwrite what we load
    return _restore(engine, path, keep_settings)


def _restore(engine: Any, path: Path, keep_settings: bool = False) -> dict[str, Any]:
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
            for name, buf in persistent_buffers(engine.module).items():
                buf.copy_(handles[0].get_tensor(f"__buffer__::{name}"))
            for key, target in replicated_state(engine).items():
                name, kind = key.rsplit("::", 1)  # saved under the checkpoint's name for it
                saved = f"{OPTIM}{plan['entries'][name][0]}::{kind}"
                target.copy_(handles[0].get_tensor(saved))
            rng = handles[plan["rng_rank"]]
            torch.set_rng_state(rng.get_tensor(RNG_CPU))
            if engine.rt.accel.is_cuda and RNG_CUDA in rng.keys():  # noqa: SIM118
                torch.cuda.set_rng_state(rng.get_tensor(RNG_CUDA), engine.rt.device)
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
    bufs = persistent_buffers(engine.module)
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
    bufs, saved_bufs = list(persistent_buffers(engine.module)), man["buffers"]
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
    align_empty_groups(man, engine.param_groups, stored_group)
    if len(man["param_groups"]) != len(engine.param_groups):
        raise ConfigError(f"checkpoint has {len(man['param_groups'])} param groups, the engine "
                          f"{len(engine.param_groups)}")
    _check_groups(engine, man, by_name)
    old, rank = man["world_size"], engine.rt.rank
    rng_rank = rank if rank < old else 0  # a new rank past the old world takes rank 0's RNG
    ranks = {rng_rank}
    if bufs or man["optimizer"].get("replicated"):
        ranks.add(0)
    if replicated_state(engine) and not man["optimizer"].get("replicated"):
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
