"""The end of an engine's hold on a model: detaching it, and handing its values back.

[Note: handing the model back]
After ``engine.close()`` the model is a plain PyTorch model again: its parameters lose the
sharded class (surface.py), show their trained values in the dtype and on the device they
had before the engine (``ShardedParam.user_dtype``, ``user_device``), and outcore forgets
them; buffers get their dtype and device back, so a model built on the CPU and trained on a
GPU is whole on the CPU again, one moved to the GPU first is whole there. That needs the whole
model in memory at once, so by default (``keep_values=None``) it is done only where the
model, in those dtypes and times the ranks on this machine, fits in half of what this process
may still allocate there (a GPU's free memory where the values go back to one); at more
ranks the ranks agree first, and the values are all-gathered (a collective). Otherwise the
parameters are DROPPED: metadata still answers, a read names how to get the values (save
before closing, or ``close(keep_values=True)``), and a write of a whole parameter
(``load_state_dict``) makes it plain again. A newer engine taking the model (see
``runtime_for``'s [Note: a second engine on the same model]) only detaches the old one: the
shards stay.
"""

from __future__ import annotations

import logging
import os
import shutil
import zlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from outcore.config import Config
from outcore.engine.torch_optimizer import step_aside
from outcore.errors import ConfigError, ParamAccessError, StorageError
from outcore.guard.memory import available_memory
from outcore.offload.tier import Tier
from outcore.runtime import Runtime
from outcore.runtime.bootstrap import ranks_on_this_host
from outcore.sizing import placement
from outcore.units import format_bytes
from outcore.zero.access import dropped_message
from outcore.zero.registry import managed
from outcore.zero.state import ParamState

if TYPE_CHECKING:
    from outcore.engine.core import Engine
    from outcore.zero.param import ShardedParam

log = logging.getLogger("outcore")


def hand_over(engine: Engine) -> None:
    """A newer engine takes the model: ``engine`` lets go of it, keeps no values and cannot
    be used after (see [Note: a second engine on the same model])."""
    try:
        engine.sharded_optimizer.wait()
    except Exception as e:  # noqa: BLE001 - the new engine starts from the shards as they are
        log.warning("outcore: an update of the engine being replaced failed: %s", e)
    detach(engine)
    engine._folders.release_all()
    engine.rt.engine = None
    engine._closed = ("this outcore Engine handed its model to a newer engine "
                      "(outcore.initialize or a new OutcoreTrainer on the same model); use "
                      "that one")


def quiesce(engine: Engine) -> None:
    """Wait for all the engine has in flight: the updates ``step()`` left running
    (``synchronize``) and the reads it started ahead for the next forward. For the end of
    training, where no next step may come: those reads hold the shards' store, swap file and
    all, so an engine and model dropped then, never closed, would outlive the collection by
    them. Not part of ``synchronize``, which times ``step()`` without the next forward's reads."""
    engine.synchronize()
    for group in engine.groups:
        group.settle_reads()


def runtime_for(module: nn.Module, cfg: Config,
                trainable_fraction: float) -> tuple[Runtime, bool]:
    """The runtime of the model's shards, or a new one; and whether it is new.

    [Note: a second engine on the same model]
    Shards already exist when the model was built under ``outcore.init`` or another
    engine holds it (a second trainer, a resume with another batch size). An engine
    still holding the model hands it over (``hand_over``: its hooks and optimizer go, the
    shards stay) and cannot be used after. The shards stay where they are if the new
    config places them the same way; otherwise each one moves to the new placement
    (``ShardedParam.move_to``), one shard at a time, so the model is never whole in
    memory, and the old swap files are deleted. The new engine starts with a fresh
    optimizer, as a new ``torch.optim`` optimizer would.
    """
    sps = list({id(sp): sp for p in module.parameters() if (sp := managed(p))}.values())
    runtimes = {id(sp.rt): sp.rt for sp in sps}
    if len(runtimes) > 1:
        raise ConfigError("the model mixes parameters sharded by two outcore.init contexts "
                          "or engines; build it in one")
    dropped = [sp for sp in sps if sp.state is ParamState.DROPPED]
    if dropped:
        raise ParamAccessError(dropped_message(dropped[0]))
    if not runtimes:
        return Runtime(cfg, trainable_fraction=trainable_fraction), True
    rt = next(iter(runtimes.values()))
    holder = rt.engine() if rt.engine is not None else None
    if holder is not None and not holder.closed:
        hand_over(holder)
    if rt.cfg.offload == cfg.offload and not rt.closed:
        rt.reconfigure(cfg)
        return rt, False
    new = Runtime(cfg, trainable_fraction=trainable_fraction)
    try:
        for sp in sps:
            sp.move_to(new)
    except BaseException:
        new.close()
        raise
    rt.close()
    return new, False


