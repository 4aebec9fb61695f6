"""Asynchronous positional file I/O on a small thread pool, returning futures.

[Note: why threads and preadv, not libaio or io_uring]
outcore is pure Python with no build step, so the kernel's async interfaces are out of
reach without a native module. Blocking ``os.preadv``/``os.pwritev`` release the GIL for
the whole system call, so a few threads, each with one large request in flight,
keep as many requests queued on the device as libaio does with the same queue depth. The
cost per request is a few microseconds of Python, negligible against a 4 MiB transfer.
``bench/io.py`` checks that this reaches fio's bandwidth on the same folder.

[Note: default block size and thread count]
Two things decide the bandwidth a pool of threads gets from the disk (threads x block
sizes swept against fio: bench/RESULTS.md, 'I/O engine vs fio'):
- bytes in flight: one thread with one small block at a time leaves the device's queue
  mostly empty; with enough bytes in flight (more threads, or larger blocks) the engine
  reaches what fio reaches on the same folder;
- GIL hand-offs: each finished block needs the GIL before its thread can start the next,
  and a main thread running Python keeps the GIL for up to ``sys.getswitchinterval()``
  (5 ms by default). Small blocks need many hand-offs per byte and lose much of their
  bandwidth while the main thread computes; blocks of 4 MiB or more lose little.
Hence 8 threads x 4 MiB: 32 MiB in flight, few hand-offs per byte, and 4 MiB is the
largest request the device takes whole (``max_sectors_kb``). A transfer smaller than
4 MiB is one request; the engine gets its parallelism from many shards in flight.

[Note: errors are never silent]
A request that moves fewer bytes than asked is retried from where it stopped; if the file
ends (read returns 0) or the system call fails, the future raises ``AioError`` naming the
operation, the file, the byte offset and the errno (number and name: ``errno 5, EIO``), with a
hint for the errors a failing disk gives (EIO; EROFS once ext4 remounts itself read-only).
A caller never sees a buffer that is partly stale without an exception.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterable
from types import TracebackType

import torch

from outcore.errors import StorageError
from outcore.profiling import NVME_READ, NVME_WRITE, record_function

log = logging.getLogger(__name__)

DEFAULT_THREADS = 8
"""I/O threads, each with one request in flight (see [Note: default block size ...])."""

DEFAULT_BLOCK_BYTES = 4 << 20
"""Largest single system call; bigger requests are split (see [Note: default block size ...])."""


class AioError(StorageError):
    """A read or write failed or was short; names the file, the byte offset and the operation."""

    def __init__(
        self, message: str, *, op: str, path: str, offset: int, code: int | None = None
    ) -> None:
        super().__init__(message)
        self.op = op
        self.path = path
        self.offset = offset
        self.errno = code


class IOFuture:
    """The outcome of one I/O request: the number of bytes moved, or the error.

    Completes exactly once. ``result()`` blocks; ``add_done_callback`` runs ``fn(future)``
    in the thread that completes it (or at once if already done). Compose with ``gather``.
    """

    __slots__ = ("_cond", "_done", "_nbytes", "_error", "_callbacks")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._done = False
        self._nbytes = 0
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[IOFuture], None]] = []

    @classmethod
    def completed(cls, nbytes: int = 0) -> IOFuture:
        """A future that is already done with ``nbytes``."""
        future = cls()
        future.set_result(nbytes)
        return future

    @classmethod
    def gather(cls, futures: Iterable[IOFuture]) -> IOFuture:
        """A future done when all ``futures`` are; its result is the sum of theirs.

        It waits for every part even after one fails, so that when it completes no part is
        still using its memory; then it raises the first error.
        """
        parts = list(futures)
        if not parts:
            return cls.completed(0)
        combined = cls()
        lock = threading.Lock()
        pending, nbytes = len(parts), 0
        first: BaseException | None = None

        def on_part_done(part: IOFuture) -> None:
            nonlocal pending, nbytes, first
            error = part.exception()
            with lock:
                pending -= 1
                if error is None:
                    nbytes += part._nbytes
                elif first is None:
                    first = error
                last = pending == 0
            if last:
                if first is not None:
                    combined.set_exception(first)
                else:
                    combined.set_result(nbytes)

        for part in parts:
            part.add_done_callback(on_part_done)
        return combined

    def done(self) -> bool:
        """Whether the request finished, successfully or not."""
        return self._done

    def result(self, timeout: float | None = None) -> int:
        """Wait for the request; return the bytes moved or raise its error."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._nbytes

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the request; return its error, or None if it succeeded."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"I/O request not done after {timeout} s")
        return self._error

    def add_done_callback(self, fn: Callable[[IOFuture], None]) -> None:
        """Call ``fn(self)`` once done: in the completing thread, or now if already done."""
        with self._cond:
            if not self._done:
                self._callbacks.append(fn)
                return
        self._call(fn)

    def then(self, fn: Callable[[bool], None], nbytes: int) -> IOFuture:
        """A future done with ``nbytes`` once this one is done and ``fn(succeeded)`` returned.

        For a step that must finish before the caller may look, such as copying out of a
        staging buffer and returning it to its pool. An error of either is passed on.
        """
        out = IOFuture()

        def finish(done: IOFuture) -> None:
            error = done.exception()
            try:
                fn(error is None)
            except Exception as e:  # passed on through the future
                error = error or e
            if error is None:
                out.set_result(nbytes)
            else:
                out.set_exception(error)

        self.add_done_callback(finish)
        return out

    def set_result(self, nbytes: int) -> None:
        """Complete with success; for producers of futures (the engine, the store)."""
        self._complete(nbytes, None)

    def set_exception(self, error: BaseException) -> None:
        """Complete with an error; for producers of futures (the engine, the store)."""
        self._complete(0, error)

    def _complete(self, nbytes: int, error: BaseException | None) -> None:
        with self._cond:
            if self._done:
                raise RuntimeError("IOFuture completed twice")
            self._nbytes, self._error, self._done = nbytes, error, True
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        for fn in callbacks:
            self._call(fn)

    def _call(self, fn: Callable[[IOFuture], None]) -> None:
        try:
            fn(self)
        except Exception:
            log.exception("an IOFuture done-callback raised; the I/O itself completed")

    def __repr__(self) -> str:
        if not self._done:
            return "IOFuture(pending)"
        if self._error is not None:
            return f"IOFuture(error={self._error!r})"
        return f"IOFuture(nbytes={self._nbytes})"


