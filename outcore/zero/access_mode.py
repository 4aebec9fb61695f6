"""A torch function mode that tells its owner which managed parameter a call is about to read.

The hooks (overlap/hooks.py) use it inside a forward to fetch a parameter that a module reads
outside its own hook (shared weights, a parameter used by its parent); ``outcore.init`` uses
it to materialise a parameter read while the model is still being built; activation
checkpointing finds the active one. It lives in ``zero`` because it knows only parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from outcore.zero.registry import METADATA_CALLS, managed
from outcore.zero.untraced import tracer_active, untraced

if TYPE_CHECKING:
    from outcore.zero.calls import Args, Kwargs
    from outcore.zero.param import ShardedParam


class ParamAccessMode(TorchFunctionMode):
    """Calls ``on_access(sp, func)`` before any torch call that reads a managed parameter."""

    def __init__(self, on_access: Callable[[ShardedParam, object], None]) -> None:
        super().__init__()
        self._on_access = on_access
        self.suspended_depth = 0

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """outcore's own tensor work inside hooks: it must not re-enter the mode's checks,
        what it allocates must not become an inference tensor (a forward under
        ``torch.inference_mode()`` fetches into buffers that training writes later), and a
        tracer must not record it (untraced.py's [Note: fetches are I/O, not model
        computation])."""
        self.suspended_depth += 1
        outside = (torch.inference_mode(False) if torch.is_inference_mode_enabled()
                   else contextlib.nullcontext())  # entering it costs per module per step
        try:
            if tracer_active():
                with outside, untraced():
                    yield
            else:
                with outside:
                    yield
        finally:
            self.suspended_depth -= 1

    def __torch_function__(self, func: Any, types: Iterable[type], args: Args = (),
                           kwargs: Kwargs | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.suspended_depth and func not in METADATA_CALLS:
            for a in _tensor_args(args, kwargs):
                sp = managed(a)
                if sp is not None:
                    self._on_access(sp, func)
        return func(*args, **kwargs)


def _tensor_args(args: Args, kwargs: Kwargs) -> Iterator[object]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a