def check_swap_space(rt: Runtime, total: int, trainable: int) -> None:
    """Refuse a build whose model states do not fit the NVMe swap's disk, on every rank.

    [Note: the swap's space is checked before the build, on every rank]
    The swap file grows a piece at a time as shards are made. A disk too small for them failed
    in the middle of the build, naming the piece (a few MiB) and the run's folder, already
    removed; at more ranks the failed rank left the build while the others waited in its
    collectives, and gloo aborted them (SIGABRT, their swap files left). So the bytes this
    rank's states need there (``placement.state_bytes``, the price ``Config.auto`` uses) are
    compared with the free space of ``offload.nvme_path`` first (times the ranks on this host
    where every rank names the same path: they share its disk), and the ranks agree before
    any collective of the build: a refusal on one is a ``StorageError`` on all. ``outcore
    train`` runs it too, before building its model under ``outcore.init``; a model a script
    builds under ``outcore.init`` itself has its shards made before any engine exists, and is
    not checked."""
    if Tier.NVME not in (rt.param_tier, rt.state_tier):
        return  # the same on every rank: their configs agree (runtime/same_config.py)
    path = rt.cfg.offload.nvme_path
    assert path is not None  # guaranteed by Config validation
    need = placement.state_bytes(total, rt.world_size, rt.cfg, rt.device.type,
                                 rt.cfg.offload.params, rt.cfg.offload.optimizer,
                                 trainable)[Tier.NVME.value]
    shared = rt.comm.alike([zlib.crc32(os.fsencode(os.path.realpath(path)))])[0]
    ranks = ranks_on_this_host() if shared and rt.world_size > 1 else 1
    free = shutil.disk_usage(path).free
    error = None if need * ranks <= free else StorageError(
        f"not enough free space for the NVMe swap in {path}"
        + (f" on rank {rt.rank}" if rt.world_size > 1 else "")
        + f": the model states kept there need {format_bytes(need * ranks)}"
        + (f" ({format_bytes(need)} for each of the {ranks} ranks on this host)"
           if ranks > 1 else "")
        + f", and {format_bytes(free)} is free; free space, point offload.nvme_path at a "
        "larger disk, or keep more in memory (offload.params: cpu)")
    rt.comm.raise_together(error, StorageError(
        "initialize() was refused on another rank: its NVMe swap does not fit on its disk (its "
        "error says where); this rank built nothing either"))


def detach(engine: Engine) -> None:
    """Take the engine off the model: optimizer, hooks and gathered tensors go, every
    parameter is SHARDED and in no group, buffers are as they were; the shards stay."""
    engine.rt.drop_abandoned()  # a forward a KeyboardInterrupt left (overlap/abandoned.py)
    engine.sharded_optimizer.close()
    step_aside(engine.adopted_optimizer)  # its own methods again (torch_optimizer.py)
    engine.rt.await_updates = engine.rt.before_write = engine.rt.before_forward = lambda: None
    engine.rt.before_overwrite = lambda what: None
    engine.rt.updated_in_backward = lambda: False
    engine.rt.is_tentative = lambda sp: False
    engine.rt.drop_abandoned = lambda: False
    engine.rt.gradients_held, engine.rt.grad_read_warned = lambda: False, False  # next engine's
    engine.entries.remove()
    engine.hooks.remove()
    for g in engine.groups:
        try:
            g.reshard()
        except Exception as e:  # noqa: BLE001 - a failed read the forward already raised
            log.debug("outcore: releasing group %s after a failed read: %s", g.name, e)
        g.hide_resident()
    for sp in engine.params:
        if sp.alive:
            sp.release_grads()
            sp.group = None
    restore_buffers(engine.buffer_places)


