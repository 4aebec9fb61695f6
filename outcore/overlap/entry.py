"""Calls that reach the model without going through the engine: ``model(...)``, ``generate()``.

[Note: direct calls are engine calls]
Hugging Face ``generate()``, an evaluation loop written for the plain model, or a library that
holds on to the model object call ``model(...)`` directly, not ``engine(...)``. The per-module
hooks would still fetch each module's own weights, but nothing would open the forward context:
parameters read outside their module would not be fetched, and the schedule would not see
where one forward ends and the next begins. So the engine hooks its *entry modules*: the root
it wraps and, for a PEFT model, the Hugging Face model inside it (``get_base_model()``), which
is what PEFT's ``generate()`` calls once per token. A call of an entry module that is not
already inside a forward opens the context and closes it when the call returns (or raises); a
call inside one (the engine's own, or PEFT's forward calling the inner model) changes nothing.
Each decoding step of ``generate()`` is therefore one forward, fetching each module's weights
as it runs and releasing them after, so generation never gathers the whole model.

[Note: every rank runs the same number of forwards]
With several ranks each forward's all-gathers are collectives, so a rank whose sequences end
early must keep calling the model until every rank is done, or the others hang. Hugging Face
``generate()`` does that with ``synced_gpus=True``, which it turns on by itself only for
DeepSpeed ZeRO-3 and FSDP. At world size > 1 the engine therefore wraps the entry modules'
``generate`` (on the instance, as FSDP2's ``register_fsdp_forward_method`` does) so that
``synced_gpus`` defaults to True; an explicit ``synced_gpus`` is passed through. ``close()``
puts the original method back.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from torch import nn


def entry_modules(module: nn.Module) -> list[nn.Module]:
    """The root and, for a PEFT model, the Hugging Face model it wraps."""
    entries = [module]
    base = getattr(module, "get_base_model", None)
    if callable(base):
        inner = base()
        if isinstance(inner, nn.Module) and inner is not module:
            entries.append(inner)
    return entries


class EntryHooks:
    """Opens a forward context around direct calls of the entry modules (see the notes)."""

    def __init__(self, modules: list[nn.Module], is_inside: Callable[[], bool],
                 context: Callable[[], contextlib.AbstractContextManager],
                 synced_generate: bool) -> None:
        self._is_inside = is_inside
        self._context = context
        self._open: list[contextlib.AbstractContextManager | None] = []
        self._handles = []
        self._patched: list[nn.Module] = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._pre, prepend=True))
            self._handles.append(m.register_forward_hook(self._post, always_call=True))
            if synced_generate and callable(getattr(m, "generate", None)):
                self._patch_generate(m)

    def _pre(self, module: nn.Module, args: tuple) -> None:
        if self._is_inside():
            self._open.append(None)
            return
        cm = self._context()
        cm.__enter__()
        self._open.append(cm)

    def _post(self, module: nn.Module, args: tuple, output: object) -> None:
        cm = self._open.pop()
        if cm is not None:
            cm.__exit__(None, None, None)

    def _patch_generate(self, module: nn.Module) -> None:
        original = module.generate

        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("synced_gpus", True)
            return original(*args, **kwargs)

        module.generate = generate  # an instance attribute: the class stays untouched
        self._patched.append(module)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m in self._patched:
            with contextlib.suppress(AttributeError):
                del m.generate
        self._patched.clear()
