"""A shard's bytes in their home tier, and the per-tier byte ledger.

[Note: a shard knows its home tier]
Every piece of model state (training-dtype parameter shard, fp32 master shard, optimizer
moments, fp32 gradient shard) is a ``Stored`` object that knows its tier. Memory tiers keep
a live tensor; the NVMe tier keeps an extent of the rank's swap file and moves bytes only
through ``load``/``save``, which return futures so the schedule can issue them early and wait
late. Code above this file never asks *where* a shard is, only for its bytes.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from enum import Enum
from typing import Protocol

import torch
import xxhash

from outcore.errors import StorageError


class Tier(str, Enum):
    """A place bytes live, fastest first: iterating ``Tier`` gives the order reports use.

    [Note: two spellings of a tier]
    The config names where state is offloaded *to* (``offload.params: none | cpu | nvme``,
    DeepSpeed's spelling, ``none`` for not offloaded); the ledger, ``memory_report()`` and the
    metrics name the tier itself (``device | host | nvme``). ``for_placement`` is the one
    mapping from the first to the second; nothing else spells it out.
    """

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"

    @classmethod
    def for_placement(cls, placement: str) -> Tier:
        """Map a config value (``none | cpu | nvme``) to the tier it names."""
        return _BY_PLACEMENT[placement]


_BY_PLACEMENT = {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}


class Ledger:
    """Bytes held per (tier, kind), counted by the code that allocates them.

    Thread-safe because I/O threads and the optimizer update it concurrently.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str], int] = defaultdict(int)
        self._peak: dict[str, int] = defaultdict(int)
        self._kind_peak: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, tier: str, kind: str, nbytes: int) -> None:
        with self._lock:
            self._bytes[(tier, kind)] += nbytes
            key = (tier, kind)
            self._kind_peak[key] = max(self._kind_peak[key], self._bytes[key])
            total = sum(v for (t, _), v in self._bytes.items() if t == tier)
            self._peak[tier] = max(self._peak[tier], total)

    def tier_bytes(self, tier: str) -> int:
        with self._lock:
            return sum(v for (t, _), v in self._bytes.items() if t == tier)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            out = {f"{t}.{k}": v for (t, k), v in sorted(self._bytes.items())}
            out.update({f"peak.{t}": v for t, v in self._peak.items()})
            out.update({f"peak.{t}.{k}": v for (t, k), v in sorted(self._kind_peak.items())})
            return out

    def reset_peaks(self) -> None:
        """Start peak tracking afresh from the current values (e.g. after warm-up)."""
        with self._lock:
            self._kind_peak = defaultdict(int, self._bytes)
            tiers = {t for t, _ in self._bytes}
            self._peak = defaultdict(int, {t: sum(v for (u, _), v in self._bytes.items()
                                                  if u == t) for t in tiers})


class Future(Protocol):
    def result(self, timeout: float | None = None) -> object: ...


class _Ready:
    """A future that is already complete (memory tiers never wait)."""

    def __init__(self, value: object = None) -> None:
        self._value = value

    def result(self, timeout: float | None = None) -> object:
        return self._value

    def done(self) -> bool:
        return True


class Stored:
    """One tensor of model state, living in ``tier``; see the note above."""

    tier: Tier
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def resident(self) -> torch.Tensor | None:
        """The live tensor for memory tiers; ``None`` when the bytes are on disk."""
        raise NotImplementedError

    def load(self, out: torch.Tensor) -> Future:
        """Copy the stored bytes into ``out`` (a contiguous tensor of ``numel`` elements)."""
        raise NotImplementedError

    def save(self, src: torch.Tensor) -> Future:
        """Overwrite the stored bytes with ``src``; ``src`` may be reused after ``result()``."""
        raise NotImplementedError

    def free(self) -> None:
        raise NotImplementedError

    def load_range(self, start: int, out: torch.Tensor) -> Future:
        """Copy elements ``[start, start + out.numel())`` into ``out``."""
        raise NotImplementedError

    def save_range(self, start: int, src: torch.Tensor) -> Future:
        """Overwrite elements ``[start, start + src.numel())`` with ``src``."""
        raise NotImplementedError


class MemoryStored(Stored):
    """State kept as a tensor in device or host memory."""

    def __init__(self, tensor: torch.Tensor, tier: Tier, kind: str, ledger: Ledger) -> None:
        self.tensor = tensor
        self.tier, self.numel, self.dtype = tier, tensor.numel(), tensor.dtype
        self._kind, self._ledger = kind, ledger
        ledger.add(tier.value, kind, self.nbytes)

    def resident(self) -> torch.Tensor:
        return self.tensor

    def load(self, out: torch.Tensor) -> Future:
        out.copy_(self.tensor)
        return _Ready(out)

    def save(self, src: torch.Tensor) -> Future:
        if src.data_ptr() != self.tensor.data_ptr():
            self.tensor.copy_(src)
        return _Ready()

    def free(self) -> None:
        if self.tensor is not None:
            self._ledger.add(self.tier.value, self._kind, -self.nbytes)
            self.tensor = None  # type: ignore[assignment]

    def load_range(self, start: int, out: torch.Tensor) -> Future:
        out.copy_(self.tensor[start : start + out.numel()])
        return _Ready(out)

    def save_range(self, start: int, src: torch.Tensor) -> Future:
        dst = self.tensor[start : start + src.numel()]
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(src)
        return _Ready()


