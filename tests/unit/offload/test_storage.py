"""A shard's bytes in their home tier (storage.py's [Note: a shard knows its home tier]):
``MemoryShard`` keeps the tensor itself and moves bytes at once, ``NvmeShard`` keeps an extent
of the rank's swap file and moves them through futures; both round-trip whole tensors and
element ranges byte for byte, and ``free`` takes their charge off the ledger. Every NVMe read
of saved bytes is checked against the digest of what was written ([Note: every extent read is
verified]): a byte flipped on disk is a ``StorageError`` naming the swap file and offset,
unless ``verify=False``, which neither hashes nor checks. ``load_now`` returns a resident
tensor as is and reads a stored one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import outcore
from outcore.errors import StorageError
from outcore.offload.ledger import Kind, Ledger
from outcore.offload.storage import MemoryShard, NvmeShard, digest, load_now
from outcore.offload.tier import Tier
from outcore.runtime.context import Runtime

NUMEL = 4096  # 16 KiB of fp32: ranges cut at 1024 elements fall on 4 KiB boundaries


def _values(numel: int = NUMEL, seed: int = 0, dtype: torch.dtype = torch.float32
            ) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _runtime(tmp_path: Path, verify: bool = True) -> Runtime:
    return Runtime(outcore.Config.from_dict({"offload": {
        "params": "nvme", "nvme_path": str(tmp_path), "verify_swap": verify,
        "host_buffer_bytes": 1 << 20}}))


@pytest.fixture
def rt(tmp_path: Path) -> Iterator[Runtime]:
    runtime = _runtime(tmp_path)
    yield runtime
    runtime.close()


def _flip_byte(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, offset)
        assert len(old) == 1
        os.pwrite(fd, bytes([old[0] ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


# -- MemoryShard ------------------------------------------------------------------------------
def test_memory_shard_keeps_the_tensor_and_charges_its_bytes() -> None:
    ledger = Ledger()
    t = _values(10)
    shard = MemoryShard(t, Tier.HOST, Kind.MASTER, ledger)
    assert shard.resident() is t
    assert (shard.tier, shard.numel, shard.dtype, shard.nbytes) == (
        Tier.HOST, 10, torch.float32, 40)
    assert ledger.snapshot()["host.master"] == 40


def test_memory_shard_load_and_save_round_trip() -> None:
    ledger = Ledger()
    shard = MemoryShard(torch.zeros(8), Tier.HOST, Kind.PARAMS, ledger)
    src = _values(8, seed=1)
    fut = shard.save(src)
    assert fut.result() is None and fut.exception() is None
    src.zero_()  # the shard holds a copy, not ``src``
    out = torch.empty(8)
    assert shard.load(out).result() is out
    assert torch.equal(out, _values(8, seed=1))


def test_memory_shard_save_of_its_own_tensor_is_a_no_op() -> None:
    ledger = Ledger()
    t = _values(6)
    shard = MemoryShard(t, Tier.HOST, Kind.PARAMS, ledger)
    shard.save(t).result()
    shard.save_range(2, t[2:4]).result()
    assert torch.equal(shard.resident(), _values(6))


def test_memory_shard_ranges_touch_only_their_elements() -> None:
    ledger = Ledger()
    shard = MemoryShard(torch.zeros(10), Tier.HOST, Kind.OPTIMIZER, ledger)
    shard.save_range(3, torch.arange(1.0, 5.0)).result()
    assert shard.resident().tolist() == [0, 0, 0, 1, 2, 3, 4, 0, 0, 0]
    out = torch.full((3,), -1.0)
    assert shard.load_range(4, out).result() is out
    assert out.tolist() == [2, 3, 4]


def test_memory_shard_free_releases_its_charge_once() -> None:
    ledger = Ledger()
    keep = MemoryShard(torch.zeros(4), Tier.HOST, Kind.GRADS, ledger)
    shard = MemoryShard(torch.zeros(100), Tier.HOST, Kind.GRADS, ledger)
    assert ledger.snapshot()["host.grads"] == 416
    shard.free()
    assert ledger.snapshot()["host.grads"] == 16
    assert shard.tensor is None
    shard.free()
    assert ledger.snapshot()["host.grads"] == 16
    assert keep.nbytes == 16


# -- NvmeShard ----------------------------------------------------------------------------------
def test_nvme_shard_round_trips_through_the_swap_file(rt: Runtime) -> None:
    shard = NvmeShard(rt.nvme, NUMEL, torch.float32, Kind.MASTER, rt.ledger)
    assert shard.resident() is None and shard.tier is Tier.NVME
    assert rt.ledger.snapshot()["nvme.master"] == NUMEL * 4
    ref = _values()
    shard.save(ref).result()
    out = torch.empty(NUMEL)
    shard.load(out).result()
    assert torch.equal(out, ref)
    # the bytes are in the swap file, at the shard's extent
    assert shard.extent is not None
    with open(rt.nvme.path, "rb") as f:
        f.seek(shard.extent.offset)
        on_disk = f.read(NUMEL * 4)
    assert on_disk == ref.numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64])
def test_nvme_shard_round_trips_other_dtypes(rt: Runtime, dtype: torch.dtype) -> None:
    ref = (_values(NUMEL, seed=3) * 100).to(dtype)
    shard = NvmeShard(rt.nvme, NUMEL, dtype, Kind.PARAMS, rt.ledger)
    assert shard.nbytes == NUMEL * dtype.itemsize
    shard.save(ref).result()
    assert torch.equal(load_now(shard), ref)


def test_nvme_shard_ranges_round_trip_and_leave_the_rest(rt: Runtime) -> None:
    shard = NvmeShard(rt.nvme, NUMEL, torch.float32, Kind.OPTIMIZER, rt.ledger)
    ref = _values()
    shard.save(ref).result()
    new = _values(1024, seed=7)
    shard.save_range(1024, new).result()
    expect = ref.clone()
    expect[1024:2048] = new
    out = torch.empty(1024)
    shard.load_range(1024, out).result()
    assert torch.equal(out, new)
    whole = torch.empty(NUMEL)
    shard.load(whole).result()  # the overlapped whole-tensor digest was dropped: unchecked
    assert torch.equal(whole, expect)


def test_nvme_shard_loads_a_range_tiled_by_saved_slices(rt: Runtime) -> None:
    """The optimizer writes slices; a whole load is verified piece by piece."""
    shard = NvmeShard(rt.nvme, NUMEL, torch.float32, Kind.OPTIMIZER, rt.ledger)
    parts = [_values(1024, seed=10 + i) for i in range(4)]
    for i, part in enumerate(parts):
        shard.save_range(i * 1024, part).result()
    out = torch.empty(NUMEL)
    shard.load(out).result()
    assert torch.equal(out, torch.cat(parts))


def test_a_flipped_byte_on_disk_is_a_storage_error_naming_file_and_offset(
        rt: Runtime) -> None:
    shard = NvmeShard(rt.nvme, NUMEL, torch.float32, Kind.MASTER, rt.ledger)
    shard.save(_values()).result()
    assert shard.extent is not None
    _flip_byte(rt.nvme.path, shard.extent.offset + 100)
    with pytest.raises(StorageError, match="checksum mismatch") as err:
        shard.load(torch.empty(NUMEL)).result()
    message = str(err.value)
    assert str(rt.nvme.path) in message
    assert f"at offset {shard.extent.offset} " in message
    assert Kind.MASTER.value in message


def test_a_flipped_byte_names_the_offset_of_the_corrupt_piece(rt: Runtime) -> None:
    shard = NvmeShard(rt.nvme, NUMEL, torch.float32, Kind.OPTIMIZER, rt.ledger)
    for i in range(4):
        shard.save_range(i * 1024, _values(1024, seed=i)).result()
    assert shard.extent is not None
    piece = shard.extent.offset + 2 * 1024 * 4  # the third piece
    _flip_byte(rt.nvme.path, piece + 5)
    out = torch.empty(1024)
    shard.load_range(0, out).result()  # an untouched piece still reads clean
    assert torch.equal(out, _values(1024, seed=0))
    with pytest.raises(StorageError, match=f"at offset {piece} \\(1024 elements"):
        shard.load(torch.empty(NUMEL)).result()


def test_the_failed_check_is_the_futures_exception(rt: Runtime) -> None:
    shard = NvmeShard(rt.nvme, NUMEL, torch.float32, Kind.PARAMS, rt.ledger)
    shard.save(_values()).result()
    assert shard.extent is not None
    _flip_byte(rt.nvme.path, shard.extent.offset)
    fut = shard.load(torch.empty(NUMEL))
    assert isinstance(fut.exception(timeout=10), StorageError)


def test_verify_false_neither_records_nor_checks(tmp_path: Path) -> None:
    rt = _runtime(tmp_path, verify=False)
    try:
        shard = rt.store(_values(), Tier.NVME, Kind.MASTER)
        assert isinstance(shard, NvmeShard) and shard.verify is False
        assert shard._sums == {}
        assert shard.extent is not None
        _flip_byte(rt.nvme.path, shard.extent.offset + 100)
        out = torch.empty(NUMEL)
        shard.load(out).result()  # no error: the flipped byte comes back as is
        assert out.view(torch.uint8)[100] == _values().view(torch.uint8)[100] ^ 0xFF
        assert torch.equal(out.view(torch.uint8)[:100], _values().view(torch.uint8)[:100])
    finally:
        rt.close()


def test_a_range_never_saved_loads_unchecked(rt: Runtime) -> None:
    shard = NvmeShard(rt.nvme, NUMEL, torch.float32, Kind.GRADS, rt.ledger)
    shard.save_range(0, _values(1024)).result()
    out = torch.empty(1024)
    assert shard._pieces(2048, 1024) == []
    shard.load_range(2048, out).result()  # never written: nothing to check, no error
    assert out.shape == (1024,)


def test_a_digest_is_of_the_bytes() -> None:
    a = _values(16)
    assert digest(a) == digest(a.clone())
    b = a.clone()
    b.view(torch.uint8)[3] ^= 1
    assert digest(a) != digest(b)


def test_nvme_shard_free_gives_the_extent_back_and_releases_the_charge(rt: Runtime) -> None:
    shard = NvmeShard(rt.nvme, NUMEL, torch.float32, Kind.PARAMS, rt.ledger)
    shard.save(_values()).result()
    assert rt.ledger.snapshot()["nvme.params"] == NUMEL * 4
    shard.free()
    assert shard.extent is None and shard._sums == {}
    assert rt.ledger.snapshot()["nvme.params"] == 0
    shard.free()  # harmless
    assert rt.ledger.snapshot()["nvme.params"] == 0
    with pytest.raises(AssertionError, match="freed NvmeShard"):
        shard.load(torch.empty(NUMEL))


def test_free_after_the_store_closed_releases_the_charge(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    shard = rt.store(_values(), Tier.NVME, Kind.MASTER)
    path = rt.nvme.path
    rt.close()
    assert not path.exists()
    shard.free()
    assert rt.ledger.snapshot()["nvme.master"] == 0


# -- load_now ---------------------------------------------------------------------------------
def test_load_now_returns_a_resident_tensor_without_copying() -> None:
    t = _values(5)
    shard = MemoryShard(t, Tier.HOST, Kind.PARAMS, Ledger())
    assert load_now(shard) is t


def test_load_now_reads_a_stored_shard(rt: Runtime) -> None:
    shard = rt.store(_values(NUMEL, seed=4), Tier.NVME, Kind.PARAMS)
    got = load_now(shard)
    assert got.dtype == torch.float32 and got.shape == (NUMEL,)
    assert torch.equal(got, _values(NUMEL, seed=4))


# -- tentative writes (storage.py's [Note: tentative writes]) --------------------------------
@pytest.mark.parametrize("verify", [True, False])
def test_writes_aside_stay_unseen_until_kept(tmp_path: Path, verify: bool) -> None:
    """Reads return the stored bytes while new ones are written aside in slices; keeping
    them makes them the stored bytes (verified against their own digests), dropping them
    leaves the old ones, and a second extent is charged while it exists."""
    rt = _runtime(tmp_path, verify)
    try:
        old, new = _values(seed=1), _values(seed=2)
        shard = NvmeShard(rt.nvme, NUMEL, torch.float32, Kind.OPTIMIZER, rt.ledger, verify)
        shard.save(old).result()
        for lo in range(0, NUMEL, 1024):
            shard.save_range_aside(lo, new[lo : lo + 1024]).result()
        assert rt.ledger.tier_bytes("nvme") == 2 * NUMEL * 4
        assert torch.equal(load_now(shard), old)
        shard.keep_aside()
        assert torch.equal(load_now(shard), new)
        shard.save_range_aside(0, old).result()
        shard.drop_aside()
        assert torch.equal(load_now(shard), new)
        shard.keep_aside()  # nothing written aside since the drop: nothing changes
        assert torch.equal(load_now(shard), new)
        shard.release_aside()
        assert rt.ledger.tier_bytes("nvme") == NUMEL * 4
        shard.reserve_aside()
        assert rt.ledger.tier_bytes("nvme") == 2 * NUMEL * 4
        shard.free()
        assert rt.ledger.tier_bytes("nvme") == 0
    finally:
        rt.close()


def test_a_write_of_values_supersedes_what_was_written_aside(rt: Runtime) -> None:
    """A plain save after a tentative one (a user's write between backward and step) stands:
    keeping afterwards changes nothing, as the update it came from is dropped."""
    shard = NvmeShard(rt.nvme, NUMEL, torch.float32, Kind.MASTER, rt.ledger)
    shard.save(_values(seed=1)).result()
    shard.save_range_aside(0, _values(seed=2)).result()
    shard.save(_values(seed=3)).result()
    shard.keep_aside()
    assert torch.equal(load_now(shard), _values(seed=3))
    shard.free()


def test_keeping_a_partial_write_aside_is_refused(rt: Runtime) -> None:
    """An update writes every slice of a shard: keeping a part would keep holes."""
    shard = NvmeShard(rt.nvme, NUMEL, torch.float32, Kind.MASTER, rt.ledger)
    shard.save(_values(seed=1)).result()
    shard.save_range_aside(0, _values(numel=1024, seed=2)).result()
    with pytest.raises(AssertionError):
        shard.keep_aside()
    shard.free()


def test_memory_shards_refuse_to_write_aside() -> None:
    """A memory tier has no second copy, so it cannot hold a tentative value apart."""
    shard = MemoryShard(_values(), Tier.HOST, Kind.MASTER, Ledger())
    shard.reserve_aside()  # nothing to reserve
    with pytest.raises(NotImplementedError, match="no second copy"):
        shard.save_range_aside(0, _values())
