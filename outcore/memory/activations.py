"""Activation checkpointing of chosen blocks, with the checkpoints offloaded.

``checkpoint_activations(model, Block, offload="nvme", engine)`` makes every matching block
keep only its inputs for backward and recompute everything else when backward reaches it.
The kept inputs (the checkpoints) stay in memory (``"none"``), go to host memory
(``"cpu"``: a device-to-host copy on CUDA, nothing at all on the CPU, where they already
are), or go to this rank's NVMe swap store through the I/O engine (``"nvme"``). The model
class is not edited: each block's ``forward`` is replaced by a wrapper on the instance.

[Note: how the saved-tensor hooks nest]
PyTorch applies only the innermost active ``saved_tensors_hooks`` pair to a saved tensor. In a
training step three pairs are stacked, outermost first:

1. The engine's pair (hooks.py ``_pack/_unpack``), around the whole forward: a saved tensor
   that is (a view of) a parameter's storage is kept as its parameter, so backward re-fetches
   a released group.
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

[Note: checkpoints on NVMe]
Pack allocates an extent, starts an asynchronous write and returns; the tensor is kept only
until its write completes (an in-place change before then is detected and reported in
backward). Unpack reads the extent into a new aligned buffer; it also starts reading the
checkpoint packed just before, which backward needs next, so that read overlaps this block's
recomputation and backward. The extent is freed when autograd drops what pack returned (after
backward, or with the graph), so nothing stays on disk after a step.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, get_args

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint

from outcore.config import Placement
from outcore.errors import ConfigError
from outcore.offload.buffers import aligned_empty
from outcore.offload.ledger import Kind
from outcore.offload.storage import Tier
from outcore.zero.access_mode import ParamAccessMode
from outcore.zero.registry import managed, owner

if TYPE_CHECKING:
    from outcore.engine import Engine
    from outcore.runtime import Runtime

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
    calling it again on a block replaces that block's settings. Gradients are those of the
    model without checkpointing; a block must compute the same way when re-run (dropout is
    fine: the RNG state is restored), so a block that updates a cache must run without it.
    """
    if offload not in get_args(Placement):
        raise ValueError(f"offload must be 'none', 'cpu' or 'nvme', got {offload!r}")
    match = _matcher(blocks)
    place = _Place.create(offload, model, engine_or_runtime)
    count = 0
    for name, m in model.named_modules():
        if match(name, m):
            current = m.__dict__.get("forward")
            original = current.original if isinstance(current, _Checkpointed) else m.forward
            m.forward = _Checkpointed(m, original, place)
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


class _Checkpointed:
    """A block's replacement ``forward``: checkpoint the original, offloading its inputs."""

    def __init__(self, module: nn.Module, original: Callable[..., Any], place: _Place) -> None:
        self._module = weakref.ref(module)  # the module holds us: no reference cycle
        self.original, self.place = original, place

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(_ACTIVE, "depth", 0) or not torch.is_grad_enabled():
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
    """Where a checkpointed block's saved inputs wait for backward (``none``: as they are)."""

    @staticmethod
    def create(offload: Offload, model: nn.Module, source: Any) -> _Place:
        if offload == "nvme":
            return _ToDisk(model, source)
        return _ToHost() if offload == "cpu" else _Place()

    def hooks(self, inputs: tuple) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


# torch has no public getter for the active pair; without it parameter storage stays in place
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


class _Outer:
    """A parameter-storage tensor handed to the hooks that were active outside ours."""

    __slots__ = ("packed", "unpack")

    def __init__(self, t: torch.Tensor, outer: tuple[Callable, Callable] | None) -> None:
        self.packed, self.unpack = (outer[0](t), outer[1]) if outer else (t, lambda x: x)


class _Offloading(_Place):
    """Saved-tensor hooks that move activations and pass parameter storage outward."""

    def hooks(self, inputs: tuple) -> contextlib.AbstractContextManager:
        # the pair active now (the engine's) is the one parameter storage must still go through
        outer = _top_hooks(False) if _top_hooks is not None else None

        def pack(t: torch.Tensor) -> Any:
            if owner(t) is not None:
                return _Outer(t, outer)
            return self.pack(t)

        def unpack(x: Any) -> torch.Tensor:
            return x.unpack(x.packed) if type(x) is _Outer else self.unpack(x)

        return saved_tensors_hooks(pack, unpack)

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
        if t.device.type == "cpu":
            return t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return (t.device, host)

    def unpack(self, x: Any) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x
        device, host = x
        return host.to(device, non_blocking=True)


