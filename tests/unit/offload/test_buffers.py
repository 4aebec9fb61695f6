"""Aligned buffers and the fixed buffer pool: alignment, blocking when exhausted, no growth."""

from __future__ import annotations

import gc
import sys
import threading
from pathlib import Path

import pytest
import torch

from outcore.offload.buffers import (
    ALIGN,
    HUGE_PAGE,
    AlignedRegions,
    BufferPool,
    aligned_empty,
    is_aligned,
    round_up,
)
from tests.common import resident_bytes

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed word of the THP switch ("always", "madvise", "never"), if readable."""
    try:
        text = _THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def _mapping_of(address: int) -> dict[str, int] | None:
    """The kB fields of /proc/self/smaps for the mapping holding ``address`` (None if none)."""
    fields: dict[str, int] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if fields is not None:
                return fields
            fields = {} if lo <= address < hi else None
        elif fields is not None and line.endswith(" kB"):
            key, value = line.split(":")
            fields[key] = int(value.split()[0])
    return fields


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 12345, 1 << 20])
@pytest.mark.parametrize("alignment", [512, ALIGN, 1 << 16])
def test_aligned_empty_is_aligned_uint8_of_requested_size(nbytes: int, alignment: int) -> None:
    buf = aligned_empty(nbytes, alignment=alignment)
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.numel() == nbytes
    assert buf.data_ptr() % alignment == 0
    buf.fill_(7)  # the whole slice is usable memory
    assert int(buf.sum()) == 7 * nbytes


def test_pin_is_ignored_without_cuda() -> None:
    buf = aligned_empty(8192, pin=True)
    assert is_aligned(buf) and buf.numel() == 8192
    pool = BufferPool(2 * ALIGN, ALIGN, pin=True)
    assert pool.pinned == torch.cuda.is_available()


def test_aligned_empty_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        aligned_empty(-1)
    with pytest.raises(ValueError):
        aligned_empty(10, alignment=3000)


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off or not Linux")
def test_large_buffers_are_backed_by_huge_pages_and_unmapped_when_dropped() -> None:
    """See buffers.py's [Note: huge pages under I/O buffers]: what matters is the memory the
    kernel pins for O_DIRECT, so check the mapping itself, not just the address."""
    nbytes = 3 * HUGE_PAGE + 12345
    buf = aligned_empty(nbytes).fill_(1)
    address = buf.data_ptr()
    assert address % HUGE_PAGE == 0
    mapping = _mapping_of(address)
    # whole huge pages only, never one reaching past the buffer's end; fewer than three
    # would mean the kernel found no free huge page for some (fragmented memory)
    assert mapping is not None and 0 < mapping["AnonHugePages"] <= 3 * HUGE_PAGE // 1024
    del buf
    gc.collect()
    assert _mapping_of(address) is None  # unmapped, not kept behind our back



@pytest.mark.skipif(not AlignedRegions.supported(), reason="this torch cannot swap storages")
@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off or not Linux")
def test_full_tensor_regions_are_backed_by_huge_pages() -> None:
    regions = AlignedRegions(cap_bytes=0)
    storage = torch.empty(0, dtype=torch.uint8).untyped_storage()
    regions.fill(storage, 2 * HUGE_PAGE)
    torch.empty(0, dtype=torch.uint8).set_(storage).fill_(1)
    mapping = _mapping_of(storage.data_ptr())
    assert mapping is not None and 0 < mapping["AnonHugePages"] <= 2 * HUGE_PAGE // 1024


def test_round_up() -> None:
    assert [round_up(n) for n in (0, 1, 4096, 4097)] == [0, 4096, 4096, 8192]


def test_pool_sizes_from_one_budget() -> None:
    pool = BufferPool(10 << 20, 3 << 20)
    assert (pool.count, pool.buffer_bytes, pool.capacity_bytes) == (3, 3 << 20, 9 << 20)
    odd = BufferPool(100_000, 5000)
    assert odd.buffer_bytes == 8192 and odd.count == 100_000 // 8192
    tiny = BufferPool(0, 1 << 20)
    assert tiny.count == 1  # a budget below one buffer still allows transfers


def test_buffers_are_aligned_distinct_and_reused() -> None:
    pool = BufferPool(4 * ALIGN, ALIGN)
    held = [pool.acquire() for _ in range(pool.count)]
    ptrs = {b.tensor.data_ptr() for b in held}
    assert len(ptrs) == pool.count and all(p % ALIGN == 0 for p in ptrs)
    for b in held:
        b.release()
    for _ in range(50):  # any number of cycles hands out only those buffers
        with pool.acquire() as b:
            assert b.tensor.data_ptr() in ptrs
    assert pool.in_use == 0 and pool.peak_in_use == pool.count




@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore/madvise: Linux")
@pytest.mark.parametrize("buffer_bytes", [64 * ALIGN, 4 * HUGE_PAGE])  # small and huge pages
def test_release_idle_gives_back_free_buffers_only(buffer_bytes: int) -> None:
    pool = BufferPool(3 * buffer_bytes, buffer_bytes)
    lent = pool.acquire()
    lent.tensor.fill_(7)
    others = [pool._buffers[i] for i in pool._free]
    assert all(resident_bytes(b) == buffer_bytes for b in others)  # touched when made

    assert pool.release_idle() == 2 * buffer_bytes
    assert [resident_bytes(b) for b in others] == [0, 0]
    assert resident_bytes(lent.tensor) == buffer_bytes and bool((lent.tensor == 7).all())
    # a released buffer still works: it reads zeros, then holds what is written to it
    with pool.acquire() as again:
        assert again.tensor.data_ptr() in {b.data_ptr() for b in others}
        assert int(again.tensor.count_nonzero()) == 0
        again.tensor.fill_(3)
        assert bool((again.tensor == 3).all()) and resident_bytes(again.tensor) == buffer_bytes
    lent.release()
    assert pool.count == 3 and pool.capacity_bytes == 3 * buffer_bytes  # the budget stands


def test_release_is_idempotent() -> None:
    pool = BufferPool(2 * ALIGN, ALIGN)
    b = pool.acquire()
    b.release()
    b.release()
    assert b.released and pool.in_use == 0
    two = [pool.acquire(), pool.acquire()]  # a double release did not free a slot twice
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.05)
    for x in two:
        x.release()


def test_acquire_blocks_until_a_buffer_is_released() -> None:
    pool = BufferPool(2 * ALIGN, ALIGN)
    first, second = pool.acquire(), pool.acquire()
    got: list[int] = []
    started, finished = threading.Event(), threading.Event()

    def waiter() -> None:
        started.set()
        with pool.acquire() as b:
            got.append(b.tensor.data_ptr())
        finished.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    started.wait()
    assert not finished.wait(0.2), "acquire returned while every buffer was busy"
    first.release()
    assert finished.wait(5)
    thread.join()
    assert got == [first.tensor.data_ptr()]
    second.release()
    assert pool.peak_in_use == 2 and pool.in_use == 0


def test_acquire_timeout_raises() -> None:
    pool = BufferPool(ALIGN, ALIGN)
    with pool.acquire(), pytest.raises(TimeoutError, match="in use"):
        pool.acquire(timeout=0.05)


def test_pool_never_lends_more_than_count_under_contention() -> None:
    pool = BufferPool(3 * ALIGN, ALIGN)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(200):
                with pool.acquire(timeout=10) as b:
                    b.tensor[:8].fill_(1)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.peak_in_use <= pool.count == 3 and pool.in_use == 0


def test_view_is_a_typed_window_on_the_buffer() -> None:
    pool = BufferPool(ALIGN, ALIGN)
    with pool.acquire() as b:
        v = b.view(torch.float32, 10)
        assert v.dtype == torch.float32 and v.numel() == 10
        assert v.data_ptr() == b.tensor.data_ptr()
        v.fill_(1.5)
        assert torch.equal(b.tensor[:40].view(torch.float32), torch.full((10,), 1.5))
        assert b.view(torch.bfloat16, ALIGN // 2).numel() == ALIGN // 2
        with pytest.raises(ValueError, match="needs"):
            b.view(torch.float64, ALIGN)
