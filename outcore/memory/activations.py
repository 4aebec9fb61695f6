"""Activation checkpointing and offloading of chosen blocks.

``checkpoint_activations(model, Block, offload="nvme", engine)`` makes every matching block
keep only its inputs for backward and recompute everything else when backward reaches it.
The kept inputs (the checkpoints) stay in memory (``"none"``), go to host memory
(``"cpu"``: a device-to-host copy on CUDA, nothing at all on the CPU, where they already
are), or go to this rank's NVMe swap store through the I/O engine (``"nvme"``).
``offload_activations(model, Block, to="nvme")`` recomputes nothing: every tensor a matching
block saves goes there instead (a block run under our pair alone, item 2 below, without
checkpoint's). The model class is not edited: each block's ``forward`` is replaced by a
wrapper on the instance.

[Note: how the saved-tensor hooks nest]
PyTorch applies only the innermost active ``saved_tensors_hooks`` pair to a saved tensor. In a
training step three pairs are stacked, outermost first:

1. The engine's pair (saved.py's ``pack``, hooks.py's ``_unpack``), around the whole
   forward: a saved tensor that is (a view of) a parameter's storage is kept as its
   parameter, so backward re-fetches a released group.
2. Ours, around the ``torch.utils.checkpoint.checkpoint`` call of one block only. Checkpoint
   saves the block's tensor inputs (``_CheckpointFrame.save_inputs``) *before* it enters its
   own pair, so exactly those inputs, and nothing else, are packed by us: to host or NVMe.
   A saved input that lives in parameter storage is handed to the pair that was active when we
   entered (the engine's, captured at that moment: torch has no public getter, so this uses
   ``torch._C._autograd._top_saved_tensors_default_hooks``), so re-fetching keeps working.
3. Checkpoint's own pair (``_checkpoint_hook``), around the block's forward: every tensor the
   block saves becomes an empty holder, so neither we nor the engine ever see the block's
   internal activations, and weight views are not kept either.

In backward the first holder unpacked triggers the recomputation under checkpoint's
``_recomputation_hook``, which stores recomputed tensors (weight views included) straight
into the holders; our unpack runs once per input, before that, to bring it back.

[Note: recomputation runs under the engine's hooks]
Checkpoint re-runs the function it was given. We give it a function that, on the first call
(the forward), runs the block's original forward, and on later calls (recomputations in
backward) calls the *module* again, so its forward pre/post hooks fire: the engine fetches the
block's own parameter group (its children fetch theirs anyway), and since the engine is in
backward, post-forward hooks leave the groups gathered until their gradients are reduced. The
engine's parameter-access mode (found on the mode stack during the block's forward) is active
during recomputation too, so a parameter used outside its module inside a block is fetched as
in forward. A user's own forward hooks on a block therefore also run again when it is
recomputed, as with torch's checkpoint wrapper. A block inside another checkpointed block is
not checkpointed again: the outer recomputation already covers it.

Tensors on NVMe, checkpoints or all of an offloaded block's: saved_disk.py's [Note: saved
tensors on NVMe].
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, get_args

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint

from outcore.config import Placement
from outcore.engine import Engine
from outcore.errors import ConfigError, EngineClosedError
from outcore.memory.saved_disk import SavedOnDisk
from outcore.overlap.saved import Kept
from outcore.runtime import Runtime
from outcore.zero.access_mode import ParamAccessMode
from outcore.zero.registry import managed, owner

Offload = Placement  # the same three places as the offload config
BlockSpec = type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[str, nn.Module], bool]


def checkpoint_activations(model: nn.Module, blocks: BlockSpec, offload: Offload = "cpu",
                           engine_or_runtime: Engine | Runtime | None = None) -> int:
    """Checkpoint every submodule of ``model`` matching ``blocks``; return how many.

    ``blocks`` is a module class, a tuple of classes, or a predicate ``(name, module) -> bool``
    over ``model.named_modules()``. ``offload`` says where the kept block inputs wait for
    backward (see the module docstring). ``engine_or_runtime`` gives the swap store for
    ``"nvme"`` (by default the runtime of the model's outcore parameters, found at first use;
    its config needs ``offload.nvme_path``). Call it before or after ``outcore.initialize``;
    calling it (or ``offload_activations``) again on a block replaces that block's settings.
    Gradients are those of the model without checkpointing; a block must compute the same way
    when re-run (dropout is fine: the RNG state is restored), so a block that updates a cache
    must run without it.
    """
    if offload not in get_args(Placement):
        raise ValueError(f"offload must be 'none', 'cpu' or 'nvme', got {offload!r}")
    return _wrap(model, blocks, _Place.create(offload, model, engine_or_runtime, False), True)


def offload_activations(model: nn.Module, blocks: BlockSpec, to: Offload = "nvme",
                        engine_or_runtime: Engine | Runtime | None = None) -> int:
    """Keep what every submodule of ``model`` matching ``blocks`` saves for backward at ``to``
    instead of in memory, recomputing nothing; return how many blocks.

    [Note: offloaded activations against checkpointed ones]
    Checkpointing keeps a block's input and pays for the rest with its forward again in
    backward; offloading keeps everything and pays with the disk: each saved tensor written in
    forward, where the disk has little else to do, and read back a block ahead of backward
    (saved_disk.py). On gpt-335m with everything on NVMe, 2 cores (bench/results, 2026-11-28,
    Zen 5): at 2048 tokens offloading every block took 1.3-1.4 GiB off the peak for 5-7% a
    step, checkpointing 1.5 GiB for 18-22%; at 512 tokens, where the optimizer's transfers
    keep the disk busy through backward, both cost about the same. Where compute is long
    against the disk, offload; where the disk is the bound already (a short sequence, a frozen
    base streamed every step), the bytes it adds cost more than the recomputation.

    ``to`` is ``"nvme"`` (this rank's swap file, through the I/O engine: needs
    ``offload.nvme_path``), ``"cpu"`` (pinned host memory on CUDA; on a CPU device the
    activations are in host memory already and nothing changes) or ``"none"``: the blocks run
    as they came, neither offloaded nor checkpointed. Tensors in parameter storage stay where
    the engine keeps them, and tensors under 128 KiB stay in memory. ``engine_or_runtime`` as
    for ``checkpoint_activations``; calling either function again on a block replaces its
    settings. A block nested in an offloaded or checkpointed one is covered by that one.
    Gradients are those of the model as it came, bit for bit.
    """
    if to not in get_args(Placement):
        raise ValueError(f"to must be 'none', 'cpu' or 'nvme', got {to!r}")
    if to == "none":
        return _wrap(model, blocks, None, False)
    return _wrap(model, blocks, _Place.create(to, model, engine_or_runtime, True), False)


def _wrap(model: nn.Module, blocks: BlockSpec, place: _Place | None, recompute: bool) -> int:
    """Give every matching block its wrapper (``place`` None: its own forward back)."""
    match = _matcher(blocks)
    count = 0
    for name, m in model.named_modules():
        if match(name, m):
            current = m.__dict__.get("forward")
            if isinstance(current, _BlockForward):
                original, own = current.original, current.own
            else:  # own: a forward set on the instance (another library's wrapper) before us
                original, own = m.forward, current is not None
            if place is not None:
                m.forward = _BlockForward(m, original, place, recompute, own)
            elif own:
                m.forward = original
            elif isinstance(current, _BlockForward):
                del m.forward  # the class's forward again
            count += 1
    return count


def _matcher(blocks: BlockSpec) -> Callable[[str, nn.Module], bool]:
    if isinstance(blocks, type) or (isinstance(blocks, tuple) and blocks
                                    and all(isinstance(b, type) for b in blocks)):
        return lambda name, m: isinstance(m, blocks)
    if callable(blocks):
        return blocks
    raise TypeError("blocks must be a module class, a tuple of classes, or a predicate "
                    f"(name, module) -> bool; got {blocks!r}")


# Depth of checkpointed blocks being run on this thread (forward or recomputation). Autograd
# runs a recomputation on the thread executing backward, so a thread-local is the right scope.
_ACTIVE = threading.local()


@contextlib.contextmanager
def _inside_block() -> Iterator[None]:
    _ACTIVE.depth = getattr(_ACTIVE, "depth", 0) + 1
    try:
        yield
    finally:
        _ACTIVE.depth -= 1


class _BlockForward:
    """A block's replacement ``forward``: checkpoint the original, offloading its inputs
    (``recompute``), or run it with everything it saves offloaded."""

    def __init__(self, module: nn.Module, original: Callable[..., Any], place: _Place,
                 recompute: bool, own: bool) -> None:
        self._module = weakref.ref(module)  # the module holds us: no reference cycle
        self.original, self.place, self.recompute, self.own = original, place, recompute, own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(_ACTIVE, "depth", 0) or not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        if not self.recompute:  # offload_activations: everything saved goes to the place
            with self.place.hooks((*args, *kwargs.values())), _inside_block():
                return self.original(*args, **kwargs)
        # keyword tensors become positional so that checkpoint saves (and we offload) them too
        names, nargs = tuple(kwargs), len(args)
        mode, first = _access_mode(), True

        def run(*flat: Any) -> Any:
            nonlocal first
            a, kw = flat[:nargs], dict(zip(names, flat[nargs:], strict=True))
            with _inside_block():
                if first:
                    first = False
                    return self.original(*a, **kw)
                module = self._module()
                assert module is not None
                with mode if mode is not None else contextlib.nullcontext():
                    return module(*a, **kw)  # hooks fire; our __call__ sees depth > 0

        flat = (*args, *kwargs.values())
        with self.place.hooks(flat):
            return checkpoint(run, *flat, use_reentrant=False)


def _access_mode() -> ParamAccessMode | None:
    """The engine's parameter-access mode, if this forward runs under it."""
    for m in reversed(_get_current_function_mode_stack()):
        if isinstance(m, ParamAccessMode):
            return m
    return None


