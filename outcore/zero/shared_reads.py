"""A tied parameter is one tensor in a state dict, as in torch.

[Note: one copy per parameter in a state dict]
torch's ``state_dict()`` holds ``param.detach()`` under each name of a tied parameter:
tensors sharing one storage, which ``save_pretrained`` and safetensors recognise as one
and write once. A read of a parameter outcore holds is a copy of its values, so each name
got a copy of its own: ``model.save_pretrained`` wrote a tied head as a second
vocabulary-sized tensor (found by a user's probe), and the state dict held two copies in
memory. So while the model's ``state_dict()`` runs (``sharing``, around the root's and a
PEFT model's base model's: overlap/entry.py), the first read of each parameter that torch's
``_save_to_state_dict`` makes is kept, and each later one is a view of that copy, sharing
its storage and version counter as torch's detached tensors share the parameter's
(zero/finer.py's note then sees a write of either as a write of the read). Any other read
(a state-dict hook's), and every read outside that call, is a new copy, as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from outcore.zero.calls import called_from

_SAVE = nn.Module._save_to_state_dict.__code__


def _whole(func: Any, found: list[Any]) -> Any:
    """The ShardedParam of a ``p.detach()`` that torch's ``_save_to_state_dict`` makes while
    a state dict is made, else None: any other read then (a state-dict hook's, which may
    write into what it gets) is a copy of its own, as outside."""
    if func is not torch.Tensor.detach or len(found) != 1 or found[0].chain:
        return None
    sp = found[0].sp
    if sp is None or sp.rt.shared_reads is None:
        return None
    return sp if called_from(_SAVE) else None  # (torch's call, seen through access.py)


def kept(func: Any, found: list[Any]) -> torch.Tensor | None:
    """A view of the copy an earlier read of this parameter gave in this state dict, unless
    that copy was written since (an entry changed in place by a hook: in torch that would
    write the parameter, here only the copy, which the later names must not show)."""
    sp = _whole(func, found)
    first: tuple[torch.Tensor, int] | None = (
        sp.rt.shared_reads.get(id(sp)) if sp is not None else None)
    if first is None or first[0]._version != first[1]:
        return None
    return first[0].detach()


def keep(func: Any, found: list[Any], out: Any) -> Any:
    """``out``, a read's result, kept (with its version) for the later names of its
    parameter."""
    if (sp := _whole(func, found)) is not None and isinstance(out, torch.Tensor):
        sp.rt.shared_reads.setdefault(id(sp), (out, out._version))
    return out


@contextlib.contextmanager
def sharing(rt: Any) -> Iterator[None]:
    """Reads share one copy per parameter while this is open (the outermost one decides)."""
    outer = rt.shared_reads is None
    if outer:
        rt.shared_reads = {}
    try:
        yield
    finally:
        if outer:
            rt.shared_reads = None
