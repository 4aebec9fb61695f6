"""A tied parameter is one tensor in a state dict, as in torch.

[Note: one copy per parameter in a state dict]
torch's ``state_dict()`` holds ``param.detach()`` under each name of a tied parameter:
tensors sharing one storage, which ``save_pretrained`` and safetensors recognise as one
and write once. A read of a parameter outcore holds is a copy of its values, so each name
got a copy of its own: ``model.save_pretrained`` wrote a tied head as a second
vocabulary-sized tensor (found by a user's probe), and the state dict held two copies in
memory. So while the root module's ``state_dict()`` runs (``sharing``, around it:
overlap/entry.py), the first read of each parameter is kept, and each later read of it is
a view of that copy, sharing its storage and version counter as torch's detached tensors
share the parameter's (zero/finer.py's note then sees a write of either as a write of the
read). Outside that call every read is a new copy, as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _whole(func: Any, found: list[Any]) -> Any:
    """The ShardedParam of a ``p.detach()`` while a state dict is made, else None."""
    if func is not torch.Tensor.detach or len(found) != 1 or found[0].chain:
        return None
    sp = found[0].sp
    return sp if sp is not None and sp.rt.shared_reads is not None else None


def kept(func: Any, found: list[Any]) -> torch.Tensor | None:
    """A view of the copy an earlier read of this parameter gave in this state dict."""
    sp = _whole(func, found)
    first = sp.rt.shared_reads.get(id(sp)) if sp is not None else None
    return first.detach() if first is not None else None


def keep(func: Any, found: list[Any], out: Any) -> Any:
    """``out``, a read's result, kept for the later names of its parameter."""
    if (sp := _whole(func, found)) is not None and isinstance(out, torch.Tensor):
        sp.rt.shared_reads[id(sp)] = out
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
