"""Write safetensors files one tensor at a time, and checksum files while they are written.

``safetensors.torch.save_file`` wants every tensor of the file in memory at once; a checkpoint
of a model larger than host memory cannot do that. The format does not need it: the header
(names, dtypes, shapes, byte offsets) depends only on what *will* be written, so it can go
out first and the tensors follow one by one. Reading stays with the ``safetensors`` library
(``safe_open`` and ``get_slice``), which maps the file and copies only the slices asked for.

[Note: the safetensors layout, exactly]
A file is: 8 bytes, the header length N as an unsigned little-endian 64-bit integer; N bytes
of UTF-8 JSON; then the data. The JSON maps each tensor name to ``{"dtype", "shape",
"data_offsets": [begin, end]}`` with offsets relative to the start of the data, and may hold
``"__metadata__"``, a map of strings to strings. Tensors are stored row-major and
little-endian, back to back with no gaps, and the data ends with the last tensor. The JSON
is padded with spaces so the data starts at a multiple of 8 bytes. See
https://github.com/huggingface/safetensors#format.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}
"""The inverse of ``DTYPE_NAMES``: a header's dtype name (``get_slice(...).get_dtype()``)."""

CHECKSUM = "crc32"
_CHUNK = 8 << 20

# [Note: checksum cost]
# zlib.crc32 hashes at roughly a disk's own write rate, so hashing while writing can at worst
# double the write time, and in practice overlaps little; verifying on load reads the file once
# more and hashes it, a second pass of about the same cost. xxh3 (which the swap store already
# uses) is several times faster; the manifest records the algorithm name, so checkpoints can
# switch to it later.


def checksum_update(value: int, data: bytes | memoryview) -> int:
    """Fold ``data`` into a running checksum (start from 0)."""
    return zlib.crc32(data, value)


def checksum_hex(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


def file_checksum(path: Path) -> tuple[int, str]:
    """(size in bytes, checksum) of a file, read in fixed chunks: memory stays constant."""
    value, size = 0, 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            value = checksum_update(value, view[:n])
            size += n
    return size, checksum_hex(value)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the writer will receive: known before any byte is written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class FileInfo:
    """What a finished file looks like on disk: its size and checksum."""

    path: Path
    nbytes: int
    checksum: str


def header_bytes(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header for ``specs`` in this order (see the note above)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for s in specs:
        if s.name in header or s.name == "__metadata__":
            raise ValueError(f"duplicate or reserved tensor name {s.name!r}")
        if s.dtype not in DTYPE_NAMES:
            raise ValueError(f"{s.name}: dtype {s.dtype} has no safetensors name")
        header[s.name] = {"dtype": DTYPE_NAMES[s.dtype], "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, row-major little-endian, without copying a contiguous CPU tensor."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships on is little
        raise RuntimeError("safetensors needs little-endian bytes")
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class StreamWriter:
    """Write one safetensors file: header first, then each spec'd tensor in order.

    Bytes go to ``<path>.tmp``; ``finish()`` fsyncs and renames it to ``path``, so a reader
    never sees a half-written file under the final name. On an exception inside ``with``, the
    temporary file is removed. The checksum is computed over every byte as it is written, so
    no second pass is needed.
    """

    def __init__(self, path: Path, specs: list[TensorSpec],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self._specs = list(specs)
        self._next = 0
        head = header_bytes(self._specs, metadata)
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # umask applies
        self._f = os.fdopen(fd, "wb", buffering=_CHUNK)
        self._crc = 0
        self._size = 0
        self._put(memoryview(head))

    def _put(self, data: memoryview) -> None:
        self._f.write(data)
        self._crc = checksum_update(self._crc, data)
        self._size += len(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor; its name, dtype and shape must match the next spec."""
        spec = self._specs[self._next] if self._next < len(self._specs) else None
        if spec is None or spec.name != name:
            expected = spec.name if spec else "nothing more"
            raise ValueError(f"safetensors stream: got {name!r}, expected {expected!r}")
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{name}: got {tensor.dtype} {tuple(tensor.shape)}, "
                             f"spec says {spec.dtype} {spec.shape}")
        self._put(tensor_bytes(tensor))
        self._next += 1

    def finish(self) -> FileInfo:
        """Flush, fsync and rename into place; every spec'd tensor must have been written."""
        if self._next != len(self._specs):
            missing = [s.name for s in self._specs[self._next :]]
            raise ValueError(f"safetensors stream closed before writing {missing[:5]}")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)
        return FileInfo(self.path, self._size, checksum_hex(self._crc))

    def abort(self) -> None:
        """Close and delete the temporary file (nothing under the final name changes)."""
        if not self._f.closed:
            self._f.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()


def fsync_dir(path: Path) -> None:
    """Make a rename or create inside ``path`` durable (the directory entry itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, data: object) -> None:
    """Write JSON under a temporary name, fsync, then rename: readers see all of it or none."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # umask applies
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -- reading part of a flattened tensor, from one file or from consecutive pieces in several ----
def pieces_overlapping(numel: int, pieces: int, start: int, count: int) -> range:
    """Which of ``pieces`` equal cuts (``ceil(numel / pieces)`` each, the last short) of a flat
    tensor hold any of elements ``[start, start + count)``."""
    s = -(-numel // pieces)
    return range(start // s, (start + count - 1) // s + 1) if count else range(0)


def read_flat_range(handles: dict[int, Any], pieces: int, key: str, numel: int, a: int, b: int,
                    out: torch.Tensor) -> None:
    """Fill ``out[:b-a]`` with elements ``[a, b)`` of a flat tensor cut into ``pieces``.

    Piece k is tensor ``key`` in ``handles[k]`` (a ``safe_open`` handle) and holds elements
    ``[k*s, min((k+1)*s, numel))`` of the flat tensor, in row-major order whatever its shape;
    one piece (``{0: handle}``, ``pieces=1``) is a whole tensor read in part. Only the rows of
    each piece that hold wanted elements are read (``get_slice``), and ``out.copy_`` casts them
    to ``out``'s dtype.
    """
    s = -(-numel // pieces)
    for k in pieces_overlapping(numel, pieces, a, b - a) if b > a else ():
        lo, hi = max(a, k * s), min(b, (k + 1) * s)
        out[lo - a : hi - a].copy_(_read_rows(handles[k], key, lo - k * s, hi - k * s))


def _read_rows(h: Any, key: str, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of tensor ``key`` flattened, reading only the rows (slices
    along the first dimension) that hold them."""
    shape = h.get_slice(key).get_shape()
    if not shape:  # a scalar has no rows to slice
        return h.get_tensor(key).reshape(-1)[start:stop]
    row = math.prod(shape[1:])
    first, last = start // row, -(-stop // row)
    rows = h.get_slice(key)[first:last].reshape(-1)
    return rows[start - first * row : stop - first * row]