class _Request:
    """Book-keeping for one pread/pwrite split into blocks: completes its future once.

    Of several failed blocks it reports the one at the lowest offset, where the damage
    starts, whatever order the threads finished in.
    """

    __slots__ = ("future", "_lock", "_pending", "_nbytes", "_error", "_error_offset", "_buf")

    def __init__(self, blocks: int, buf: torch.Tensor) -> None:
        self.future = IOFuture()
        # The memoryview over ``buf`` is a raw-address view that does not own the memory, so
        # the request holds the tensor until its last block is done; otherwise a caller that
        # drops its source right after submitting would free bytes still being written.
        self._buf: torch.Tensor | None = buf
        self._lock = threading.Lock()
        self._pending = blocks
        self._nbytes = 0
        self._error: BaseException | None = None
        self._error_offset = 0

    def block_done(self, offset: int, nbytes: int, error: BaseException | None) -> None:
        with self._lock:
            self._pending -= 1
            self._nbytes += nbytes
            if error is not None and (self._error is None or offset < self._error_offset):
                self._error, self._error_offset = error, offset
            last = self._pending == 0
        if last:
            self._buf = None
            if self._error is not None:
                self.future.set_exception(self._error)
            else:
                self.future.set_result(self._nbytes)


_HINTS = {
    errno.EINVAL: "O_DIRECT needs 4 KiB-aligned memory, offsets and lengths",
    errno.EIO: "the device under this file failed; see the kernel log",
    errno.EROFS: "the filesystem is read-only, as ext4 makes itself after disk errors",
}


def describe_os_error(e: OSError) -> str:
    """``strerror (errno N, NAME; hint)``: what failed, in words and as a searchable errno."""
    name = errno.errorcode.get(e.errno, "?") if e.errno is not None else "?"
    hint = _HINTS.get(e.errno) if e.errno is not None else None
    return f"{e.strerror or e} (errno {e.errno}, {name}" + (f"; {hint})" if hint else ")")


