"""A model's own ``*.safetensors`` files, read in place: headers, identity and chunked reads.

[Note: the base stays where it is]
A frozen base loaded from a Hugging Face folder already sits on disk, in a format whose
tensors are row-major byte ranges at offsets the header names. Copying it into the swap file
would write the base again (as many bytes as the model, minutes for a large one) and hold it
on disk twice, and a checkpoint would store it a third time. So a frozen parameter whose
values come from such a file reads them from that file, at their offsets, through the same
I/O engine as the swap file; outcore never writes a byte of it.

[Note: reading at a file's own offsets]
O_DIRECT needs the file offset, the length and the memory address aligned to 4 KiB, and a
tensor in a safetensors file starts wherever the previous one ended. So each read covers the
aligned pages around the bytes wanted, lands in one of this reader's own aligned buffers, and
the wanted bytes are copied (cast, where the compute dtype differs from the file's) into
their destination on the I/O thread that finished the read. Buffered reads would take any
offset, but cost the kernel a copy and page-cache pages per byte: measured on this project's
machine, ~0.35 CPU-seconds per GB buffered against ~0.02 with O_DIRECT, plus the copy out of
the buffer, which a cast needs anyway. A read is cut into chunks at fixed file offsets
(multiples of the chunk size), and the chunks of all reads queue for the buffers: a chunk
starts when a buffer is free, so issuing a read never blocks the caller (a prefetch issued
ahead of compute must not wait for the disk). A chunk whose pages would run past the file's
end (at most the file's last 4 MiB) is read without O_DIRECT, as a read that ends at the
file's end cannot be a whole page.

[Note: a base changed during a run is detected]
The first read of each chunk records the xxh3 digest of its bytes; every later read of the
same chunk is checked against it on the I/O thread that finished it, so a file rewritten
while the model trains raises ``StorageError`` naming the file and the bytes instead of
training on other weights. That costs no pass beyond the reads training does anyway.
Checkpoints record each file's size, modification time and content hash (``content_hash``)
instead of the base's bytes, and a resume compares them (io/checkpoint.py).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import math
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from outcore.errors import ConfigError, StorageError
from outcore.offload.aio import AioEngine, IOFuture, byte_view, transfer
from outcore.offload.buffers import ALIGN, aligned_empty

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
CHUNK_BYTES = 4 << 20
"""Bytes per read chunk: the I/O engine's block size (aio.py's [Note: default block size])."""
BUFFERS = 8
"""Chunks in flight: one per I/O thread."""
_HEADER_LIMIT = 100 << 20  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: its file, dtype, shape and absolute byte offset."""

    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Identity:
    """What a quick check compares: size and modification time (plus the inode)."""

    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> Identity:
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of a safetensors file (io/safetensors_stream.py's [Note: the safetensors
    layout, exactly]); ``ConfigError`` naming the file if it is not one."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= min(_HEADER_LIMIT, size - 8):
                raise ValueError(f"header length {n} does not fit a file of {size} bytes")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise ConfigError(f"{path} is not a readable safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path} is not a readable safetensors file: its header is no map")
    start, out = 8 + n, {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[spec["dtype"]]
            begin, end = (int(x) for x in spec["data_offsets"])
            shape = tuple(int(d) for d in spec["shape"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{path}: tensor {name!r} has a malformed header entry {spec}"
                              ) from None
        if not 0 <= begin <= end <= size - start:
            raise ConfigError(f"{path}: tensor {name!r} lies outside the file (bytes {begin}.."
                              f"{end} of data, the file holds {size - start}); truncated?")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ConfigError(f"{path}: tensor {name!r} of shape {list(shape)} in {spec['dtype']} "
                              f"needs {math.prod(shape) * dtype.itemsize} bytes, its header "
                              f"gives {end - begin}")
        if (start + begin) % dtype.itemsize:
            # the safetensors library pads the header so that every tensor is aligned
            raise ConfigError(f"{path}: tensor {name!r} starts at byte {start + begin}, not a "
                              f"multiple of its element size {dtype.itemsize}; save the file "
                              "again with the safetensors library")
        out[name] = TensorEntry(name, Path(path).resolve(), dtype, shape, start + begin,
                                end - begin)
    return out


def content_hash(path: Path, progress: Callable[[int], None] | None = None,
                 engine: AioEngine | None = None, opened: _File | None = None) -> str:
    """xxh3-128 of the whole file (``progress(n)`` after each piece). Pieces of 4 MiB are
    read ahead with O_DIRECT on ``engine``'s threads (eight in flight) and hashed in order,
    so the hash runs at the disk's rate, leaves no page cache behind and holds 32 MiB.
    ``opened``: the file as a reader holds it open (``SourceReader.opened``), hashed through
    its descriptors: what that reader reads, though the path now names another file."""
    h, f = xxhash.xxh3_128(), opened or _File(Path(path))
    own = engine is None
    engine = engine or AioEngine(threads=BUFFERS)
    size, block = f.identity.size, CHUNK_BYTES
    bufs = [aligned_empty(block) for _ in range(BUFFERS)]
    try:
        fd = f.direct
        direct_end = size // block * block if fd is not None else 0
        offsets = list(range(0, direct_end, block))
        pending: collections.deque[tuple[IOFuture, torch.Tensor, int]] = collections.deque()
        for i, off in enumerate(offsets):
            if len(pending) == BUFFERS:
                _hash_done(h, pending.popleft(), progress)
            buf = bufs[i % BUFFERS]
            assert fd is not None  # offsets is empty without O_DIRECT
            pending.append((engine.pread(fd, buf, off, path=f.path), buf, block))
        while pending:
            _hash_done(h, pending.popleft(), progress)
        pos = direct_end  # what O_DIRECT cannot take, the end, through the buffered one
        while piece := os.pread(f.buffered, block, pos):
            h.update(piece)
            pos += len(piece)
            if progress is not None:
                progress(len(piece))
    finally:
        if opened is None:
            f.close()
        if own:
            engine.close()
    return h.hexdigest()


def _hash_done(h: Any, item: tuple[IOFuture, torch.Tensor, int],
               progress: Callable[[int], None] | None) -> None:
    fut, buf, n = item
    fut.result()
    h.update(byte_view(buf[:n]))
    if progress is not None:
        progress(n)


class _File:
    """One open base file: an O_DIRECT descriptor where the filesystem allows, a buffered one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.identity = Identity.of(path)
        self.buffered = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.direct: int | None = None
        flag = getattr(os, "O_DIRECT", 0)
        if flag and self.identity.size >= ALIGN:
            try:
                fd = os.open(path, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                return  # no O_DIRECT here: buffered reads
            try:
                works = self._direct_works(fd)
            except OSError:
                works = False
            if works:
                self.direct = fd
            else:
                os.close(fd)

    def _direct_works(self, fd: int) -> bool:
        page = aligned_empty(ALIGN)
        try:
            transfer("read", fd, byte_view(page), 0, str(self.path))
        except StorageError as e:
            if e.errno == errno.EINVAL:
                return False
            raise
        return True

    def close(self) -> None:
        for fd in (self.direct, self.buffered):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.direct, self.buffered = None, -1


Check = Callable[[int, torch.Tensor], None]
"""Called with (chunk's file offset, its bytes) on the I/O thread, before they are used."""


@dataclass
class _Chunk:
    file: _File
    offset: int  # file offset of the first wanted byte
    nbytes: int
    out: torch.Tensor  # where the bytes go (any dtype: cast on the copy)
    dtype: torch.dtype  # the file's dtype
    check: Check | None
    future: IOFuture


class SourceReader:
    """Reads byte ranges of read-only files into tensors, through ``engine`` and a few aligned
    buffers of its own; see [Note: reading at a file's own offsets]."""

    def __init__(self, engine: AioEngine, chunk_bytes: int = CHUNK_BYTES,
                 buffers: int = BUFFERS, *, pin: bool = False) -> None:
        """``pin``: page-locked buffers (buffers.py's [Note: the CUDA seam])."""
        self.engine, self.chunk_bytes = engine, chunk_bytes
        self._files: dict[Path, _File] = {}
        self._lock = threading.Condition()
        self._inflight = 0  # chunks queued or reading: close() waits for them
        self._queue: collections.deque[_Chunk] = collections.deque()
        self._free = [aligned_empty(chunk_bytes + 2 * ALIGN, pin=pin) for _ in range(buffers)]
        self.capacity_bytes = sum(b.numel() for b in self._free)
        """Host memory of the read buffers (the runtime puts it on the ledger)."""
        self.bytes_read = 0
        """Bytes delivered to callers (the file bytes, before any cast)."""
        self.closed = False

    def file(self, path: Path) -> _File:
        """The open file at ``path`` (opened once per reader)."""
        path = Path(path).resolve()
        with self._lock:
            if self.closed:
                raise RuntimeError("SourceReader is closed")
            f = self._files.get(path)
            if f is None:
                try:
                    f = self._files[path] = _File(path)
                except OSError as e:
                    raise StorageError(f"cannot open the base file {path}: {e.strerror}"
                                       ) from None
            return f

    def opened(self, path: Path) -> _File | None:
        """The file at ``path`` if this reader has opened it (it stays open until close)."""
        with self._lock:
            return self._files.get(Path(path).resolve())

    def read(self, path: Path, offset: int, out: torch.Tensor, dtype: torch.dtype,
             check: Check | None = None) -> IOFuture:
        """Fill contiguous ``out`` (``n`` elements, any dtype) from the ``n`` elements of
        ``dtype`` at byte ``offset`` of ``path``; ``check`` sees each chunk's bytes first."""
        f = self.file(path)
        nbytes, parts = out.numel() * dtype.itemsize, []
        flat, pos, esize = out.view(-1), offset, dtype.itemsize
        while pos < offset + nbytes:
            stop = min(offset + nbytes, (pos // self.chunk_bytes + 1) * self.chunk_bytes)
            lo, hi = (pos - offset) // esize, (stop - offset) // esize
            parts.append(_Chunk(f, pos, stop - pos, flat[lo:hi], dtype, check, IOFuture()))
            pos = stop
        with self._lock:
            if self.closed:  # close() ran since file(): its descriptors are gone
                raise RuntimeError("SourceReader is closed")
            self._queue.extend(parts)
            self._inflight += len(parts)
        self._pump()
        return IOFuture.gather(c.future for c in parts)

    def _pump(self) -> None:
        """Start queued chunks while buffers are free (any thread; never blocks). A chunk that
        cannot start fails here, in this loop, so a long queue does not recurse."""
        while True:
            with self._lock:
                if not self._queue or not self._free:
                    return
                chunk, buf = self._queue.popleft(), self._free.pop()
            error = self._start(chunk, buf)
            if error is not None:
                self._settle(chunk, buf, error)

    def _start(self, chunk: _Chunk, buf: torch.Tensor) -> BaseException | None:
        f = chunk.file
        lo = chunk.offset // ALIGN * ALIGN
        hi = -(-(chunk.offset + chunk.nbytes) // ALIGN) * ALIGN
        direct = f.direct is not None and hi <= f.identity.size
        if not direct:  # the file's last page, or no O_DIRECT: exactly the bytes wanted
            lo, hi = chunk.offset, chunk.offset + chunk.nbytes
        fd = f.direct if direct else f.buffered
        assert fd is not None
        try:
            fut = self.engine.pread(fd, buf[: hi - lo], lo, path=f.path)
        except BaseException as e:  # noqa: BLE001 - handed to the chunk's future
            return e
        fut.add_done_callback(lambda done: self._done(chunk, buf, lo, done))
        return None

    def _done(self, chunk: _Chunk, buf: torch.Tensor, lo: int, done: IOFuture) -> None:
        error = done.exception()
        if error is None:
            try:
                raw = buf[chunk.offset - lo : chunk.offset - lo + chunk.nbytes]
                if chunk.check is not None:
                    chunk.check(chunk.offset, raw)
                chunk.out.copy_(raw.view(chunk.dtype))
            except BaseException as e:  # noqa: BLE001 - handed to the chunk's future
                error = e
        self._finish(chunk, buf, error)

    def _finish(self, chunk: _Chunk, buf: torch.Tensor, error: BaseException | None) -> None:
        self._settle(chunk, buf, error)
        self._pump()

    def _settle(self, chunk: _Chunk, buf: torch.Tensor, error: BaseException | None) -> None:
        """Give the buffer back and complete the chunk's future."""
        with self._lock:
            self._free.append(buf)
            self._inflight -= 1
            if error is None:
                self.bytes_read += chunk.nbytes
            self._lock.notify_all()
        if error is None:
            chunk.future.set_result(chunk.nbytes)
        else:
            chunk.future.set_exception(error)

    def read_elements(self, entry: TensorEntry, start: int, out: torch.Tensor,
                      check: Check | None = None) -> IOFuture:
        """Elements ``[start, start + out.numel())`` of ``entry``'s flattened tensor into
        ``out`` (cast to its dtype)."""
        return self.read(entry.path, entry.offset + start * entry.dtype.itemsize, out,
                         entry.dtype, check)

    def read_now(self, entry: TensorEntry, start: int, out: torch.Tensor) -> None:
        """``read_elements`` and wait."""
        self.read_elements(entry, start, out).result()

    def close(self) -> None:
        """Wait for the reads in flight, then close the files; idempotent."""
        with self._lock:
            self.closed = True
            self._lock.wait_for(lambda: self._inflight == 0)
            files, self._files = list(self._files.values()), {}
        for f in files:
            f.close()


def digest(raw: torch.Tensor) -> int:
    """xxh3-64 of a contiguous uint8 CPU tensor."""
    return xxhash.xxh3_64_intdigest(byte_view(raw))
