"""outcore's own data movement, run outside any tracer or fake-tensor mode.

[Note: fetches are I/O, not model computation]
A tracer or a fake/proxy mode that runs the model runs outcore's hooks too: ``torch.export``
(its proxy and fake-tensor dispatch modes), ``torch.jit.trace`` (its tracing state). What
the hooks do (allocate a full tensor, read shards from disk into it, all-gather, free it) is
real I/O on real tensors: recorded into a trace, it became a graph that replays a ``view`` of
an I/O buffer (a jit trace refused it in its alias analysis) or a collective on this rank's
process group; run under a fake mode, the full tensor's storage was swapped with a meta one
and the fetch failed half-way. So the hooks' own work runs with tracing paused and the
dispatch modes set aside, and the model's computation between the hooks is traced as usual.
Only the state the tracer lives in is touched: outcore's ``ParamAccessMode`` is a torch
*function* mode, suspended by its own counter, and is left on the stack.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["tracer_active", "untraced"]

_PRE_DISPATCH = torch._C.DispatchKey.PreDispatch


def tracer_active() -> bool:
    """Whether a jit trace records or a torch dispatch mode is active (C calls only: the
    hooks ask before each piece of their own work, per module per step). A mode on the
    pre-dispatch stack (``torch.export``'s) puts the PreDispatch key in the thread's set."""
    return (torch._C._get_tracing_state() is not None
            or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._dispatch_tls_is_dispatch_key_included(_PRE_DISPATCH))


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """Run the body with no jit trace recording and no torch dispatch mode active (see the
    note); entered where ``tracer_active()``."""
    tracing = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)  # type: ignore[attr-defined]  # (unstubbed) None pauses
    try:
        with _disable_current_modes():
            yield
    finally:
        torch._C._set_tracing_state(tracing)  # type: ignore[attr-defined]