def transfer(op: str, fd: int, view: memoryview, offset: int, path: str) -> int:
    """Move all of ``view`` to or from ``fd`` at ``offset``, synchronously ([Note: errors ...])."""
    total = len(view)
    done = 0
    while done < total:
        try:
            if op == "read":
                moved = os.preadv(fd, [view[done:]], offset + done)
            else:
                moved = os.pwritev(fd, [view[done:]], offset + done)
        except OSError as e:
            raise AioError(
                f"{op} of {total - done} bytes at offset {offset + done} in {path} failed: "
                f"{describe_os_error(e)}",
                op=op,
                path=path,
                offset=offset + done,
                code=e.errno,
            ) from e
        if moved == 0:
            raise AioError(
                f"short {op} at offset {offset + done} in {path}: the file ended after "
                f"{done} of {total} bytes",
                op=op,
                path=path,
                offset=offset + done,
                code=errno.EIO,
            )
        done += moved
    return done


_Task = tuple[str, int, memoryview, int, str, _Request]
"""One block for a worker: (op, fd, view, file offset, file name, the request it is part of)."""


def _worker(tasks: queue.SimpleQueue[_Task | None]) -> None:
    while True:
        task = tasks.get()
        if task is None:
            return
        op, fd, view, offset, path, request = task
        try:
            with record_function(NVME_READ if op == "read" else NVME_WRITE):
                moved = transfer(op, fd, view, offset, path)
        except BaseException as e:  # handed to the future, never lost
            request.block_done(offset, 0, e)
        else:
            request.block_done(offset, moved, None)


def _stop(tasks: queue.SimpleQueue[_Task | None], threads: list[threading.Thread]) -> None:
    for _ in threads:
        tasks.put(None)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join()


def byte_view(buf: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous uint8 CPU tensor's memory, without a copy."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8 or buf.device.type != "cpu" or not buf.is_contiguous():
        raise ValueError(
            f"I/O buffers must be contiguous uint8 CPU tensors, got {buf.dtype} on "
            f"{buf.device} (contiguous={buf.is_contiguous()})"
        )
    # Not ``buf.numpy()``: that marks the tensor's storage non-resizable for good, and outcore
    # frees parameter storage in place (resize to 0) between uses. A ctypes array over the
    # same memory is just as copy-free but does not own it: _Request holds ``buf`` until done.
    n = buf.numel()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(buf.data_ptr())).cast("B")


class AioEngine:
    """A pool of I/O threads doing positional reads and writes into caller-owned buffers.

    Requests larger than ``block_bytes`` are split into blocks that the ``threads`` workers
    take in order, so one large transfer keeps several requests in flight on the device.
    """

    def __init__(
        self, threads: int = DEFAULT_THREADS, block_bytes: int = DEFAULT_BLOCK_BYTES
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if block_bytes < 4096 or block_bytes % 4096:
            raise ValueError(f"block_bytes must be a positive multiple of 4096, got {block_bytes}")
        self.threads = threads
        self.block_bytes = block_bytes
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._workers = [
            threading.Thread(
                target=_worker, args=(self._tasks,), name=f"outcore-aio-{i}", daemon=True
            )
            for i in range(threads)
        ]
        for worker in self._workers:
            worker.start()
        self._closer = weakref.finalize(self, _stop, self._tasks, self._workers)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` ran; a closed engine refuses new requests."""
        return not self._closer.alive

    def pread(
        self, fd: int, buf: torch.Tensor, offset: int, *, path: str | os.PathLike[str] | None = None
    ) -> IOFuture:
        """Fill all of ``buf`` from ``fd`` at ``offset``; ``path`` names the file in errors."""
        return self._submit("read", fd, buf, offset, path)

    def pwrite(
        self, fd: int, buf: torch.Tensor, offset: int, *, path: str | os.PathLike[str] | None = None
    ) -> IOFuture:
        """Write all of ``buf`` to ``fd`` at ``offset``; ``path`` names the file in errors."""
        return self._submit("write", fd, buf, offset, path)

    def _submit(
        self, op: str, fd: int, buf: torch.Tensor, offset: int, path: str | os.PathLike[str] | None
    ) -> IOFuture:
        if self.closed:
            raise RuntimeError("AioEngine is closed")
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        view = byte_view(buf)
        total = len(view)
        if total == 0:
            return IOFuture.completed(0)
        name = os.fspath(path) if path is not None else f"<fd {fd}>"
        block = self.block_bytes
        request = _Request(-(-total // block), buf)
        for start in range(0, total, block):
            self._tasks.put((op, fd, view[start : start + block], offset + start, name, request))
        return request.future

    def close(self) -> None:
        """Finish the requests already queued, then stop the threads; idempotent."""
        self._closer()

    def __enter__(self) -> AioEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"AioEngine(threads={self.threads}, block_bytes={self.block_bytes}, {state})"
