"""The NVMe tier: one private swap file per rank, carved into 4 KiB-aligned extents.

[Note: one swap file with extents, not a file per tensor]
A model has thousands of shards. A file per shard costs an open file or an open/close per
transfer, a directory entry and inode each, metadata journaling on every create, and
leaves litter on a crash that is hard to tell from the user's files. One file per rank,
preallocated and cut into extents by a first-fit free list, costs one descriptor, one
``fallocate`` that reserves the blocks up front (so a full disk fails before training,
not in step 900), and clean-up is deleting one file and one folder.

[Note: why O_DIRECT]
Swap traffic is read once per step and written once per step, always larger than what
the page cache could usefully keep. Through the page cache it would evict the memory the
run needs, double-buffer every byte, and make RSS and "free" memory meaningless; writes
would only reach the disk at writeback time, so their cost would show up somewhere else.
``O_DIRECT`` moves bytes between our aligned buffers and the device and nothing else.
Where the filesystem refuses it we fall back to buffered I/O and say so, once.

[Note: backpressure]
A transfer whose tensor is not aligned goes through pool buffers, one chunk per buffer.
``write``/``read`` borrow those buffers in the calling thread, so when the pool is empty
the call waits for earlier chunks to finish rather than allocating: host memory never
exceeds the pool's budget. Aligned tensors go straight to disk and borrow at most one
buffer, for their last partial page. So never call them from a done-callback: that runs
on an I/O thread, and waiting there for a buffer can stall the threads that free them.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import logging
import os
import secrets
import shutil
import threading
import warnings
import weakref
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

import torch

from outcore.errors import StorageError, limit_hint
from outcore.offload.aio import AioEngine, IOFuture, transfer
from outcore.offload.buffers import ALIGN, BufferPool, aligned_empty, is_aligned, round_up
from outcore.units import format_bytes

log = logging.getLogger(__name__)
_BUFFERED_WARNED = threading.Event()  # the fallback warning is printed once per process


class Extent(NamedTuple):
    """A piece of the swap file: ``nbytes`` of data in ``capacity`` bytes at ``offset``."""

    offset: int
    """Byte offset in the swap file; a multiple of 4096."""
    nbytes: int
    """Bytes of data the owner asked for."""
    capacity: int
    """``nbytes`` rounded up to 4096 (at least 4096): the bytes reserved on disk."""


def check_space(path: str | os.PathLike[str], nbytes: int) -> None:
    """Raise ``StorageError`` if the filesystem holding ``path`` has less than ``nbytes`` free."""
    free = shutil.disk_usage(path).free
    if free < nbytes:
        raise StorageError(
            f"not enough free space for the NVMe swap in {os.fspath(path)}: need "
            f"{format_bytes(nbytes)} more, {format_bytes(free)} free"
        )


MADE_MARK = ".outcore-made"
"""A file in a swap path outcore created: the last store to close there removes the path
when nothing else is left in it. (Ranks share the path, and the one that made it need not
close last; a folder without the mark, the user's, is never removed.)"""


def _prepare_root(root: Path) -> None:
    """Make sure ``root`` is a directory, creating it (not its parents, marked ``MADE_MARK``)
    if missing."""
    if root.exists():
        if not root.is_dir():
            raise StorageError(f"NVMe swap path {root} exists but is not a directory")
        return
    if root.is_symlink():  # exists() follows it: a link to nothing
        raise StorageError(f"NVMe swap path {root} is a symbolic link to {os.readlink(root)}, "
                           "which does not exist")
    parent = root.parent
    if not parent.is_dir():
        why = "is not a directory" if parent.exists() else "does not exist"
        hint = ("; environment variables such as $HOME are not expanded in a path (~ is)"
                if "$" in str(root) else "")
        raise StorageError(f"cannot create NVMe swap path {root}: its parent {parent} "
                           f"{why}{hint}")
    try:
        os.mkdir(root)
    except FileExistsError:
        return
    except OSError as e:
        raise StorageError(f"cannot create NVMe swap path {root}: {e.strerror}") from e
    with contextlib.suppress(OSError):  # without it the path is only kept
        (root / MADE_MARK).touch(0o600)


def remove_if_left_empty(root: Path) -> None:
    """``root`` and its mark, where outcore made it and nothing else is left in it."""
    with contextlib.suppress(OSError):
        if os.listdir(root) == [MADE_MARK]:
            os.unlink(root / MADE_MARK)
            os.rmdir(root)


class _FreeList:
    """Sorted, coalesced free holes of a file; first-fit allocation."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._sizes: list[int] = []

    def take(self, size: int) -> int | None:
        for i, hole in enumerate(self._sizes):
            if hole >= size:
                offset = self._starts[i]
                if hole == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                return offset
        return None

    def give(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self._starts, offset)
        before_end = self._starts[i - 1] + self._sizes[i - 1] if i > 0 else -1
        if before_end > offset or (i < len(self._starts) and self._starts[i] < offset + size):
            raise ValueError(f"extent at offset {offset} ({size} bytes) is already free")
        if before_end == offset:
            i -= 1
            self._sizes[i] += size
        else:
            self._starts.insert(i, offset)
            self._sizes.insert(i, size)
        if i + 1 < len(self._starts) and self._starts[i] + self._sizes[i] == self._starts[i + 1]:
            self._sizes[i] += self._sizes.pop(i + 1)
            del self._starts[i + 1]

    def hole_ending_at(self, end: int) -> int:
        if self._starts and self._starts[-1] + self._sizes[-1] == end:
            return self._sizes[-1]
        return 0


class _SwapFile:
    """What the store created, and its in-flight I/O count; apart from ``NvmeStore`` so that
    ``weakref.finalize`` can delete it at collection or exit without keeping the store alive."""

    def __init__(self, folder: Path, path: Path) -> None:
        self.folder = folder
        self.path = path
        self.fd = -1
        self.pid = os.getpid()
        self._inflight = 0
        self._idle = threading.Condition()

    def begin(self) -> None:
        with self._idle:
            self._inflight += 1

    def end(self, _future: IOFuture | None = None) -> None:
        with self._idle:
            self._inflight -= 1
            self._idle.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout=timeout)

    def delete(self) -> None:
        if os.getpid() != self.pid:
            return  # a forked child must not delete its parent's swap
        self.wait_idle(timeout=60.0)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        for remove, target in ((os.unlink, self.path), (os.rmdir, self.folder)):
            try:
                remove(target)
            except FileNotFoundError:
                pass
            except OSError as e:  # e.g. EROFS: ext4 made itself read-only after disk errors
                log.warning("outcore: could not remove %s: %s; the next run on %s removes "
                            "this swap once that filesystem is writable again",
                            target, e.strerror, self.folder.parent)
                return  # the folder still holds the file: one message, not two
        remove_if_left_empty(self.folder.parent)  # made by outcore, nothing else left


def _open_swap(path: Path, direct: bool) -> tuple[int, bool]:
    """Create the swap file 0600; return (fd, O_DIRECT in effect) per [Note: why O_DIRECT]."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    o_direct = getattr(os, "O_DIRECT", 0)
    if direct and o_direct:
        try:
            fd = os.open(path, flags | o_direct, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        else:
            try:
                if _direct_io_works(fd, path):
                    return fd, True
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a refused O_DIRECT open may still have created the file
        _warn_buffered(path)
    return os.open(path, flags, 0o600), False


def _direct_io_works(fd: int, path: Path) -> bool:
    """Write and read back one page: some filesystems accept O_DIRECT at open, fail at I/O."""
    page = aligned_empty(ALIGN).zero_()
    # numpy's stubs give ndarray ``__buffer__`` only on Python >= 3.12; it is a buffer on all
    view = memoryview(page.numpy())  # type: ignore[arg-type]
    try:
        transfer("write", fd, view, 0, str(path))
        transfer("read", fd, view, 0, str(path))
    except StorageError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    os.ftruncate(fd, 0)
    return True


def _warn_buffered(path: Path) -> None:
    if not _BUFFERED_WARNED.is_set():
        _BUFFERED_WARNED.set()
        warnings.warn(
            f"the filesystem of {path.parent} does not support O_DIRECT; outcore falls back to "
            "buffered I/O for its NVMe swap, so swap traffic will go through the page cache",
            stacklevel=4,
        )


def _as_bytes(tensor: torch.Tensor, extent: Extent, op: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op} needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"{op} needs a contiguous CPU tensor, got one on {tensor.device}")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes > extent.nbytes:
        raise ValueError(f"{op} of {nbytes} bytes does not fit {extent}")
    return tensor.detach().reshape(-1).view(torch.uint8)


class NvmeStore:
    """One rank's swap file in a private run folder under ``root``, cut into extents.

    ``write``/``read`` return ``IOFuture``s (see [Note: backpressure]); ``close()`` (also at
    garbage collection and interpreter exit) waits for in-flight I/O, then deletes the file
    and the run folder and nothing else.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        rank: int,
        engine: AioEngine,
        pool: BufferPool,
        direct: bool = True,
    ) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.root = Path(root).expanduser().absolute()
        self.engine = engine
        self.pool = pool
        _prepare_root(self.root)
        self.folder = self.root / f"outcore-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = self.folder / f"rank{rank}.swap"
        try:
            try:
                os.mkdir(self.folder, 0o700)
            except FileNotFoundError:  # another store removed the path as it closed: again
                _prepare_root(self.root)
                os.mkdir(self.folder, 0o700)
        except OSError as e:
            raise StorageError(f"NVMe swap path {self.root}: cannot create a folder there "
                               f"({e.strerror})") from e
        self._swap = _SwapFile(self.folder, self.path)
        self._closer = weakref.finalize(self, self._swap.delete)
        try:
            os.chmod(self.folder, 0o700)
            self._fd, self.direct = _open_swap(self.path, direct)
            self._swap.fd = self._fd
            with contextlib.suppress(OSError):  # says "live" to stale.py's sweep (its note)
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(self._fd, 0o600)
        except OSError as e:
            self._closer()
            if isinstance(e, StorageError):
                raise
            raise StorageError(f"cannot create the swap file {self.path}: {e.strerror}") from e
        self._lock = threading.Lock()
        self._free = _FreeList()
        self.file_bytes = 0
        """Size of the swap file, reserved on disk."""
        self.bytes_allocated = 0
        """Sum of the capacities of the extents handed out and not freed."""
        self.bytes_read = 0
        """Bytes delivered to callers by completed reads."""
        self.bytes_written = 0
        """Bytes taken from callers by completed writes."""
        self.bytes_staged = 0
        """Bytes copied through pool buffers because the caller's memory was not aligned."""

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no read or write is in flight (prefetches included), so the byte
        counters are settled; False if ``timeout`` seconds passed first."""
        return self._swap.wait_idle(timeout)

    @property
    def closed(self) -> bool:
        """Whether the swap file was deleted (``close()``, collection or exit)."""
        return not self._closer.alive

    def reserve(self, nbytes: int) -> None:
        """Grow the swap file to at least ``nbytes`` now, so a full disk fails early."""
        with self._lock:
            self._check_open()
            if nbytes > self.file_bytes:
                self._grow(round_up(nbytes))

    def allocate(self, nbytes: int) -> Extent:
        """Hand out an extent for ``nbytes`` (first fit), growing the file if no hole fits."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        capacity = round_up(max(nbytes, 1))
        with self._lock:
            self._check_open()
            offset = self._free.take(capacity)
            if offset is None:
                tail = self._free.hole_ending_at(self.file_bytes)
                self._grow(self.file_bytes + capacity - tail)
                offset = self._free.take(capacity)
                assert offset is not None
            self.bytes_allocated += capacity
        return Extent(offset, nbytes, capacity)

    def free(self, extent: Extent) -> None:
        """Give an extent back; its space is merged with free neighbours and reused."""
        with self._lock:
            self._check_open()
            if extent.offset % ALIGN or extent.offset + extent.capacity > self.file_bytes:
                raise ValueError(f"{extent} is not an extent of {self.path}")
            self._free.give(extent.offset, extent.capacity)
            self.bytes_allocated -= extent.capacity

    def write(self, extent: Extent, src: torch.Tensor) -> IOFuture:
        """Copy ``src``'s bytes into ``extent``; ``src`` may be reused after ``result()``."""
        data = _as_bytes(src, extent, "write")
        return self._transfer("write", extent, data)

    def read(self, extent: Extent, dst: torch.Tensor) -> IOFuture:
        """Fill ``dst``'s bytes from the start of ``extent``."""
        data = _as_bytes(dst, extent, "read")
        return self._transfer("read", extent, data)

    def _transfer(self, op: str, extent: Extent, data: torch.Tensor) -> IOFuture:
        self._check_open()
        total = data.numel()
        io = self.engine.pread if op == "read" else self.engine.pwrite
        parts: list[IOFuture] = []
        done = 0
        if not self.direct:
            done = total  # buffered I/O takes any address and length
        elif is_aligned(data):
            done = total - total % ALIGN  # the aligned bulk goes straight to disk
        self._swap.begin()  # close() waits until the parts below are finished
        try:
            if done:
                parts.append(io(self._fd, data[:done], extent.offset, path=self.path))
            while done < total:
                parts.append(self._through_pool(op, extent.offset + done, data[done:]))
                done += min(self.pool.buffer_bytes, total - done)
        except BaseException:
            IOFuture.gather(parts).add_done_callback(self._swap.end)
            raise

        def finish(ok: bool) -> None:  # runs before the caller's result() returns
            if ok:  # counted before the transfer stops being in flight (``wait_idle``)
                with self._lock:
                    if op == "read":
                        self.bytes_read += total
                    else:
                        self.bytes_written += total
            self._swap.end()

        return IOFuture.gather(parts).then(finish, total)

    def _through_pool(self, op: str, offset: int, data: torch.Tensor) -> IOFuture:
        """One chunk of ``data`` through a pool buffer, padded to whole pages."""
        buffer = self.pool.acquire()
        length = min(buffer.tensor.numel(), data.numel())
        with self._lock:
            self.bytes_staged += length
        padded = round_up(length)
        staging = buffer.tensor[:padded]
        try:
            if op == "write":
                staging[:length].copy_(data[:length])
                staging[length:].zero_()
                future = self.engine.pwrite(self._fd, staging, offset, path=self.path)
            else:
                future = self.engine.pread(self._fd, staging, offset, path=self.path)
        except BaseException:
            buffer.release()
            raise

        def unstage(ok: bool) -> None:
            try:
                if ok and op == "read":
                    data[:length].copy_(staging[:length])
            finally:
                buffer.release()

        return future.then(unstage, length)

    def _grow(self, new_size: int) -> None:
        """Extend the file to ``new_size`` bytes, checking space first; caller holds the lock."""
        old = self.file_bytes
        check_space(self.folder, new_size - old)
        try:
            os.posix_fallocate(self._fd, old, new_size - old)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise StorageError(
                    f"not enough free space for the NVMe swap in {self.folder}: need "
                    f"{format_bytes(new_size - old)} more"
                ) from e
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise StorageError(f"cannot grow the swap file {self.path}: {e.strerror}"
                                   f"{limit_hint(e)}") from e
            os.ftruncate(self._fd, new_size)  # filesystem without fallocate: sparse file
        self._free.give(old, new_size - old)
        self.file_bytes = new_size

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"NvmeStore for {self.path} is closed")

    def close(self) -> None:
        """Wait for in-flight I/O, delete the swap file and run folder; idempotent."""
        self._closer()

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "O_DIRECT" if self.direct else "buffered"
        return (
            f"NvmeStore({self.path}, {mode}, file_bytes={self.file_bytes}, "
            f"allocated={self.bytes_allocated})"
        )
