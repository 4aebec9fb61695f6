"""The async I/O engine and its futures: round trips, splitting, errors that name file+offset."""

from __future__ import annotations

import errno
import gc
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from outcore.errors import StorageError
from outcore.offload.aio import AioEngine, AioError, IOFuture
from outcore.offload.buffers import ALIGN, aligned_empty


def _random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    out = aligned_empty(n)
    out.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen))
    return out


@pytest.fixture
def engine() -> Iterator[AioEngine]:
    with AioEngine(threads=4, block_bytes=16 * ALIGN) as eng:
        yield eng


@pytest.fixture
def direct_file(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    path = tmp_path / "data.bin"
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags, 0o600)
    yield fd, path
    os.close(fd)


# --- IOFuture -------------------------------------------------------------------------------


def test_future_result_and_callbacks() -> None:
    f = IOFuture()
    seen: list[int] = []
    f.add_done_callback(lambda g: seen.append(g.result()))
    assert not f.done()
    with pytest.raises(TimeoutError):
        f.result(timeout=0.01)
    f.set_result(42)
    assert f.done() and f.result() == 42 and seen == [42]
    f.add_done_callback(lambda g: seen.append(-g.result()))  # already done: runs now
    assert seen == [42, -42]
    with pytest.raises(RuntimeError):
        f.set_result(1)


def test_future_error_is_reraised_every_time() -> None:
    f = IOFuture()
    f.set_exception(StorageError("boom"))
    for _ in range(2):
        with pytest.raises(StorageError, match="boom"):
            f.result()
    assert isinstance(f.exception(), StorageError)


def test_a_raising_callback_does_not_break_the_future() -> None:
    f = IOFuture()
    f.add_done_callback(lambda g: 1 / 0)
    f.set_result(3)
    assert f.result() == 3


def test_gather_waits_for_all_and_sums() -> None:
    parts = [IOFuture() for _ in range(3)]
    combined = IOFuture.gather(parts)
    parts[0].set_result(1)
    parts[2].set_result(100)
    assert not combined.done()
    parts[1].set_result(10)
    assert combined.result() == 111
    assert IOFuture.gather([]).result() == 0


def test_gather_reports_first_error_only_after_every_part_is_done() -> None:
    parts = [IOFuture() for _ in range(3)]
    combined = IOFuture.gather(parts)
    parts[1].set_exception(StorageError("first"))
    parts[0].set_exception(StorageError("second"))
    assert not combined.done()  # parts[2] may still be using its buffer
    parts[2].set_result(5)
    with pytest.raises(StorageError, match="first"):
        combined.result()


# --- AioEngine ------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [ALIGN, 16 * ALIGN, 16 * ALIGN + ALIGN, 1 << 20])
def test_round_trip_at_nonzero_offset(
    engine: AioEngine, direct_file: tuple[int, Path], nbytes: int
) -> None:
    fd, path = direct_file
    src = _random_bytes(nbytes, seed=nbytes)
    offset = 3 * ALIGN
    assert engine.pwrite(fd, src, offset, path=path).result() == nbytes
    dst = aligned_empty(nbytes).zero_()
    assert engine.pread(fd, dst, offset, path=path).result() == nbytes
    assert torch.equal(src, dst)
    with open(path, "rb") as f:  # the bytes really are at that offset in the file
        f.seek(offset)
        assert f.read(64) == bytes(src[:64].tolist())


