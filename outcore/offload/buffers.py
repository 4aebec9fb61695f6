"""Aligned host buffers and a fixed pool of them, reused for every transfer.

[Note: one pool, one budget]
Every byte that moves between host memory and the NVMe tier passes through a buffer from a
``BufferPool`` unless the tensor itself is already aligned. The pool allocates all of its
buffers once, from one byte budget, and never more: when every buffer is busy the caller
waits for one to come back. That is what keeps host memory inside the budget the user gave,
however much data is in flight, and it is why there is no allocation per I/O call.

[Note: alignment]
``O_DIRECT`` needs the memory address, the length and the file offset aligned to the
device's logical block size (512 B or 4 KiB). We align everything to 4 KiB, the page size,
which satisfies every block device and lets the kernel map the pages for DMA directly.

[Note: the CUDA seam]
Page-locked ("pinned") memory lets a CUDA copy stream move a buffer to the device
asynchronously. It is the only CUDA-specific thing in the tiers and lives behind the
``pin`` flag of ``aligned_empty``; without CUDA the flag is ignored.

[Note: huge pages under I/O buffers]
For O_DIRECT the kernel pins the buffer's pages and builds the request from them, page by
page; physically contiguous 2 MiB pages make that cheaper and the requests larger: both
reads and writes get faster, and the kernel spends less CPU time per byte moved (measured
with ``bench/io.py`` against ``--small-pages``: bench/RESULTS.md, 'I/O engine vs fio',
huge-page buffers). On a host whose few cores also compute, the CPU time is what counts.
So every large unpinned buffer that I/O lands in is its own anonymous mapping, aligned to
2 MiB and advised ``MADV_HUGEPAGE``: that works whether the system's THP mode is ``always``
or ``madvise``, and where THP is off it is plain page-aligned memory. Only the whole huge
pages inside the buffer are advised for them and the rest of the mapping against them, so
a buffer never holds memory beyond its length, whatever the mode. The kernel's THP
``defrag`` setting decides whether a fault may compact memory to find a huge page
(``madvise``, the usual default, lets it for advised mappings); without one it falls back
to small pages. Pinned (CUDA) buffers come from torch's pinned allocator instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
import threading
import time
from types import TracebackType

import numpy as np
import torch

from outcore.offload.host_memory import libc
from outcore.offload.ledger import Charge

ALIGN = 4096
"""Alignment in bytes of buffer addresses, lengths and file offsets (see [Note: alignment])."""

HUGE_PAGE = 2 << 20
"""Size of a transparent huge page on x86-64 and arm64 with 4 KiB pages."""

_PRIVATE_MAPPINGS = hasattr(mmap, "MAP_PRIVATE")  # POSIX; elsewhere torch's allocator serves
_LINUX = sys.platform.startswith("linux")


def _madvise(address: int, length: int, advice: int) -> int:
    """libc's ``madvise`` on memory no Python ``mmap`` object owns (0 on success)."""
    fn = getattr(libc(), "madvise", None)
    if fn is None:
        return -1
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    rc: int = fn(address, length, advice)  # restype c_int: ctypes hands back a Python int
    return rc


