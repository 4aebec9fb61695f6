"""A frozen parameter's shard read from the model's own safetensors file (never written).

[Note: storage dtype apart from compute dtype]
The shard keeps the file's dtype: a bf16 base is read as bf16 bytes and cast to the compute
dtype as it lands in the gathered tensor (source_file.py's reader casts on the copy out of
its buffer), one layer at a time. So where the CPU computes in fp32 (bf16 emulated) the disk
still holds and reads two bytes per parameter, not four, and nothing holds an fp32 copy of
the base.

Writing a value into such a parameter (a user's ``p.data[...] = x``, a weight load) cannot
go to the user's file: the parameter then gets a swap-file shard of its own (zero/param.py's
``write_shard``), and from there on it is outcore's state like any other.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from outcore.errors import StorageError
from outcore.offload.aio import IOFuture
from outcore.offload.source_file import SourceReader, TensorEntry, digest
from outcore.offload.storage import Future, StoredShard
from outcore.offload.tier import Tier


class FileShard(StoredShard):
    """Elements ``[start, start + valid)`` of ``entry``'s flattened tensor, zero past ``valid``
    up to ``numel`` (this rank's padding); see the notes above and in source_file.py."""

    read_only = True

    def __init__(self, reader: SourceReader, entry: TensorEntry, start: int, valid: int,
                 numel: int, verify: bool = True) -> None:
        self.tier, self.numel, self.dtype = Tier.NVME, numel, entry.dtype
        self.reader, self.entry, self.start, self.valid = reader, entry, start, valid
        self.verify = verify
        self._sums: dict[tuple[int, int], int] = {}  # (file offset, bytes) -> first digest
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        return self.entry.path

    def resident(self) -> None:
        return None

    def rehome(self, reader: SourceReader) -> FileShard:
        """The same bytes through another runtime's reader (a second engine on the model)."""
        shard = FileShard(reader, self.entry, self.start, self.valid, self.numel, self.verify)
        shard._sums = dict(self._sums)
        return shard

    def load(self, out: torch.Tensor) -> Future:
        return self.load_range(0, out)

    def load_range(self, start: int, out: torch.Tensor) -> Future:
        flat = out.view(-1)
        n = min(flat.numel(), max(self.valid - start, 0))
        if n < flat.numel():
            flat[n:].zero_()  # this rank's padding past the tensor's end
        if n == 0:
            return IOFuture.completed(0)
        return self.reader.read_elements(self.entry, self.start + start, flat[:n],
                                         self._check if self.verify else None)

    def _check(self, offset: int, raw: torch.Tensor) -> None:
        """[Note: a base changed during a run is detected] (source_file.py)."""
        key, value = (offset, raw.numel()), digest(raw)
        with self._lock:
            want = self._sums.setdefault(key, value)
        if want != value:
            raise StorageError(
                f"the base file {self.path} changed while outcore used it: bytes {offset}.."
                f"{offset + raw.numel()} ({self.entry.name}) differ from what this run read "
                "there before; a model's files must not be modified while it trains")

    def save(self, src: torch.Tensor) -> Future:
        return self.save_range(0, src)

    def save_range(self, start: int, src: torch.Tensor) -> Future:
        raise StorageError(f"{self.entry.name} is read from {self.path}, which outcore never "
                           "writes; a write must give the parameter a shard of its own first")

    def free(self) -> None:
        self._sums = {}