def test_reads_land_in_the_callers_memory_without_copy(tmp_path: Path) -> None:
    path = tmp_path / "plain.bin"
    path.write_bytes(bytes(range(256)) * 64)
    base = torch.zeros(3 * ALIGN, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    with AioEngine(threads=2, block_bytes=ALIGN) as eng:
        eng.pread(fd, base[100 : 100 + 5000], 10, path=path).result()
    os.close(fd)
    expected = torch.tensor(list(path.read_bytes()[10:5010]), dtype=torch.uint8)
    assert torch.equal(base[100:5100], expected)
    assert base[:100].eq(0).all() and base[5100:].eq(0).all()


def test_large_request_is_split_into_blocks_over_threads(
    monkeypatch: pytest.MonkeyPatch, direct_file: tuple[int, Path]
) -> None:
    fd, path = direct_file
    calls: list[tuple[str, int]] = []
    real = os.pwritev
    # the first two blocks wait for each other: they finish only if two threads serve them at
    # once, however the machine schedules them (a loaded host can let one thread take all 32
    # blocks one after another, which says nothing about the engine)
    together = threading.Barrier(2, timeout=30)
    lock = threading.Lock()

    def spy(fd_: int, buffers: list, offset: int) -> int:
        with lock:
            calls.append((threading.current_thread().name, sum(len(b) for b in buffers)))
            first_two = len(calls) <= 2
        if first_two:
            together.wait()  # BrokenBarrierError (the write's error) if no second thread came
        return real(fd_, buffers, offset)

    monkeypatch.setattr(os, "pwritev", spy)
    with AioEngine(threads=4, block_bytes=2 * ALIGN) as eng:
        eng.pwrite(fd, _random_bytes(64 * ALIGN), 0, path=path).result()
    assert len(calls) == 32 and all(n == 2 * ALIGN for _, n in calls)
    assert all(name.startswith("outcore-aio-") for name, _ in calls)
    assert len({name for name, _ in calls}) > 1


def test_short_read_names_file_and_offset(engine: AioEngine, direct_file: tuple[int, Path]) -> None:
    fd, path = direct_file
    engine.pwrite(fd, _random_bytes(4 * ALIGN), 0, path=path).result()
    dst = aligned_empty(64 * ALIGN)
    future = engine.pread(fd, dst, 0, path=path)
    with pytest.raises(AioError) as info:
        future.result()
    err = info.value
    assert isinstance(err, StorageError) and isinstance(err, OSError)
    assert str(path) in str(err) and "short read" in str(err)
    assert err.offset == 4 * ALIGN and f"offset {4 * ALIGN}" in str(err)


def test_os_error_names_file_and_offset(engine: AioEngine, tmp_path: Path) -> None:
    path = tmp_path / "ro.bin"
    path.write_bytes(b"\0" * ALIGN)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(AioError, match=rf"write of 4096 bytes at offset 8192 in {path}") as e:
            engine.pwrite(fd, aligned_empty(ALIGN), 2 * ALIGN, path=path).result()
        assert e.value.errno == errno.EBADF
    finally:
        os.close(fd)


def test_unaligned_direct_io_fails_loudly(engine: AioEngine, direct_file: tuple[int, Path]) -> None:
    fd, path = direct_file
    if Path(path).stat().st_dev == os.stat("/dev/shm").st_dev:  # pragma: no cover
        pytest.skip("tmp_path is on tmpfs, which accepts unaligned O_DIRECT")
    with pytest.raises(AioError, match="aligned"):
        engine.pwrite(fd, aligned_empty(ALIGN + 1)[1:], 0, path=path).result()


def test_engine_validates_buffers_and_lifecycle(direct_file: tuple[int, Path]) -> None:
    fd, path = direct_file
    eng = AioEngine(threads=1, block_bytes=ALIGN)
    with pytest.raises(ValueError, match="uint8"):
        eng.pwrite(fd, torch.zeros(ALIGN, dtype=torch.float32), 0, path=path)
    with pytest.raises(ValueError, match="contiguous"):
        eng.pwrite(fd, aligned_empty(2 * ALIGN).view(2, ALIGN).t(), 0, path=path)
    assert eng.pread(fd, aligned_empty(0), 0, path=path).result() == 0
    eng.close()
    eng.close()
    assert eng.closed
    with pytest.raises(RuntimeError, match="closed"):
        eng.pread(fd, aligned_empty(ALIGN), 0, path=path)
    with pytest.raises(ValueError):
        AioEngine(threads=0)
    with pytest.raises(ValueError):
        AioEngine(block_bytes=1000)


def test_a_dropped_source_stays_alive_until_written(direct_file: tuple[int, Path]) -> None:
    fd, path = direct_file
    expected = _random_bytes(256 * ALIGN, seed=9)
    with AioEngine(threads=1, block_bytes=ALIGN) as eng:  # 256 queued blocks
        future = eng.pwrite(fd, aligned_empty(expected.numel()).copy_(expected), 0, path=path)
        gc.collect()
        scribble = [torch.full((expected.numel() + ALIGN,), 0xAB, dtype=torch.uint8)]
        future.result()
        del scribble
        back = aligned_empty(expected.numel())
        eng.pread(fd, back, 0, path=path).result()
    assert torch.equal(back, expected)