def round_up(nbytes: int, alignment: int = ALIGN) -> int:
    """Smallest multiple of ``alignment`` that is at least ``nbytes``."""
    return -(-nbytes // alignment) * alignment


def is_aligned(tensor: torch.Tensor, alignment: int = ALIGN) -> bool:
    """Whether the tensor's first byte sits on an ``alignment`` boundary."""
    return tensor.data_ptr() % alignment == 0


def aligned_empty(nbytes: int, *, alignment: int = ALIGN, pin: bool = False,
                  huge_pages: bool = True) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of ``nbytes`` whose first byte is ``alignment``-aligned.

    Large unpinned buffers are their own huge-page mapping (see [Note: huge pages under I/O
    buffers]; ``huge_pages=False`` opts out, for comparison). Otherwise we over-allocate by
    one alignment unit and slice, because torch's allocator only promises 64-byte alignment;
    the slice keeps the whole allocation alive. With ``pin=True`` and CUDA available the
    memory is page-locked (see [Note: the CUDA seam]).
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    pin = pin and torch.cuda.is_available()
    if (huge_pages and not pin and nbytes >= HUGE_PAGE and alignment <= HUGE_PAGE
            and _PRIVATE_MAPPINGS):
        return huge_page_mapping(nbytes)
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % alignment
    return raw[start : start + nbytes]


def huge_page_mapping(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 tensor over a fresh private mapping whose start is 2 MiB-aligned.

    The whole huge pages inside it are advised ``MADV_HUGEPAGE``, the rest ``MADV_NOHUGEPAGE``
    (see [Note: huge pages under I/O buffers]). The mapping is unmapped when the last tensor
    viewing it goes away. Private, so a forked child (a DataLoader worker) never shares it.
    """
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    whole = np.frombuffer(region, dtype=np.uint8)
    start = (-whole.ctypes.data) % HUGE_PAGE
    whole_pages = nbytes // HUGE_PAGE * HUGE_PAGE
    huge, small = getattr(mmap, "MADV_HUGEPAGE", None), getattr(mmap, "MADV_NOHUGEPAGE", None)
    with contextlib.suppress(OSError):  # THP compiled out: plain pages, still aligned
        if whole_pages and huge is not None:
            region.madvise(huge, start, whole_pages)
        # past the whole pages, a huge page would reach beyond the buffer (THP "always")
        if small is not None:
            region.madvise(small, start + whole_pages, len(region) - start - whole_pages)
    return torch.from_numpy(whole[start : start + nbytes])


class AlignedRegions:
    """Page-aligned memory for parameters' full tensors, recycled by exact size.

    [Note: aligned memory under a storage that views already share]
    A parameter's full tensor keeps one storage for life and views of it (saved by
    autograd) must see whatever memory it holds (param.py's [Note: free the storage, keep
    the tensor]). ``resize_`` refills it from torch's allocator, which aligns to 64 bytes,
    so O_DIRECT reads into it would bounce through the I/O pool (a copy, and pool buffers
    the caller must wait for). Here the storage instead takes over page-aligned memory by
    swapping data pointers, which changes the memory and keeps the storage object.

    Fresh anonymous mappings page-fault on first touch, which costs more than the read
    itself on a VM, so released memory is kept for the next full tensor of the same size
    (layers repeat, so sizes do) up to ``cap_bytes``; beyond that it is unmapped at once.
    """

    def __init__(self, cap_bytes: int, charge: Charge | None = None) -> None:
        self.cap_bytes = cap_bytes
        self.cached_bytes = 0
        self._free: dict[int, list[torch.UntypedStorage]] = {}
        self._lock = threading.Lock()
        self._charge = charge  # the bytes kept for reuse, on the ledger
        self.fills = 0
        """Storages given memory so far."""
        self.mapped = 0
        """Of those, how many needed a fresh mapping (the rest reused kept memory)."""

    @staticmethod
    def supported() -> bool:
        """Whether this torch can swap a storage's memory (a private method, torch 2.12 on)."""
        return hasattr(torch.UntypedStorage, "_swap_data_ptr_")

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give an empty, resizable storage ``nbytes`` of page-aligned memory, in place."""
        with self._lock:
            kept = self._free.get(nbytes)
            donor = kept.pop() if kept else None
            if donor is not None:
                self.cached_bytes -= nbytes
        self.fills += 1
        if donor is None:
            self.mapped += 1
            donor = huge_page_mapping(nbytes).untyped_storage()
        elif self._charge is not None:
            self._charge.change(-nbytes)
        storage._swap_data_ptr_(donor)  # type: ignore[attr-defined]  # private torch API

    def set_cap(self, cap_bytes: int) -> None:
        """Change the cap; what is kept beyond a lower one is unmapped now."""
        dropped = 0
        with self._lock:
            self.cap_bytes = cap_bytes
            for nbytes, kept in self._free.items():
                while kept and self.cached_bytes > cap_bytes:
                    kept.pop()  # its holder owned the mapping: unmapped as it goes
                    self.cached_bytes -= nbytes
                    dropped += nbytes
        if dropped and self._charge is not None:
            self._charge.change(-dropped)

    def release(self, storage: torch.UntypedStorage) -> None:
        """Free a storage's memory in place (to zero bytes), whoever allocated it."""
        if storage.resizable():
            storage.resize_(0)
            return
        nbytes = storage.nbytes()
        holder = torch.empty(0, dtype=torch.uint8).untyped_storage()
        # the holder now owns the mapping
        storage._swap_data_ptr_(holder)  # type: ignore[attr-defined]  # private torch API
        with self._lock:
            keep = self.cached_bytes + nbytes <= self.cap_bytes
            if keep:
                self._free.setdefault(nbytes, []).append(holder)
                self.cached_bytes += nbytes
        if keep and self._charge is not None:
            self._charge.change(nbytes)