class _Place:
    """Where a block's saved tensors wait for backward (``none``: as they are)."""

    @staticmethod
    def create(offload: Offload, model: nn.Module, source: Any, keep_small: bool) -> _Place:
        if not (source is None or isinstance(source, (Engine, Runtime))):
            raise TypeError("engine_or_runtime must be an outcore Engine or Runtime (or None), "
                            f"got {type(source).__name__}")
        if offload == "nvme":
            return _ToDisk(model, source, keep_small)
        return _ToHost() if offload == "cpu" else _Place()

    def hooks(self, inputs: tuple) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


# torch has no public getter for the active pair; without it parameter storage stays in place
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


class _Outer:
    """A parameter-storage tensor handed to the hooks that were active outside ours (without
    any, kept as it is and checked at unpack: overlap/saved.py's note)."""

    __slots__ = ("packed", "unpack")

    def __init__(self, t: torch.Tensor, outer: tuple[Callable, Callable] | None) -> None:
        self.packed, self.unpack = (outer[0](t), outer[1]) if outer else (Kept(t), Kept.get)


class _Offloading(_Place):
    """Saved-tensor hooks that move activations and pass parameter storage outward."""

    def hooks(self, inputs: tuple) -> contextlib.AbstractContextManager:
        # the pair active now (the engine's) is the one parameter storage must still go through
        outer = _top_hooks(False) if _top_hooks is not None else None

        def pack(t: torch.Tensor) -> Any:
            # a gathered layer's storage, or a parameter shown as it is (a resident copy, a
            # persistent or unmanaged one): kept as the engine keeps it, never copied
            if owner(t) is not None or isinstance(t if t._base is None else t._base,
                                                  nn.Parameter):
                return _Outer(t, outer)
            return self.pack(t)

        def unpack(x: Any) -> torch.Tensor:
            return x.unpack(x.packed) if type(x) is _Outer else self.unpack(x)

        stack = contextlib.ExitStack()
        stack.enter_context(self.segment())
        stack.enter_context(saved_tensors_hooks(pack, unpack))
        return stack

    def segment(self) -> contextlib.AbstractContextManager:
        """One block call (saved_disk.py reads back a block ahead)."""
        return contextlib.nullcontext()

    def pack(self, t: torch.Tensor) -> Any:
        raise NotImplementedError

    def unpack(self, x: Any) -> torch.Tensor:
        raise NotImplementedError


