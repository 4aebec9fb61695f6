"""Full parameters for the user: inspect or modify, then write back to the shards.

Inside the context each chosen parameter's ``.data`` is its full value in fp32 (from the
master shard, so nothing is rounded). With ``modify=True`` the values are cut back into the
shards on exit, on every rank; if the body raises, nothing is written. This is a collective:
every rank must enter it with the same parameters (checked: one small collective), and with
``modify=True`` each rank writes back its own slice of what it wrote, so every rank writes the
same values (checked: [Note: every rank writes the same values]), or names the rank whose
values are kept (``modifier_rank``). Inside, the parameters are SHOWN
(state.py): reads and writes of ``.data`` are plain PyTorch's. With ``modify=False`` a write
on the parameter itself is refused rather than silently discarded; ``.data`` is the plain
shown tensor, whose writes torch does not report, so a write through it is lost on exit.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass

from outcore.errors import ParamAccessError
from outcore.zero.build import value_digest
from outcore.zero.forward_writes import WriteWatch
from outcore.zero.registry import managed
from outcore.zero.state import ParamState

if TYPE_CHECKING:
    from outcore.zero.param import ShardedParam


@contextlib.contextmanager
def gathered_parameters(params: Iterable[nn.Parameter] | nn.Module, modify: bool = False,
                        modifier_rank: int | None = None) -> Iterator[list[nn.Parameter]]:
    """Yield the parameters with their full fp32 values in ``.data``. ``modifier_rank``: the
    rank whose writes are kept, sent to every rank on exit (DeepSpeed's ``GatheredParameters``
    habit); it implies ``modify=True``. See [Note: every rank writes the same values]."""
    modify = modify or modifier_rank is not None
    plist = list(params.parameters()) if isinstance(params, nn.Module) else list(params)
    sps = []
    for p in plist:
        sp = managed(p)
        if sp is not None and sp not in sps:
            sps.append(sp)
    if modifier_rank is not None:
        _check_rank(modifier_rank, sps[0].rt.world_size if sps else 1)
    if sps:  # a forward a KeyboardInterrupt left holds its groups (overlap/abandoned.py)
        sps[0].rt.drop_abandoned()
    for sp in sps:
        if sp.state is ParamState.SHOWN:  # an enclosing context shows it: its .data is there
            raise ParamAccessError(f"gathered_parameters around parameter {sp.label()}, "
                                   "which an enclosing gathered_parameters shows already: use "
                                   "that one (with modify=True to write)")
    if sps and sps[0].rt.world_size > 1:
        _same_on_every_rank(sps, modify)
    if modify and sps:  # its writes could not take in updates this backward applied
        sps[0].rt.before_overwrite("gathered_parameters(modify=True)")
    groups = []
    for sp in sps:
        if sp.group is not None and sp.group not in groups:
            groups.append(sp.group)
    with torch.no_grad():
        for g in groups:
            g.await_update()  # the step may have returned with updates still running
            g.reshard()
            g.hide_resident()
    shown: list[ShardedParam] = []
    lost: list[ShardedParam] | None = []
    ok = False
    # a write through p.data or p.detach() is past the refusals: found by its version on exit
    # (forward_writes.py's note), where modify=False discards it
    watch, outer = WriteWatch(sps, every=True), sps[0].rt.write_watch if sps else None
    try:
        with torch.no_grad():
            for sp in sps:
                sp.show_user(sp.gather_values(), modify)
                shown.append(sp)
        if sps and not modify:
            sps[0].rt.write_watch = watch
            watch.begin()
        raised = True
        try:
            yield plist
            raised = False
        finally:  # every rank learns whether a body raised before the exit's collectives
            if sps and sps[0].rt.world_size > 1 and sps[0].rt.comm.any_failed(raised) and (
                    not raised):
                raise ParamAccessError("gathered_parameters: the block raised on another rank "
                                       "(see its error); nothing was written back on any rank")
        if modify and sps and sps[0].rt.world_size > 1:  # before anything is written back
            _writes_alike(sps, modifier_rank)
        ok = True
        lost = watch.written_anywhere(sps[0].rt.comm, "gathered") if sps and not modify else []
    finally:
        if sps:
            sps[0].rt.write_watch = outer
            if outer is not None:  # within a forward: these writes are the user's own
                outer.rebase(sps)
        with torch.no_grad():
            for sp in shown:
                sp.end_shown(write_back=ok and modify)
            for g in groups:
                g.shown_elsewhere()
    if lost or lost is None:
        raise ParamAccessError(
            f"parameter {lost[0].label() if lost else 'of another rank'} was written inside "
            "gathered_parameters(modify=False) through p.data or p.detach(), and the write "
            "was discarded on exit; pass modify=True to keep it")


# [Note: every rank writes the same values]
# On exit each rank cuts its own slice from the values it holds, so a parameter whose ranks
# wrote different values kept a piece of each: DeepSpeed's habit of writing on rank 0 alone
# (``GatheredParameters(p, modifier_rank=0)``, transformers' init and resize under it) left
# half a tensor new and half old at 2 ranks, with no word. So with ``modify=True`` the ranks
# compare a digest of each parameter's values (build.py's ``value_digest``, the one
# ``initialize`` compares the ranks' models by) and refuse a difference before anything is
# written back, naming the parameter; or, given ``modifier_rank``, that rank's values are
# broadcast first.


def _check_rank(rank: int, world: int) -> None:
    """A ``modifier_rank`` that is a rank of this job."""
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise ParamAccessError(f"gathered_parameters: modifier_rank={rank!r} is not a rank of "
                               f"this job (0 to {world - 1})")


def _writes_alike(sps: list[ShardedParam], source: int | None) -> None:
    """Every rank's written values the same, or refused (see the note)."""
    comm = sps[0].rt.comm
    with DisableTorchFunctionSubclass():
        shown = [sp.param.data for sp in sps]
    if source is not None:
        for t in shown:
            comm.broadcast(t, source)
        return
    same = comm.alike([value_digest(t) for t in shown])
    differ = [sp.label() for sp, alike in zip(sps, same, strict=True) if not alike]
    if differ:
        raise ParamAccessError(
            f"gathered_parameters(modify=True): the ranks wrote different values (compared bit "
            f"for bit) into "
            f"parameter {differ[0]}{f' (and {len(differ) - 1} more)' if len(differ) > 1 else ''}"
            ": each rank writes back its own slice of what it holds, so the parameter would "
            "keep a piece of each rank's values; nothing was written. Write the same values on "
            "every rank, or pass modifier_rank=0 to keep rank 0's (DeepSpeed's "
            "GatheredParameters(..., modifier_rank=0))")


def _same_on_every_rank(sps: list[ShardedParam], modify: bool) -> None:
    """Refuse, on every rank together, ranks that ask for different parameters: the
    all-gathers would pair one rank's slices with another parameter's (the same sizes gave
    each rank wrong values, silently; other sizes killed a rank inside gloo, SIGABRT)."""
    asked = ", ".join(f"{sp.label()} ({sp.numel})" for sp in sps)
    if not sps[0].rt.comm.alike([zlib.crc32(f"{modify} {asked}".encode())])[0]:
        raise ParamAccessError(
            f"gathered_parameters: the ranks asked for different parameters or modify values "
            f"(this rank's: {asked[:300]}, modify={modify}); it is a collective: every rank "
            "enters it with the same parameters, in the same order")