class PooledBuffer:
    """One buffer lent by a ``BufferPool``; give it back with ``release()`` or ``with``."""

    __slots__ = ("_pool", "_index", "tensor")

    def __init__(self, pool: BufferPool, index: int, tensor: torch.Tensor) -> None:
        self._pool: BufferPool | None = pool
        self._index = index
        self.tensor = tensor
        """The whole buffer: a 1-D, 4 KiB-aligned uint8 tensor of ``pool.buffer_bytes``."""

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements of ``dtype`` over the first bytes of the buffer."""
        nbytes = numel * dtype.itemsize
        if numel < 0 or nbytes > self.tensor.numel():
            raise ValueError(
                f"a view of {numel} x {dtype} needs {nbytes} bytes; the buffer has "
                f"{self.tensor.numel()}"
            )
        return self.tensor[:nbytes].view(dtype)

    @property
    def released(self) -> bool:
        """True once the buffer went back to its pool."""
        return self._pool is None

    def release(self) -> None:
        """Return the buffer to its pool; calling it again does nothing."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._give_back(self._index)

    def __enter__(self) -> PooledBuffer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class BufferPool:
    """A fixed set of aligned host buffers sized by one byte budget (see [Note: one pool, ...]).

    ``count = max(1, budget_bytes // buffer_bytes)`` buffers of ``buffer_bytes`` (rounded up
    to ``ALIGN``) are allocated here and nowhere else. ``acquire()`` blocks while all are lent.
    """

    def __init__(self, budget_bytes: int, buffer_bytes: int, *, pin: bool = False) -> None:
        if buffer_bytes <= 0:
            raise ValueError(f"buffer_bytes must be > 0, got {buffer_bytes}")
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.buffer_bytes = round_up(buffer_bytes)
        self.count = max(1, budget_bytes // self.buffer_bytes)
        self.capacity_bytes = self.count * self.buffer_bytes
        self.pinned = pin and torch.cuda.is_available()
        # zero_() touches every page now: first-touch faults are slow (the kernel zeroes pages)
        # and would otherwise land in the first transfers; the memory is resident from here
        # until ``release_idle`` (see its note).
        self._buffers = [
            aligned_empty(self.buffer_bytes, pin=pin).zero_() for _ in range(self.count)
        ]
        self._free = list(range(self.count - 1, -1, -1))
        self._cond = threading.Condition()
        self.in_use = 0
        """Buffers lent right now."""
        self.peak_in_use = 0
        """Most buffers ever lent at the same time."""

    def acquire(self, timeout: float | None = None) -> PooledBuffer:
        """Borrow a buffer, waiting while all are busy; ``TimeoutError`` after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._free:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"no buffer came back within {timeout} s: all {self.count} buffers of "
                        f"{self.buffer_bytes} bytes are in use"
                    )
                self._cond.wait(remaining)
            index = self._free.pop()
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        return PooledBuffer(self, index, self._buffers[index])

    def release_idle(self) -> int:
        """Give back to the system the pages of every buffer not lent now; return their bytes.

        [Note: a pool idle in training keeps no pages]
        Building a model stages every initial shard through the pool (torch allocates them
        64-byte aligned), but in training the hot transfers land in page-aligned memory of
        their own (optimizer slots, full-tensor regions), so the pool may never be borrowed
        again, even with params and optimizer state on NVMe, while its share of the budget would
        stay resident for the whole run. The engine calls this once the model is built and after
        each checkpoint save or load, which stage every shard through the pool again. The buffers
        stay valid and the pool keeps its count and budget: a released page comes back, zeroed, on
        its next touch (a first-touch fault, once). So peak RSS drops by the idle pool's pages and
        the step time does not change (measured side by side:
        bench/results/2026-11-22-intel-amx-bf16-training-profile.md). Pinned buffers are never
        released (page-locked memory is what makes them pinned); elsewhere than Linux nothing
        is.
        """
        if self.pinned or not _LINUX:
            return 0
        released = 0
        with self._cond:  # no buffer is lent while its pages go
            for index in self._free:
                buf = self._buffers[index]
                if _madvise(buf.data_ptr(), buf.numel(), mmap.MADV_DONTNEED) == 0:
                    released += buf.numel()
        return released

    def _give_back(self, index: int) -> None:
        with self._cond:
            self._free.append(index)
            self.in_use -= 1
            self._cond.notify()

    def __repr__(self) -> str:
        return (
            f"BufferPool(count={self.count}, buffer_bytes={self.buffer_bytes}, "
            f"in_use={self.in_use}, pinned={self.pinned})"
        )
