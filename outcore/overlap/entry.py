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
call inside one (PEFT's forward calling the inner model) changes nothing. The call that opens
the context also moves tensor inputs to the compute device and casts floating ones to the
compute dtype, as FSDP2's root moves and casts its forward inputs, so ``model(x)`` computes
exactly what ``engine(x)`` computes: ``engine(x)`` is ``model(x)``. A model built on the CPU
and trained on a GPU thus takes the loader's CPU batches as they are; its outputs are on the
GPU, as a plain model moved there would give them.
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
import types
import typing
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn
from torch._C import DisableTorchFunctionSubclass

from outcore.overlap.compiled import uncompiled
from outcore.overlap.hooks import inert_copy
from outcore.zero.shared_reads import sharing

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

Inputs = tuple[tuple[object, ...], dict[str, object]]
"""A call's positional and keyword inputs, as a forward pre-hook with kwargs sees them."""


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

    inert = False  # a deep copy's (hooks.py's Hooks.__deepcopy__)

    def __deepcopy__(self, memo: dict[int, object]) -> EntryHooks:
        return inert_copy(type(self))

    def __reduce__(self) -> tuple[Callable[[type[EntryHooks]], EntryHooks],
                                  tuple[type[EntryHooks]]]:
        return (inert_copy, (type(self),))

    def __init__(self, modules: list[nn.Module], is_inside: Callable[[], bool],
                 context: Callable[[], contextlib.AbstractContextManager[object]],
                 synced_generate: bool, cast: Callable[[Inputs], Inputs] | None = None,
                 on_zero_grad: Callable[[bool], None] | None = None, rt: Any = None) -> None:
        """``cast``: applied to the positional and keyword inputs of a call that opens the
        context (moved to the compute device, floating ones cast to the compute dtype).
        ``on_zero_grad``: called by the root's ``zero_grad()`` (gradients live in the engine's
        shards, which torch's ``Module.zero_grad`` cannot see); it drops every ``p.grad`` too
        (``drop_grads``), so only a class's own ``zero_grad`` runs after it. ``rt``:
        the runtime whose reads the root's ``state_dict()`` shares (shared_reads.py)."""
        self._is_inside = is_inside
        self._context = context
        self._cast = cast
        self._open: list[contextlib.AbstractContextManager[object] | None] = []
        self._handles: list[RemovableHandle] = []
        self._patched: list[nn.Module] = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._pre, prepend=True,
                                                             with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post, always_call=True))
            if synced_generate and callable(getattr(m, "generate", None)):
                self._patch_generate(m)
        if on_zero_grad is not None:
            self._patch_zero_grad(modules[0], on_zero_grad)
        for m in modules if rt is not None else ():  # a PEFT model's base model too
            self._patch_state_dict(m, rt)

    @uncompiled  # compiled.py's [Note: hooks run outside a compiled graph]
    def _pre(self, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
             ) -> Inputs | None:
        if self.inert:
            return None
        if self._is_inside():
            self._open.append(None)
            return None
        self.abandon()  # what a KeyboardInterrupt left open (overlap/abandoned.py)
        cm = self._context()
        # the post hook runs even when entering fails, and pops this entry, not an outer one
        self._open.append(None)
        cm.__enter__()
        self._open[-1] = cm
        return self._cast((args, kwargs)) if self._cast is not None else None

    @uncompiled  # compiled.py's [Note: hooks run outside a compiled graph]
    def _post(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if self.inert:
            return
        cm = self._open.pop()
        if cm is not None:
            cm.__exit__(None, None, None)

    def _patch_generate(self, module: nn.Module) -> None:
        # a Hugging Face model's method, which torch's Module.__getattr__ stub cannot know
        original = typing.cast("Callable[..., object]", module.generate)

        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any) -> object:
            kwargs.setdefault("synced_gpus", True)
            return original(*args, **kwargs)

        # an instance attribute: the class stays untouched. torch's stub types
        # Module.__setattr__ for tensors and modules only; any value is accepted
        module.generate = generate  # type: ignore[assignment]
        self._patched.append(module)

    def _patch_zero_grad(self, module: nn.Module, on_zero_grad: Callable[[bool], None]) -> None:
        root = weakref.ref(module)

        def zero_grad(this: nn.Module, set_to_none: bool = True) -> None:
            if this is root():  # not a deep copy of the model, which has no engine
                on_zero_grad(set_to_none)  # first: the engine's shards, then every p.grad
                if set_to_none and type(this).zero_grad is nn.Module.zero_grad:
                    return None  # torch's would walk the parameters again, to no effect
            # the class's own (which may reset more: a user's probe found it never called)
            type(this).zero_grad(this, set_to_none)

        # an instance attribute shadowing the method on purpose: the class stays untouched
        module.zero_grad = types.MethodType(zero_grad, module)  # type: ignore[method-assign]
        self._patched.append(module)

    def _patch_state_dict(self, module: nn.Module, rt: Any) -> None:
        root = weakref.ref(module)

        def state_dict(this: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if this is not root():  # a deep copy of the model: a plain model
                return type(this).state_dict(this, *args, **kwargs)
            with sharing(rt):  # shared_reads.py's [Note: one copy per parameter in a ...]
                return type(this).state_dict(this, *args, **kwargs)

        module.state_dict = types.MethodType(state_dict, module)  # type: ignore[method-assign]
        self._patched.append(module)

    def abandon(self) -> None:
        """Exit the contexts of calls that ended without their post hook (a
        ``KeyboardInterrupt``: abandoned.py's note), innermost first."""
        while self._open:
            cm = self._open.pop()
            if cm is not None:
                cm.__exit__(None, None, None)

    def remove(self) -> None:
        self.abandon()  # (closing right after a Ctrl-C left a forward)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m in self._patched:
            for name in ("generate", "zero_grad", "state_dict"):
                if name in m.__dict__:
                    delattr(m, name)
        self._patched.clear()


def drop_grads(module: nn.Module) -> None:
    """Set every ``p.grad`` of ``module`` to None, as torch's ``zero_grad()`` does (a
    backward's before ``initialize``, a penalty term's): read past the parameters' dispatch,
    which answers each ``p.grad`` by a Python call (Module.zero_grad took 30 ms on 2,000).
    Not the model's own ``zero_grad`` (torch's ``optimizer.zero_grad()`` calls none)."""
    with DisableTorchFunctionSubclass():
        for p in module.parameters():
            if p.grad is not None:
                p.grad = None