def restore_buffers(places: list) -> None:
    """Buffers back in the dtype and on the device they had before the engine."""
    for module, key, dtype, device in places:
        buf = module._buffers.get(key)
        if buf is not None:
            module._buffers[key] = buf.to(device=device, dtype=dtype)


def abandon(module: nn.Module, rt: Runtime) -> None:
    """An engine failed while building over a model it sharded itself: every parameter of
    ``rt`` goes back to plain, with its values (the user's model is as it came), before the
    runtime closes. A model built under ``outcore.init`` is not this runtime's to undo."""
    sps = [sp for p in module.parameters() if (sp := managed(p)) is not None and sp.rt is rt]
    for g in {id(sp.group): sp.group for sp in sps if sp.group is not None}.values():
        g.reshard()
        g.hide_resident()
    error = _give_back(sps)
    if error is not None:  # the build's error is the one to see
        log.debug("outcore: values dropped while undoing a failed build: %s", error)


def close(engine: Engine, keep_values: bool | None) -> None:
    """``engine.close()``: wait for the updates the last step left running, detach, hand the
    values back (see the note), then close the runtime (its swap files) and let go of the
    checkpoint roots, whatever failed before. The first failure is raised once all that is
    done; a second call does nothing."""
    if engine._closed is not None:
        return
    engine._closed = "this outcore Engine was closed"
    error: BaseException | None = None
    try:
        engine.sharded_optimizer.wait()
    except BaseException as e:  # noqa: BLE001 - raised below, once everything is closed
        error = e
    try:
        detach(engine)
        hand_back(engine, keep_values)
    except BaseException as e:  # noqa: BLE001 - as above
        error = error or e
    finally:
        engine.rt.close()
        engine.rt.engine = None
        engine._folders.release_all()
    if error is not None:
        raise error


def hand_back(engine: Engine, keep_values: bool | None) -> None:
    """Give each parameter its values back (or drop them): see the note."""
    sps = [sp for sp in engine.params if sp.alive and sp.state is ParamState.SHARDED]
    if not _keep(engine, sps, keep_values):
        for sp in sps:
            sp.drop()
        return
    error = _give_back(sps)
    if error is not None and keep_values:  # asked for: the caller hears why it failed
        raise error
    if error is not None:
        log.warning("outcore: close() could not keep the model's values (%s); they were "
                    "dropped", error)


def _give_back(sps: list[ShardedParam]) -> Exception | None:
    """Hand each SHARDED parameter its values in its own dtype, on the device it came on (as
    the buffers go back to theirs: a model built on the CPU and trained on a GPU is whole on
    the CPU again); after the first failure (a read, or memory) the rest are dropped rather
    than left half-owned."""
    try:
        for sp in sps:
            if sp.state is ParamState.SHARDED:
                sp.hand_back(sp.gather_values().to(_home(sp), sp.user_dtype))
    except Exception as e:  # noqa: BLE001 - returned to the caller, which decides
        for sp in sps:
            if sp.state is ParamState.SHARDED:
                sp.drop()
        return e
    return None


def _home(sp: ShardedParam) -> torch.device:
    """The device a parameter goes back to: the one it came on (the compute device for one
    that never had real storage)."""
    return sp.rt.device if sp.user_device.type == "meta" else sp.user_device


def _keep(engine: Engine, sps: list[ShardedParam], keep_values: bool | None) -> bool:
    if keep_values is not None or not sps:
        return bool(keep_values)
    rt = engine.rt
    need = sum(sp.numel * sp.user_dtype.itemsize for sp in sps)
    gpu = next((_home(sp) for sp in sps if _home(sp).type == "cuda"), None)
    if gpu is not None:  # values go back to a GPU: its free memory decides
        room, ranks = torch.cuda.mem_get_info(gpu)[0], 1
    else:
        room, ranks = available_memory().bytes, ranks_on_this_host()
    fits = need * ranks <= room // 2
    if rt.world_size > 1:
        if rt.comm.failed:  # a rank is gone: a collective now would only time out
            return False
        fits = not bool(rt.comm.all_reduce_max(torch.tensor([0.0 if fits else 1.0])).item())
    if not fits:
        log.warning("outcore: close() did not keep the model's values: %s (x%d ranks here) "
                    "does not fit in half of %s; save before closing, or pass "
                    "close(keep_values=True)", format_bytes(need), ranks, format_bytes(room))
    return fits
