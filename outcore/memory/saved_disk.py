"""Tensors autograd saves for backward, kept in this rank's swap file until backward reads them.

One ``SavedOnDisk`` is the pack/unpack pair behind ``offload="nvme"`` of
``checkpoint_activations`` (a checkpointed block's inputs) and ``to="nvme"`` of
``offload_activations`` (everything an offloaded block saves); activations.py installs it
around each block's forward, one segment per block call.

[Note: saved tensors on NVMe]
Pack copies the tensor's bytes into an aligned buffer of its own, starts writing that buffer to
an extent and returns; the buffer is dropped when the write completes. The copy is what makes
this safe and small: an in-place change of the tensor after pack cannot reach the disk, and the
tensor itself is freed as soon as the forward drops it, not when its write completes. Unpack
reads the extent into a new aligned buffer (or hands back the copy, if its write is still
running) and keeps it on the entry, so a second saver of the same tensor reads nothing;
autograd drops what pack returned once its node ran (or with the graph), which frees the
buffer and the extent, so nothing stays on disk after a step.

* **One entry per storage.** The views autograd saves of one tensor (q, k and v split from one
  projection, one hidden state saved by two operators) are one write and one read: pack finds
  an entry by the tensor the view was made from (``_base``, held weakly) and its version (an
  in-place change since then means a new entry). The whole storage is written and each view is
  rebuilt with its own sizes, strides and offset, unless the storage is more than twice the
  view (a small slice of a large tensor), which is then written alone, contiguous.
* **Read ahead by block.** Backward's first unpack in a segment starts reading the rest of that
  segment and all of the one before it, which backward reaches next. The reads queue behind
  the optimizer's own transfers on the same disk; one tensor at a time, each unpack would wait
  behind them (measured on gpt-335m, 512 tokens: 2 s more backward, against 0.1 s of waiting
  with a block ahead). A block ahead costs about one block's activations of memory.
* **Nothing is freed inside a finalizer.** An entry may die inside the garbage collector,
  which may run while this thread holds the store's or the ledger's lock: its finalizer
  only queues the extent (``SimpleQueue.put`` is reentrant), and a reaper thread waits for
  its transfers and frees it (``settle`` waits for that).
* **Changed in place.** A view records its tensor's version; unpack raises autograd's own
  error if the tensor, still alive, was changed in place since (overlap/saved.py's note).
  Tensors kept in memory are checked the same way. One nothing holds after forward cannot
  be checked; backward then uses the bytes saved, the values the forward computed with.
* **Nothing holds an entry but autograd.** The write's callback holds it weakly, and a tensor
  kept in memory is held detached (overlap/saved.py), so a graph dropped without backward
  frees its extents with it.
* **What stays in memory.** Of an offloaded block, tensors under ``SMALL_BYTES`` (layer-norm
  statistics, small masks): a transfer each would cost more than the memory (a checkpointed
  block's inputs all go, as one per block is what checkpointing keeps). Parameter storage
  never reaches this pair: activations.py hands it to the engine's (its ``_Outer``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from outcore.errors import EngineClosedError
from outcore.offload.buffers import aligned_empty, round_up
from outcore.offload.ledger import Kind
from outcore.offload.storage import Tier
from outcore.overlap.saved import Kept, check_unchanged

if TYPE_CHECKING:
    from outcore.offload.aio import IOFuture
    from outcore.offload.nvme import Extent, NvmeStore
    from outcore.runtime import Runtime

SMALL_BYTES = 128 << 10
"""Saved tensors below this many bytes stay in memory ([Note: saved tensors on NVMe])."""


def _sweep_due(size: int, swept: int) -> bool:
    """Whether a record of weak references has doubled (past a floor of 64) since its last
    sweep left ``swept``: swept then, its cost stays proportional to what it adds."""
    return size > 2 * swept + 64


class _Generation:
    """The segments of one forward (or of forwards run before one backward), in pack order:
    segment number -> the entries packed in it (held weakly)."""

    __slots__ = ("segments", "next", "started", "swept")

    def __init__(self) -> None:
        self.segments: dict[int, list[weakref.ref[_Entry]]] = {}
        self.next = 0
        self.started: set[int] = set()  # segments whose reads backward has started
        self.swept = 0  # segments left after the last sweep

    def alive(self) -> bool:
        """Whether any entry of this generation is still held (its graph not yet dropped)."""
        return any(r() is not None for refs in reversed(self.segments.values()) for r in refs)

    def prune(self) -> None:
        """Forget segments whose entries are all gone: forwards whose graphs were dropped while
        a later one was kept (a loop that keeps its last output; graphs that wait for the
        cyclic collector). The oldest go at once, the others each time the record doubles."""
        while len(self.segments) > 1:
            first = next(iter(self.segments))
            if any(r() is not None for r in self.segments[first]):
                break
            del self.segments[first]
        if _sweep_due(len(self.segments), self.swept):
            last = self.next - 1
            self.segments = {k: refs for k, refs in self.segments.items()
                             if k == last or any(r() is not None for r in refs)}
            self.swept = len(self.segments)


class _Entry:
    """One storage's bytes on disk, shared by the views saved of it; dropping the last view
    frees the extent (and the bytes read back)."""

    __slots__ = ("store", "extent", "nbytes", "gen", "segment", "lock", "copy", "loaded", "io",
                 "charge", "__weakref__")

    def __init__(self, rt: Runtime, src: torch.Tensor, gen: _Generation, segment: int,
                 lock: threading.Lock) -> None:
        store = rt.nvme
        self.store, self.nbytes, self.gen, self.segment = store, src.numel(), gen, segment
        self.lock = lock
        # whole pages: the padded buffer goes to disk in one direct transfer, none through the
        # store's pool
        self.extent: Extent = store.allocate(round_up(max(self.nbytes, 1)))
        self.loaded: tuple[torch.Tensor, IOFuture] | torch.Tensor | None = None
        try:
            copy = aligned_empty(self.extent.capacity, huge_pages=False)
            copy[: self.nbytes].copy_(src)
            self.copy: torch.Tensor | None = copy  # unpack may use it until the write is done
            # [write, read]: the reaper waits for both before it frees the extent. The write's
            # callback holds the entry weakly, so a graph dropped mid-write frees it at once
            # (the request holds the buffer meanwhile)
            self.io: list[IOFuture | None] = [store.write(self.extent, copy).then(
                _forget_copy(weakref.ref(self)), self.nbytes), None]
        except BaseException:
            store.free(self.extent)
            raise
        # released by its own finalizer with the entry (the ledger's finalizers take no lock)
        self.charge = rt.ledger.charge(Tier.NVME, Kind.ACTIVATIONS, self.extent.capacity)
        weakref.finalize(self, _reap_later, (store, self.extent, self.io))

    def start_read(self) -> None:
        """Start reading the bytes back, unless they are in memory or being read."""
        write = self.io[0]
        assert write is not None
        with self.lock:
            if self.loaded is not None or self.copy is not None or not write.done() \
                    or write.exception() is not None:
                return
            buf = aligned_empty(self.extent.capacity, huge_pages=False)
            read = self.store.read(self.extent, buf)
            self.io[1], self.loaded = read, (buf, read)

    def bytes(self) -> torch.Tensor:
        """The storage's bytes in memory (blocks until they are read back)."""
        copy = self.copy
        if self.loaded is None and copy is not None:
            return copy[: self.nbytes]
        write = self.io[0]
        assert write is not None
        write.result()  # a failed write raises its StorageError here, in backward
        self.start_read()
        with self.lock:
            loaded = self.loaded
        if isinstance(loaded, tuple):
            buf, read = loaded
            read.result()
            with self.lock:
                self.loaded = loaded = buf
        assert isinstance(loaded, torch.Tensor)
        return loaded[: self.nbytes]


