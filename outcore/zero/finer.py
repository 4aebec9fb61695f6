"""A write at the training copy's precision keeps the master's finer values.

[Note: a write of what a read gave keeps the master]
In a 16-bit run a parameter reads, between steps, as its training copy: ``p.dtype`` is the
compute dtype (as under DeepSpeed), and ``p.detach()`` and ``model.state_dict()`` hold the
master rounded to it. Written back as they are (``model.load_state_dict(model.state_dict())``
in a callback, ``p.copy_(p.detach())``, an EMA or a partial reload that copies most values
through unchanged), those values replaced the fp32 master, which lost what the rounding
dropped: every such write moved the weights a 16-bit step (2.5e-3 on a small Llama in bf16)
although no value the user sees had changed. So a write whose source carries no more than
the parameter's own precision (a tensor of that dtype) keeps each element's master wherever
the written value equals the master at that precision; an element the write changes takes
the new value, and a source of more precision (an fp32 checkpoint) is written exactly, as a
fine-tune's small changes over its base must be. Nothing of this applies in fp32, where the
master is what a read shows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from outcore.zero.param import ShardedParam


def source_of(func: Any, args: tuple[Any, ...]) -> object:
    """The tensor an in-place call writes from: ``copy_``'s source (``load_state_dict``
    copies each value in so); None for any other call, whose result is new values."""
    return args[1] if func is torch.Tensor.copy_ and len(args) > 1 else None


def keep_finer(sp: ShardedParam, full: torch.Tensor, source: object,
               dtype: torch.dtype) -> torch.Tensor:
    """``full`` (the parameter's new fp32 values) with the master kept where ``source``, a
    write's source, has ``dtype``, the parameter's, and the new value equals the master at
    that precision (see the note). At more ranks only this rank's slice counts."""
    if dtype == torch.float32 or not isinstance(source, torch.Tensor) or source.dtype != dtype:
        return full
    master = sp.local_values() if sp.rt.world_size > 1 else sp.read_value(exact=True)
    return torch.where(full.to(dtype) == master.to(dtype), master, full)
