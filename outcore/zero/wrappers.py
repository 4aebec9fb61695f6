"""Refusals that say who made the refused call: data-parallel wrappers around a model outcore
shards (refused by name), torch's distributed checkpoint tools, and a model built under
``outcore.init`` that no engine holds yet.

[Note: no DDP or FSDP around an outcore model]
outcore is the model's data parallelism: each rank holds a shard, and the engine reduces
the gradients into the shards. A user moving a DDP script over keeps ``DDP(model)``, or
hands accelerate's ``prepare`` the model, which wraps it in DDP at more ranks. Around an
outcore model DDP reduces the same gradients a second time through its own hooks, and a
probe found the weights 1e-2 from DDP's after three steps wherever the optimizer's updates
ran during backward (the optimizer on NVMe), with no word; at more ranks DDP's constructor
reads every parameter outside the forward, and the refusal named ``gathered_parameters``,
which was not the way out. So a wrapped model is refused by ``initialize``, a forward that
runs through a wrapper's ``forward`` is refused before it fetches anything (one walk up the
Python stack per outermost forward, a few microseconds), and a read refused inside a
wrapper's constructor says what is wrong. A wrapper around another model (a DDP student
that calls an outcore teacher in its forward) is that model's business and passes. FSDP2's
``fully_shard`` after ``initialize`` changes the model's class, which the forward checks.
``nn.DataParallel`` is not refused: with one device per process, which is all outcore runs,
it calls the model as it is.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import TYPE_CHECKING

from torch import nn

from outcore.errors import ConfigError

if TYPE_CHECKING:
    from outcore.zero.param import ShardedParam

_WRAPPERS = ("DistributedDataParallel", "FullyShardedDataParallel", "FSDPModule")
# where each one's own code lives, to find it on the stack
_FILES = tuple(os.path.join("torch", *parts) for parts in (
    ("nn", "parallel", "distributed.py"),
    ("distributed", "fsdp", "fully_sharded_data_parallel.py")))

ADVICE = ("outcore already runs the data parallelism (each rank holds a shard, and the engine "
          "reduces the gradients into it), and DDP or FSDP around it reduces the same "
          "gradients again and trains other weights. Use the model itself (ddp_model.module, or "
          "the model before fully_shard): "
          "call it or the engine directly; under accelerate, prepare the optimizer, dataloader "
          "and scheduler, not the model")


def wrapper_of(model: object) -> str | None:
    """The name of torch's data-parallel wrapper ``model`` is, or None."""
    names = {c.__name__ for c in type(model).__mro__ if c.__module__.startswith("torch.")}
    return next((n for n in _WRAPPERS if n in names), None)


def refuse_wrapped(model: object) -> None:
    """``initialize``'s part: refuse a model that is torch's DDP or FSDP (see the note)."""
    name = wrapper_of(model)
    if name is not None:
        raise ConfigError(f"outcore.initialize: the model is wrapped in {name}: {ADVICE}")


def in_wrapper(files: tuple[str, ...] = _FILES) -> bool:
    """Whether code of ``files`` (DDP's, FSDP's) runs on this thread's stack (see the note)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(files):
            return True
        frame = frame.f_back
    return False


def _wrapping(root: nn.Module) -> str | None:
    """The name of the DDP or FSDP whose ``forward`` on this thread's stack wraps ``root``
    itself; another model's wrapper (a DDP student calling an outcore teacher) is not."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_FILES):
            wrapper = frame.f_locals.get("self")
            if getattr(wrapper, "module", None) is root:
                return type(wrapper).__name__
        frame = frame.f_back
    return None


def refuse_wrapper_call(root: nn.Module) -> None:
    """A forward of ``root`` called through DDP's or FSDP's ``forward``, or ``root`` made an
    FSDP2 module by ``fully_shard`` after ``initialize`` (its class changes; its hooks run
    before outcore's, so no frame of it is left on the stack)."""
    name = wrapper_of(root) or _wrapping(root)
    if name is not None:
        raise ConfigError(f"this model, sharded by outcore, was wrapped in {name} after "
                          f"outcore.initialize: {ADVICE}")


def wrapped_read(label: str) -> str | None:
    """Why a read of parameter ``label`` is refused where DDP or FSDP made it (their
    constructors read every parameter, to broadcast or flatten it): said first, since the
    advice for a read of the user's own (gather it) does not apply; None elsewhere."""
    if not in_wrapper():
        return None
    return (f"DDP or FSDP around a model outcore holds read parameter {label} (wrapping it in "
            f"DistributedDataParallel, or accelerate's prepare(model) at more ranks): {ADVICE}")


_DCP = (os.path.join("torch", "distributed", "checkpoint", "state_dict.py"),)


def dcp_hint() -> str:
    """What a refused ``p.grad`` assignment says where torch.distributed.checkpoint's
    ``get_optimizer_state_dict`` made it: it makes an optimizer's empty state by assigning
    zero gradients and stepping, where outcore's state is made by ``engine.step()``."""
    return (" (here torch.distributed.checkpoint's get/set_optimizer_state_dict made the "
            "call, to create the optimizer's state by a step on zero gradients: outcore's "
            "state exists once engine.step() has run; call it after the first step, or save "
            "and resume with engine.save_checkpoint / engine.load_checkpoint)"
            if in_wrapper(_DCP) else "")


def unengined_read(sp: ShardedParam) -> str | None:
    """Why a read of ``sp`` outside the engine's forward is refused where no engine holds its
    model yet (built under ``outcore.init``, not passed to ``outcore.initialize``): its
    forward at more ranks was refused as a read to make inside ``gathered_parameters``, of
    an engine there is none of. None where an engine holds it."""
    if sp.rt.engine is not None or sp.rt.world_size == 1:
        return None
    return (f"parameter {sp.label()} belongs to a model built under outcore.init that no "
            "engine holds yet: at more ranks its layers are gathered by the engine's hooks, "
            "so pass the model to outcore.initialize before calling it (a frozen model, such "
            "as a teacher, too: its engine trains nothing), or read it inside "
            "outcore.gathered_parameters(model)")