class _ToDisk(_Offloading):
    """Saved inputs written to the rank's swap store in pack, read back in unpack (see
    [Note: checkpoints on NVMe])."""

    def __init__(self, model: nn.Module, source: Any) -> None:
        self._model = weakref.ref(model)
        self._rt: Runtime | None = getattr(source, "rt", source)
        self._last: weakref.ref[_OnDisk] | None = None
        if self._rt is not None:
            _check_nvme_path(self._rt)

    def runtime(self) -> Runtime:
        if self._rt is None:
            model = self._model()
            sp = next((s for p in model.parameters() if (s := managed(p))), None) if model else None
            if sp is None:
                raise ValueError("offload='nvme' needs an outcore runtime: pass the engine (or "
                                 "runtime) to checkpoint_activations, or use an outcore model")
            self._rt = sp.rt
            _check_nvme_path(self._rt)
        return self._rt

    def pack(self, t: torch.Tensor) -> Any:
        if t.numel() == 0:
            return t
        rt = self.runtime()
        host = t.detach()
        host = (host.to("cpu") if host.device.type != "cpu" else host).contiguous()
        entry = _OnDisk(_DiskIO(rt, host), t.shape, t.dtype, t.device, self._last)
        self._last = weakref.ref(entry)
        return entry

    def unpack(self, x: Any) -> torch.Tensor:
        return x if isinstance(x, torch.Tensor) else x.load()


def _check_nvme_path(rt: Runtime) -> None:
    if rt.cfg.offload.nvme_path is None:
        raise ConfigError("offload='nvme' for activations needs offload.nvme_path in the config")


class _DiskIO:
    """One saved tensor's extent and transfers; freed by ``release`` (its owner's finalizer)."""

    def __init__(self, rt: Runtime, host: torch.Tensor) -> None:
        self.store = rt.nvme
        self.nbytes = host.numel() * host.element_size()
        self.extent = self.store.allocate(self.nbytes)
        self._charge = rt.ledger.charge(Tier.NVME, Kind.ACTIVATIONS, self.extent.capacity)
        self.src: torch.Tensor | None = host  # kept until the write completes
        self.version = host._version
        self.modified = False
        # _on_written runs on an I/O thread before result() returns: it does no I/O itself
        self.written = self.store.write(self.extent, host).then(self._on_written, self.nbytes)
        self.reading: tuple[torch.Tensor, Any] | None = None
        self.taken = False

    def _on_written(self, ok: bool) -> None:
        src, self.src = self.src, None
        self.modified = src is not None and src._version != self.version

    def prefetch(self, ahead: bool = False) -> None:
        """Start reading into a new aligned buffer (``ahead``: only if never taken yet)."""
        if self.reading is None and not (ahead and self.taken):
            self.written.result()
            buf = aligned_empty(self.nbytes)
            self.reading = (buf, self.store.read(self.extent, buf))

    def take(self) -> torch.Tensor:
        self.prefetch()
        assert self.reading is not None
        buf, fut = self.reading
        self.reading, self.taken = None, True
        fut.result()
        if self.modified:
            raise RuntimeError("a checkpointed block's input was modified in place before it "
                               "reached the disk; gradients would be wrong (clone it first)")
        return buf

    def release(self) -> None:
        for fut in (self.written, self.reading[1] if self.reading else None):
            if fut is not None:
                with contextlib.suppress(Exception):
                    fut.result()
        self.reading = None
        if not self.store.closed:
            self.store.free(self.extent)
        self._charge.release()


class _OnDisk:
    """What autograd holds for a saved input on disk; dropping it frees the extent."""

    __slots__ = ("io", "shape", "dtype", "device", "prev", "__weakref__")

    def __init__(self, io: _DiskIO, shape: torch.Size, dtype: torch.dtype,
                 device: torch.device, prev: weakref.ref[_OnDisk] | None) -> None:
        self.io, self.shape, self.dtype, self.device, self.prev = io, shape, dtype, device, prev
        weakref.finalize(self, io.release)

    def load(self) -> torch.Tensor:
        t = self.io.take().view(self.dtype).view(self.shape)
        before = self.prev() if self.prev is not None else None
        if before is not None:
            before.io.prefetch(ahead=True)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)