class _ToHost(_Offloading):
    """Device tensors to (pinned) host memory; host tensors are left alone, never copied."""

    def hooks(self, inputs: tuple) -> contextlib.AbstractContextManager:
        if not any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in inputs):
            return contextlib.nullcontext()  # already in host memory: plain checkpoint
        return super().hooks(inputs)

    def pack(self, t: torch.Tensor) -> Any:
        if t.device.type == "cpu" or t.layout is not torch.strided:
            return Kept(t)
        host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return (t.device, host)

    def unpack(self, x: Any) -> torch.Tensor:
        if type(x) is Kept:
            return x.get()
        device, host = x
        return host.to(device, non_blocking=True)


class _ToDisk(_Offloading):
    """Saved tensors in the rank's swap file (saved_disk.py's [Note: saved tensors on NVMe])."""

    def __init__(self, model: nn.Module, source: Any, keep_small: bool) -> None:
        self._model = weakref.ref(model)
        self._found = source is None  # the runtime is the model's: found again after close()
        self._rt: Runtime | None = source.rt if isinstance(source, Engine) else source
        self._saver: SavedOnDisk | None = None
        self._keep_small = keep_small
        if self._rt is not None:
            _check_nvme_path(self._rt)

    def saver(self) -> SavedOnDisk:
        if self._found and self._rt is not None and self._rt.closed:  # a second engine's now
            self._rt = self._saver = None
        if self._saver is None:
            if self._rt is None:
                model = self._model()
                sp = next((s for p in model.parameters() if (s := managed(p))), None) \
                    if model else None
                if sp is None:
                    raise ValueError("offload='nvme' needs an outcore runtime: pass the engine "
                                     "(or runtime) to checkpoint_activations or "
                                     "offload_activations, or use an outcore model")
                _check_nvme_path(sp.rt)
                self._rt = sp.rt
            self._saver = SavedOnDisk(self._rt, self._keep_small)
        return self._saver

    def segment(self) -> contextlib.AbstractContextManager:
        return self.saver().segment()

    def pack(self, t: torch.Tensor) -> Any:
        return self.saver().pack(t)

    def unpack(self, x: Any) -> torch.Tensor:
        return self.saver().unpack(x)


def _check_nvme_path(rt: Runtime) -> None:
    if rt.closed:
        raise EngineClosedError("offload='nvme' for activations needs an open engine: this "
                                "one is closed")
    if rt.cfg.offload.nvme_path is None:
        raise ConfigError("offload='nvme' for activations needs offload.nvme_path in the config")
