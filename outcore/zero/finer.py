"""A write of what a read gave, untouched, keeps the master's finer values.

[Note: a write of what a read gave keeps the master]
In a 16-bit run a parameter reads, between steps, as its training copy: ``p.dtype`` is the
compute dtype (as under DeepSpeed), and ``p.detach()`` and ``model.state_dict()`` hold the
master rounded to it. Written back as they are (``model.load_state_dict(model.state_dict())``
in a callback, ``p.copy_(p.detach())``), those values replaced the fp32 master, which lost
what the rounding dropped: every such write moved the weights a 16-bit step (2.5e-3 on a
small Llama in bf16) although nothing had changed. So each tensor such a read gives (one
rank, between steps, a 16-bit parameter) is noted with its version counter, and a write of
the whole parameter from that very tensor, unmodified since, is not made. Anything else
is written as given: a tensor computed from the read (a clamp, a projection, an EMA), even
where it rounds to what a read shows, replaces the master, or a constraint written with
``copy_`` would be undone by the master's finer value (tried first: keeping every element
equal at the parameter's precision did that). Nothing of this applies in fp32, where the
master is what a read shows.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from outcore.runtime.phase import Phase

if TYPE_CHECKING:
    from outcore.zero.param import ShardedParam

_READS: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[ShardedParam], int]] = {}
"""Tensors reads gave, by ``id``: the tensor and its parameter (weakly: a kept copy must not
keep an engine and its swap alive), the tensor's version then."""


def noted(func: Any, found: list[Any], out: Any) -> Any:
    """``out``, a read's result; noted where it is a 16-bit parameter's whole value
    (``p.detach()``, what ``state_dict()`` holds) at one rank."""
    if (func is torch.Tensor.detach and len(found) == 1 and not found[0].chain
            and isinstance(out, torch.Tensor) and out.dtype != torch.float32
            and (sp := found[0].sp) is not None and sp.rt.world_size == 1
            and sp.rt.phase is Phase.IDLE):  # (a forward's reads are its own)
        key = id(out)
        _READS[key] = (weakref.ref(out, _forget(key)), weakref.ref(sp), out._version)
    return out


def _forget(key: int) -> Any:
    """A weakref callback that drops ``key`` once its tensor is gone (its id may be reused)."""
    return lambda _: _READS.pop(key, None)


def source_of(func: Any, args: tuple[Any, ...], chain: object) -> object:
    """The tensor an in-place call writes the whole parameter from: ``copy_``'s source
    (``load_state_dict`` copies each value in so); None for any other call or a view."""
    return args[1] if func is torch.Tensor.copy_ and len(args) > 1 and not chain else None


def unchanged(sp: ShardedParam, source: object) -> bool:
    """Whether writing ``source`` into ``sp`` writes back a read of it, unmodified since: a
    write that changes nothing, so none is made (see the note)."""
    entry = _READS.get(id(source))
    return (entry is not None and entry[0]() is source and entry[1]() is sp
            and isinstance(source, torch.Tensor) and source._version == entry[2])