def _forget_copy(entry: weakref.ref[_Entry]) -> Callable[[bool], None]:
    def written(ok: bool) -> None:  # on an I/O thread: no I/O here
        e = entry()
        if e is not None:
            e.copy = None
    return written


# -- the reaper: frees the extents of dropped entries, outside any finalizer ------------------
_REAPER: queue.SimpleQueue[tuple[NvmeStore, Extent, list[IOFuture | None]] | threading.Event] \
    = queue.SimpleQueue()
_reaper_lock = threading.Lock()
_reaper: threading.Thread | None = None


def _reap_later(item: tuple[NvmeStore, Extent, list[IOFuture | None]]) -> None:
    """An entry's finalizer: queue its extent (a reentrant put; no lock taken)."""
    _REAPER.put(item)


def _start_reaper() -> None:
    global _reaper
    with _reaper_lock:
        if _reaper is None or not _reaper.is_alive():
            _reaper = threading.Thread(target=_reap, name="outcore-saved-reaper", daemon=True)
            _reaper.start()


def _reap() -> None:
    while True:
        item = _REAPER.get()
        if isinstance(item, threading.Event):
            item.set()
            continue
        store, extent, io = item
        for fut in io:
            if fut is not None:
                with contextlib.suppress(Exception):
                    fut.result()
        with contextlib.suppress(Exception):  # a store closed meanwhile deleted its file
            if not store.closed:
                store.free(extent)


def _forked() -> None:  # a child has no reaper thread: its first pack starts one
    global _REAPER, _reaper
    _REAPER, _reaper = queue.SimpleQueue(), None


os.register_at_fork(after_in_child=_forked)


def settle(timeout: float | None = None) -> bool:
    """Wait until the extents of the saved tensors dropped so far are free; False on timeout."""
    if _reaper is None:
        return True
    done = threading.Event()
    _REAPER.put(done)
    return done.wait(timeout)


