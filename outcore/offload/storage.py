"""A shard's bytes in their home tier.

[Note: a shard knows its home tier]
Every piece of model state (training-dtype parameter shard, fp32 master shard, optimizer
moments, fp32 gradient shard) is a ``StoredShard`` object that knows its tier. Memory tiers keep
a live tensor; the NVMe tier keeps an extent of the rank's swap file and moves bytes only
through ``load``/``save``, which return futures so the schedule can issue them early and wait
late. Code above this file never asks *where* a shard is, only for its bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import xxhash

from outcore.errors import StorageError
from outcore.offload.aio import byte_view
from outcore.offload.ledger import Charge, Kind, Ledger
from outcore.offload.tier import Tier

if TYPE_CHECKING:
    from outcore.offload.nvme import Extent, NvmeStore


class Future(Protocol):
    """What ``load``/``save`` return: an ``IOFuture`` on NVMe, ``_Ready`` in memory. The
    update pipeline waits on them through ``exception()`` (optim/pipeline.py's first_error)."""

    def result(self, timeout: float | None = None) -> object: ...

    def exception(self, timeout: float | None = None) -> BaseException | None: ...


class _Ready:
    """A future that is already complete (memory tiers never wait)."""

    def __init__(self, value: object = None) -> None:
        self._value = value

    def result(self, timeout: float | None = None) -> object:
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return None

    def done(self) -> bool:
        return True


class StoredShard:
    """One tensor of model state, living in ``tier``; see the note above."""

    tier: Tier
    numel: int
    dtype: torch.dtype
    read_only = False
    """True for a shard read in place from a file outcore never writes (file_shard.py)."""

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

    # [Note: tentative writes]
    # A speculative update (optim/speculation.py's [Note: a speculative step]) writes its
    # results aside: reads keep returning the current bytes until ``keep_aside`` makes what was
    # written aside current, or ``drop_aside`` forgets it. On NVMe "aside" is a second extent
    # (NvmeShard). Memory tiers keep no second copy, so the plan speculates only with the state
    # on NVMe; a training copy in memory is overwritten in place by the update, and rewritten
    # from its master by the update that follows a rollback (or cast again where none does).
    def reserve_aside(self) -> None:
        """Make room for tentative writes now, so a full disk fails here, not mid-update."""

    def save_range_aside(self, start: int, src: torch.Tensor) -> Future:
        """Write elements ``[start, start + src.numel())`` tentatively (see the note)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no second copy to write aside")

    def keep_aside(self) -> None:
        """What was written aside becomes the stored value."""

    def drop_aside(self) -> None:
        """Forget what was written aside; the stored value stays what it was."""

    def release_aside(self) -> None:
        """Give back the room ``reserve_aside`` made (forgetting what was written there)."""


class MemoryShard(StoredShard):
    """State kept as a tensor in device or host memory."""

    def __init__(self, tensor: torch.Tensor, tier: Tier, kind: Kind, ledger: Ledger) -> None:
        self.tensor = tensor
        self.tier, self.numel, self.dtype = tier, tensor.numel(), tensor.dtype
        self._charge: Charge = ledger.charge(tier, kind, self.nbytes)

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
        self._charge.release()
        self.tensor = None  # type: ignore[assignment]

    def load_range(self, start: int, out: torch.Tensor) -> Future:
        out.copy_(self.tensor[start : start + out.numel()])
        return _Ready(out)

    def save_range(self, start: int, src: torch.Tensor) -> Future:
        dst = self.tensor[start : start + src.numel()]
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(src)
        return _Ready()


class CastShard(StoredShard):
    """A trainable parameter's training-dtype values as a cast of its fp32 master in memory,
    made on each read and stored nowhere.

    [Note: the training copy is derived from masters in memory]
    The training-dtype shard of a trainable parameter is, by construction, its master cast
    to the compute dtype: the optimizer writes it that way after every update, and so does
    every write of values (``ShardedParam.write_shard``, checkpoint loads), master first. With
    the parameters on NVMe and the masters in memory, keeping that copy on disk buys no
    memory (the masters, twice its size in 16 bits, are in memory anyway) and costs a write
    after each update and a read, with its digest, at each fetch, on the host's cores that
    the compute needs (measured: bench/results/2026-11-26-intel-amx-bf16-derived-params.md).
    So such a parameter's training shard is this: a read casts the master into the caller's
    tensor (one pass, what the optimizer's write-back did before), a save stores nothing,
    since its bytes are already the master's. Frozen parameters have no master and keep
    their shard on NVMe; with the masters on NVMe the 16-bit copy is half the bytes to read
    and stays. The plan's ``derives_compute_copy`` decides; ``nbytes`` is 0 because nothing
    is stored.
    """

    def __init__(self, master: StoredShard, dtype: torch.dtype) -> None:
        assert master.resident() is not None, "a cast shard needs its master in memory"
        self.master, self.dtype = master, dtype
        self.tier, self.numel = master.tier, master.numel

    @property
    def nbytes(self) -> int:
        return 0

    @property
    def master_on_host(self) -> bool:
        """Whether the master is in host memory (a fetch for an accelerator then casts on
        the host and copies half its bytes: group.py's [Note: disk reads reach the device
        through host memory])."""
        master = self.master.resident()
        assert master is not None
        return master.device.type == "cpu"

    def resident(self) -> None:
        return None

    def load(self, out: torch.Tensor) -> Future:
        return self.load_range(0, out)

    def load_range(self, start: int, out: torch.Tensor) -> Future:
        master = self.master.resident()
        assert master is not None  # checked at construction; masters in memory stay there
        out.copy_(master[start : start + out.numel()])  # casts, and crosses devices
        return _Ready(out)

    def save(self, src: torch.Tensor) -> Future:
        return _Ready()  # the master was saved first: see the note

    def save_range(self, start: int, src: torch.Tensor) -> Future:
        return _Ready()

    def free(self) -> None:
        pass  # owns nothing: the master is freed as the master


def digest(t: torch.Tensor) -> int:
    """xxh3-64 of a contiguous CPU tensor's bytes (several times as fast as crc32)."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    return xxhash.xxh3_64_intdigest(byte_view(flat))


class NvmeShard(StoredShard):
    """State kept in an extent of this rank's swap file.

    [Note: every extent read is verified]
    Each save records the xxh3 digest of the bytes it wrote, per element range, and each load
    checks what came back (on the I/O thread that finished the read, so the check overlaps
    the caller's compute and a failed check is the read's error), so a bit flipped on disk
    or a torn write surfaces as a ``StorageError`` naming the swap file and offset, never as
    silently wrong weights. Ranges are tracked because the optimizer writes slices: a later
    load of any range that the saved pieces tile exactly is verified piece by piece. Hashing
    runs several times faster than the disk reads (xxh3 at 20-27 GiB/s on one core), so it
    costs a fraction of the I/O time, but that time is a core's: 0.24 CPU-s of a gpt-335m
    step that moves 8 GB (measured: bench/results/2026-11-26-intel-amx-bf16-cpu-split.md,
    2026-11-27-amd-zen5-bf16-pipeline-ab.md, 2026-11-28-amd-zen5-bf16-offload-cpu.md). On a
    host with few cores and a trusted disk that core may be worth more than the check:
    ``offload.verify_swap: false`` neither hashes nor verifies.
    """

    def __init__(self, store: NvmeStore, numel: int, dtype: torch.dtype, kind: Kind,
                 ledger: Ledger, verify: bool = True) -> None:
        self.tier, self.numel, self.dtype = Tier.NVME, numel, dtype
        self._store, self._kind = store, kind
        self.verify = verify
        self.extent: Extent | None = store.allocate(max(self.nbytes, 1))  # None once freed
        self._sums: dict[int, tuple[int, int]] = {}  # start -> (numel, digest)
        self._ledger = ledger
        self._charge: Charge = ledger.charge(Tier.NVME, kind, self.nbytes)
        # a second extent for tentative writes ([Note: tentative writes]), made on first use
        self._aside: Extent | None = None
        self._aside_charge: Charge | None = None
        self._aside_sums: dict[int, tuple[int, int]] = {}
        self._aside_elems = 0  # elements written aside since the last keep or drop

    def resident(self) -> None:
        return None

    def load(self, out: torch.Tensor) -> Future:
        return self.load_range(0, out)

    def save(self, src: torch.Tensor) -> Future:
        return self.save_range(0, src)

    def _sub_extent(self, start: int, numel: int, extent: Extent | None = None) -> Extent:
        """The part of the extent (or of ``extent``) holding elements ``[start, start + numel)``.

        Callers cut ranges at 4 KiB boundaries (optimizer.py), as O_DIRECT needs aligned offsets.
        """
        extent = self.extent if extent is None else extent
        assert extent is not None, "a freed NvmeShard has no bytes to move"
        esize = self.nbytes // max(self.numel, 1)
        offset = extent.offset + start * esize
        nbytes = numel * esize
        return type(extent)(offset, nbytes, -(-nbytes // 4096) * 4096)

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
        if self._aside_elems:  # a write of values supersedes a tentative update's
            self.drop_aside()
        fut, self._sums = self._write(self.extent, self._sums, start, src)
        return fut

    def _write(self, extent: Extent | None, sums: dict[int, tuple[int, int]], start: int,
               src: torch.Tensor) -> tuple[Future, dict[int, tuple[int, int]]]:
        """Write ``src`` at element ``start`` of ``extent``; the digests ``sums`` become."""
        src = src.to("cpu").contiguous()  # the disk is written from host memory
        if not self.verify:  # nothing recorded, so no load finds pieces to check
            return self._store.write(self._sub_extent(start, src.numel(), extent), src), sums
        # the disk starts on the bytes while this thread hashes them (both only read ``src``)
        fut = self._store.write(self._sub_extent(start, src.numel(), extent), src)
        stop = start + src.numel()
        # a new map, assigned at once, so a read issued on another thread sees the old map
        # or the new one
        sums = {lo: v for lo, v in sums.items() if not (lo < stop and lo + v[0] > start)}
        sums[start] = (src.numel(), digest(src))
        return fut, sums

    def reserve_aside(self) -> None:
        if self._aside is None and self.extent is not None:
            self._aside = self._store.allocate(max(self.nbytes, 1))
            self._aside_charge = self._ledger.charge(Tier.NVME, Kind.TENTATIVE, self.nbytes)

    def save_range_aside(self, start: int, src: torch.Tensor) -> Future:
        self.reserve_aside()
        fut, self._aside_sums = self._write(self._aside, self._aside_sums, start, src)
        self._aside_elems += src.numel()
        return fut

    def keep_aside(self) -> None:
        if not self._aside_elems:
            return
        # an update writes every slice of a shard once: anything less would keep holes
        assert self._aside_elems == self.numel, (self._aside_elems, self.numel)
        self.extent, self._aside = self._aside, self.extent
        self._sums, self._aside_sums, self._aside_elems = self._aside_sums, {}, 0

    def drop_aside(self) -> None:
        self._aside_sums, self._aside_elems = {}, 0

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
                                   f"({n} elements of {self._kind.value}): the swap file was "
                                   "corrupted or truncated on disk")

    def release_aside(self) -> None:
        self.drop_aside()
        if self._aside is not None:
            if not self._store.closed:
                self._store.free(self._aside)
            assert self._aside_charge is not None
            self._aside_charge.release()
            self._aside = self._aside_charge = None

    def free(self) -> None:
        self.release_aside()
        if self.extent is not None:
            if not self._store.closed:  # a closed store already deleted the whole file
                self._store.free(self.extent)
            self._charge.release()
            self.extent = None
            self._sums.clear()


def load_now(stored: StoredShard, device: torch.device | None = None) -> torch.Tensor:
    """The stored tensor, read synchronously (resident tensors are returned, not copied).

    Disk reads land in host memory (the I/O path takes CPU tensors only) and are then moved
    to ``device`` when that is an accelerator."""
    t = stored.resident()
    if t is not None:
        return t
    out = torch.empty(stored.numel, dtype=stored.dtype)
    stored.load(out).result()
    return out if device is None or device.type == "cpu" else out.to(device)