def digest(t: torch.Tensor) -> int:
    """xxh3-64 of a contiguous CPU tensor's bytes (several times as fast as crc32)."""
    from outcore.offload.aio import byte_view

    flat = t.detach().reshape(-1).view(torch.uint8)
    return xxhash.xxh3_64_intdigest(byte_view(flat))


class NvmeStored(Stored):
    """State kept in an extent of this rank's swap file.

    [Note: every extent read is verified]
    Each save records the xxh3 digest of the bytes it wrote, per element range, and each load
    checks what came back (on the I/O thread that finished the read, so the check overlaps
    the caller's compute and a failed check is the read's error), so a bit flipped on disk
    or a torn write surfaces as a ``StorageError`` naming the swap file and offset, never as
    silently wrong weights. Ranges
    are tracked because the optimizer writes slices: a later load of any range that the saved
    pieces tile exactly is verified piece by piece. Hashing runs several times faster than
    the disk reads, so it costs a fraction of the I/O time, but that time is a core's
    (measured: bench/RESULTS.md, 'xxh3 digests'). On a host with few cores and a trusted
    disk that core may be worth more than the check: ``offload.verify_swap: false`` neither
    hashes nor verifies.
    """

    def __init__(self, store, numel: int, dtype: torch.dtype, kind: str, ledger: Ledger,
                 verify: bool = True) -> None:
        self.tier, self.numel, self.dtype = Tier.NVME, numel, dtype
        self._store, self._kind, self._ledger = store, kind, ledger
        self.verify = verify
        self.extent = store.allocate(max(self.nbytes, 1))
        self._sums: dict[int, tuple[int, int]] = {}  # start -> (numel, digest)
        ledger.add(Tier.NVME.value, kind, self.nbytes)

    def resident(self) -> None:
        return None

    def load(self, out: torch.Tensor) -> Future:
        return self.load_range(0, out)

    def save(self, src: torch.Tensor) -> Future:
        return self.save_range(0, src)

    def _sub_extent(self, start: int, numel: int):
        """The part of the extent holding elements ``[start, start + numel)``.

        Callers cut ranges at 4 KiB boundaries (optimizer.py), as O_DIRECT needs aligned offsets.
        """
        esize = self.nbytes // max(self.numel, 1)
        offset = self.extent.offset + start * esize
        nbytes = numel * esize
        return type(self.extent)(offset, nbytes, -(-nbytes // 4096) * 4096)

    def load_range(self, start: int, out: torch.Tensor) -> Future:
        fut = self._store.read(self._sub_extent(start, out.numel()), out)
        pieces = self._pieces(start, out.numel())
        if not pieces:
            return fut

        def check(ok: bool) -> None:  # on the I/O thread that completed the read
            if ok:
                self._verify(start, out, pieces)

        return fut.then(check, out.numel() * self.dtype.itemsize)

    def save_range(self, start: int, src: torch.Tensor) -> Future:
        src = src.contiguous()
        if not self.verify:  # nothing recorded, so no load finds pieces to check
            return self._store.write(self._sub_extent(start, src.numel()), src)
        # the disk starts on the bytes while this thread hashes them (both only read ``src``)
        fut = self._store.write(self._sub_extent(start, src.numel()), src)
        stop = start + src.numel()
        # one assignment, so a read issued on another thread sees the old map or the new one
        sums = {lo: v for lo, v in self._sums.items() if not (lo < stop and lo + v[0] > start)}
        sums[start] = (src.numel(), digest(src))
        self._sums = sums
        return fut

    def _pieces(self, start: int, numel: int) -> list[tuple[int, int, int]]:
        """(start, numel, digest) of the saved pieces tiling ``[start, start + numel)``,
        taken when the read is issued; empty if they do not tile it (e.g. never written)."""
        pieces, pos, stop, sums = [], start, start + numel, self._sums
        while pos < stop:
            n, want = sums.get(pos, (0, None))
            if want is None or pos + n > stop:
                return []
            pieces.append((pos, n, want))
            pos += n
        return pieces

    def _verify(self, start: int, out: torch.Tensor, pieces: list[tuple[int, int, int]]) -> None:
        for pos, n, want in pieces:
            if digest(out[pos - start : pos - start + n]) != want:
                off = self._sub_extent(pos, n).offset
                raise StorageError(f"checksum mismatch in {self._store.path} at offset {off} "
                                   f"({n} elements of {self._kind}): the swap file was "
                                   "corrupted or truncated on disk")

    def free(self) -> None:
        if self.extent is not None:
            if not self._store.closed:  # a closed store already deleted the whole file
                self._store.free(self.extent)
            self._ledger.add(Tier.NVME.value, self._kind, -self.nbytes)
            self.extent = None
            self._sums.clear()


def load_now(stored: Stored, device: torch.device | None = None) -> torch.Tensor:
    """The stored tensor, read synchronously (resident tensors are returned, not copied)."""
    t = stored.resident()
    if t is not None:
        return t
    out = torch.empty(stored.numel, dtype=stored.dtype, device=device)
    stored.load(out).result()
    return out