class _View:
    """What autograd keeps for one saved tensor: its entry, how to rebuild it from the bytes
    (``stride`` None: the bytes are the tensor, contiguous), and the version it had."""

    __slots__ = ("entry", "dtype", "shape", "stride", "offset", "device", "base", "version")

    def __init__(self, entry: _Entry, t: torch.Tensor, base: torch.Tensor, whole: bool) -> None:
        self.entry, self.dtype, self.shape, self.device = entry, t.dtype, t.shape, t.device
        self.stride = t.stride() if whole else None
        self.offset = t.storage_offset() if whole else 0
        self.base, self.version = weakref.ref(base), base._version

    def check(self) -> None:
        base = self.base()
        if base is not None:  # a tensor nothing holds any more was not changed since
            check_unchanged(base, self.version)


class SavedOnDisk:
    """The pack/unpack pair that keeps saved tensors in one runtime's swap file."""

    def __init__(self, rt: Runtime, keep_small: bool = True) -> None:
        self.rt, self.keep_small = rt, keep_small
        self._lock = threading.Lock()
        self._gen = _Generation()
        self._backward = False  # whether an unpack ran since the generation began
        self._by_base: dict[int, tuple[weakref.ref[torch.Tensor], int, weakref.ref[_Entry]]] = {}
        self._swept = 0  # size of _by_base after its last sweep

    @contextlib.contextmanager
    def segment(self) -> Iterator[None]:
        """One block's forward: what it saves is read back together, a block ahead."""
        with self._lock:
            if self._backward or not self._gen.alive():  # a new forward: a new generation
                self._gen, self._backward, self._by_base = _Generation(), False, {}
            self._gen.prune()
            self._gen.segments[self._gen.next] = []
            self._gen.next += 1
        yield

    def pack(self, t: torch.Tensor) -> Any:
        """``t`` kept where it stays in memory, else a view of an entry on disk."""
        if t.is_conj() or t.is_neg():  # the bits are not in the bytes: keep their values
            t = t.resolve_conj().resolve_neg()
        size = t.element_size()
        if (t.layout is not torch.strided or t.device.type not in ("cpu", "cuda")
                or (self.keep_small and t.numel() * size < SMALL_BYTES) or not t.numel()):
            return Kept(t)
        if self.rt.closed:
            raise EngineClosedError("offloaded activations need an open engine: the one whose "
                                    "swap file they were given is closed")
        base = t._base if t._base is not None else t
        storage = t.untyped_storage()
        whole = storage.nbytes() <= 2 * t.numel() * size and storage.nbytes() % size == 0
        entry = self._shared(base) if whole else None
        if entry is None:
            if whole:
                src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            else:
                src = t.detach().contiguous().view(-1).view(torch.uint8)
            with self._lock:
                gen = self._gen
                if not gen.segments:
                    gen.segments[gen.next] = []
                    gen.next += 1
                segment = gen.next - 1
            _start_reaper()
            entry = _Entry(self.rt, src, gen, segment, self._lock)
            with self._lock:
                gen.segments.setdefault(segment, []).append(weakref.ref(entry))
                if whole:
                    self._remember(base, entry)
        return _View(entry, t, base, whole)

    def unpack(self, x: Any) -> torch.Tensor:
        """The saved tensor back, read from disk if it is not in memory."""
        if type(x) is Kept:
            return x.get()
        view: _View = x
        if view.entry.store.closed:
            raise EngineClosedError("backward needs activations from the swap file of an "
                                    "engine that was closed since forward")
        view.check()
        self._read_ahead(view.entry)
        typed = view.entry.bytes().view(view.dtype)
        t = (typed.view(view.shape) if view.stride is None
             else typed.as_strided(view.shape, view.stride, typed.storage_offset() + view.offset))
        return t if view.device.type == "cpu" else t.to(view.device, non_blocking=True)

    def _shared(self, base: torch.Tensor) -> _Entry | None:
        with self._lock:
            found = self._by_base.get(id(base))
        if found is None:
            return None
        ref, version, entry_ref = found
        entry = entry_ref()
        return entry if ref() is base and version == base._version else None

    def _remember(self, base: torch.Tensor, entry: _Entry) -> None:
        """Record ``entry`` as ``base``'s (caller holds the lock); forget dead ones as the
        record doubles, so a generation that never ends does not grow it without bound."""
        self._by_base[id(base)] = (weakref.ref(base), base._version, weakref.ref(entry))
        if _sweep_due(len(self._by_base), self._swept):
            self._by_base = {k: v for k, v in self._by_base.items()
                             if v[0]() is not None and v[2]() is not None}
            self._swept = len(self._by_base)

    def _read_ahead(self, entry: _Entry) -> None:
        """Start reading the entry's segment and the one before it, once each."""
        gen, first = entry.gen, entry.segment
        with self._lock:
            self._backward = True
            wanted = [s for s in (first, first - 1) if s >= 0 and s not in gen.started]
            gen.started.update(wanted)
            refs = [r for s in wanted for r in gen.segments.get(s, ())]
        for ref in refs:
            e = ref()
            if e is not None:
                e.start_read()
