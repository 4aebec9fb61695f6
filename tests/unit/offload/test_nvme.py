"""The NVMe swap store: byte-exact round trips, extents, errors, privacy and clean-up."""

from __future__ import annotations

import errno
import gc
import itertools
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from outcore.errors import StorageError
from outcore.offload import nvme
from outcore.offload.aio import AioEngine, AioError
from outcore.offload.buffers import ALIGN, BufferPool, aligned_empty, round_up
from outcore.offload.nvme import Extent, NvmeStore, check_space

CHUNK = 16 * ALIGN  # small pool buffers, so ordinary tests exercise chunking and waiting


@pytest.fixture(scope="module")
def engine() -> Iterator[AioEngine]:
    with AioEngine(threads=4, block_bytes=8 * ALIGN) as eng:
        yield eng


@pytest.fixture
def pool() -> BufferPool:
    return BufferPool(3 * CHUNK, CHUNK)


@pytest.fixture
def store(tmp_path: Path, engine: AioEngine, pool: BufferPool) -> Iterator[NvmeStore]:
    with NvmeStore(tmp_path, rank=0, engine=engine, pool=pool) as s:
        yield s


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget that this process already warned about buffered I/O."""
    monkeypatch.setattr(nvme, "_BUFFERED_WARNED", threading.Event())


def _random(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=gen) * 1000).to(dtype)
    return torch.randint(-100, 100, (numel,), generator=gen).to(dtype)


def _round_trip(store: NvmeStore, src: torch.Tensor) -> torch.Tensor:
    extent = store.allocate(src.nbytes)
    assert store.write(extent, src).result() == src.nbytes
    dst = torch.full_like(src, 0)
    assert store.read(extent, dst).result() == src.nbytes
    return dst


# --- round trips ----------------------------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 1000, 4097, 100_003])
def test_round_trip_is_byte_exact(store: NvmeStore, dtype: torch.dtype, numel: int) -> None:
    store.allocate(123)  # so the extent under test starts at a nonzero offset
    src = _random(numel, dtype, seed=numel)
    dst = _round_trip(store, src)
    assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))


@pytest.mark.parametrize("nbytes", [ALIGN, 40 * ALIGN, 40 * ALIGN + 777, 777])
@pytest.mark.parametrize("shift", [0, 1])
def test_aligned_and_unaligned_memory(
    store: NvmeStore, pool: BufferPool, nbytes: int, shift: int
) -> None:
    src = aligned_empty(nbytes + shift)[shift:].copy_(_random(nbytes, torch.uint8, seed=5))
    dst = aligned_empty(nbytes + shift)[shift:].zero_()
    extent = store.allocate(nbytes)
    store.write(extent, src).result()
    store.read(extent, dst).result()
    assert torch.equal(src, dst)
    if shift == 0:  # aligned memory goes straight to disk; only a partial last page is staged
        assert pool.peak_in_use == (0 if nbytes % ALIGN == 0 else 1)


def test_many_extents_do_not_clobber_each_other(store: NvmeStore) -> None:
    tensors = [_random(n, torch.float32, seed=n) for n in (1, 999, 1024, 5000, 3, 70_000)]
    extents = [store.allocate(t.nbytes) for t in tensors]
    futures = [store.write(e, t) for e, t in zip(extents, tensors, strict=True)]
    for f in futures:
        f.result()
    for e, t in zip(extents, tensors, strict=True):
        out = torch.empty_like(t)
        store.read(e, out).result()
        assert torch.equal(out, t)
    assert store.bytes_written == store.bytes_read == sum(t.nbytes for t in tensors)


def test_small_pool_bounds_memory_of_large_transfers(store: NvmeStore, pool: BufferPool) -> None:
    src = _random(10 * CHUNK + 5, torch.uint8, seed=1)[1:]  # unaligned: every byte is staged
    dst = _round_trip(store, src)
    assert torch.equal(src, dst)
    assert pool.peak_in_use <= pool.count and pool.in_use == 0


def test_read_of_a_prefix_and_size_checks(store: NvmeStore) -> None:
    src = _random(3000, torch.int64, seed=2)
    extent = store.allocate(src.nbytes)
    store.write(extent, src).result()
    head = torch.empty(1000, dtype=torch.int64)
    store.read(extent, head).result()
    assert torch.equal(head, src[:1000])
    with pytest.raises(ValueError, match="does not fit"):
        store.write(extent, torch.zeros(3001, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        store.write(extent, torch.zeros(10, 10).t())


# --- extents --------------------------------------------------------------------------------


def test_extents_are_aligned_and_disjoint(store: NvmeStore) -> None:
    extents = [store.allocate(n) for n in (0, 1, 4095, 4096, 4097, 10_000)]
    for e in extents:
        assert e.offset % ALIGN == 0 and e.capacity == round_up(max(e.nbytes, 1))
    spans = sorted((e.offset, e.offset + e.capacity) for e in extents)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    assert store.bytes_allocated == sum(e.capacity for e in extents) == store.file_bytes
    assert os.stat(store.path).st_size == store.file_bytes


def test_freed_space_is_reused_and_coalesced(store: NvmeStore) -> None:
    a, b, c = (store.allocate(3 * ALIGN) for _ in range(3))
    size = store.file_bytes
    store.free(b)
    assert store.allocate(2 * ALIGN).offset == b.offset  # first fit into the hole
    store.free(Extent(b.offset, 2 * ALIGN, 2 * ALIGN))
    store.free(a)  # a and b's hole merge into one 6-page hole at a.offset
    merged = store.allocate(6 * ALIGN)
    assert merged.offset == a.offset and store.file_bytes == size
    store.free(c)
    with pytest.raises(ValueError, match="already free"):
        store.free(c)


def test_reserve_grows_the_file_once(store: NvmeStore) -> None:
    store.reserve(1 << 20)
    assert store.file_bytes == os.stat(store.path).st_size == 1 << 20
    store.allocate(1 << 19)
    store.allocate(1 << 19)
    assert store.file_bytes == 1 << 20
    store.allocate(1)
    assert store.file_bytes == (1 << 20) + ALIGN


# --- errors ---------------------------------------------------------------------------------


def test_short_read_raises_naming_file_and_offset(store: NvmeStore) -> None:
    store.allocate(5 * ALIGN)
    src = _random(20_000, torch.float32, seed=3)
    extent = store.allocate(src.nbytes)
    store.write(extent, src).result()
    os.truncate(store.path, extent.offset + 2 * ALIGN)  # behind the store's back
    with pytest.raises(StorageError) as info:
        store.read(extent, torch.empty_like(src)).result()
    assert str(store.path) in str(info.value) and "offset" in str(info.value)
    assert isinstance(info.value, AioError) and info.value.offset >= extent.offset + 2 * ALIGN


def test_missing_parent_is_reported(tmp_path: Path, engine: AioEngine, pool: BufferPool) -> None:
    root = tmp_path / "nope" / "swap"
    with pytest.raises(StorageError, match=f"{root}.*does not exist"):
        NvmeStore(root, rank=0, engine=engine, pool=pool)


def test_missing_leaf_is_created_and_removed_when_left_empty(
    tmp_path: Path, engine: AioEngine, pool: BufferPool
) -> None:
    """A swap path the store made goes at close if nothing else is in it (a run's OUT/swap
    was left behind, empty); one that existed, or holds another store's swap, is kept."""
    root = tmp_path / "swap"
    NvmeStore(root, rank=0, engine=engine, pool=pool).close()
    assert not root.exists()
    first = NvmeStore(root, rank=0, engine=engine, pool=pool)  # makes it
    second = NvmeStore(root, rank=1, engine=engine, pool=pool)
    first.close()
    assert root.is_dir()  # the second's swap is in it
    second.close()  # the last to close removes it, whoever made it (ranks share the path)
    assert not root.exists()
    root.mkdir()  # the user's: kept, with what they put there
    NvmeStore(root, rank=0, engine=engine, pool=pool).close()
    assert root.is_dir() and list(root.iterdir()) == []
    (root / "notes.txt").write_text("mine")
    outcore_made = tmp_path / "made"
    store = NvmeStore(outcore_made, rank=0, engine=engine, pool=pool)
    (outcore_made / "notes.txt").write_text("theirs")  # something else put there: kept
    store.close()
    assert sorted(p.name for p in outcore_made.iterdir()) == [".outcore-made", "notes.txt"]


@pytest.mark.parametrize("layout", ["root_is_file", "parent_is_file"])
def test_not_a_directory_is_reported(
    tmp_path: Path, engine: AioEngine, pool: BufferPool, layout: str
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    root = afile if layout == "root_is_file" else afile / "swap"
    with pytest.raises(StorageError, match=f"{root}.*not a directory"):
        NvmeStore(root, rank=0, engine=engine, pool=pool)


def test_read_only_root_is_reported(
    tmp_path: Path, engine: AioEngine, pool: BufferPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tests run as root, which ignores mode bits, so a read-only folder is simulated.
    real_mkdir = os.mkdir

    def read_only(path: os.PathLike, mode: int = 0o777) -> None:
        if Path(path).parent == tmp_path:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        real_mkdir(path, mode)

    monkeypatch.setattr(os, "mkdir", read_only)
    with pytest.raises(StorageError,
                       match=f"{tmp_path}: cannot create a folder there.*[Rr]ead-only"):
        NvmeStore(tmp_path, rank=0, engine=engine, pool=pool)
    assert list(tmp_path.iterdir()) == []


def test_full_disk_is_reported_with_bytes(
    store: NvmeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = shutil.disk_usage(store.folder)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10_000))
    with pytest.raises(StorageError, match="need 1.05 MB more, 10.0 KB free"):
        store.allocate(1 << 20)
    with pytest.raises(StorageError, match=str(store.folder)):
        store.reserve(1 << 30)
    check_space(store.folder, 10_000)
    with pytest.raises(StorageError, match=f"{store.folder}: need 10.0 KB more"):
        check_space(store.folder, 10_001)
    assert store.file_bytes == 0


# --- privacy and clean-up -------------------------------------------------------------------


def test_files_are_private(store: NvmeStore, tmp_path: Path) -> None:
    assert store.folder.parent == tmp_path and store.folder.name.startswith("outcore-")
    assert stat.S_IMODE(os.stat(store.folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600
    assert store.path.name == "rank0.swap"


def test_close_removes_only_what_it_created(
    tmp_path: Path, engine: AioEngine, pool: BufferPool
) -> None:
    mine = tmp_path / "notes.txt"
    mine.write_text("keep me")
    other = tmp_path / "outcore-1-deadbeef"
    other.mkdir()
    s = NvmeStore(tmp_path, rank=3, engine=engine, pool=pool)
    s.write(s.allocate(10_000), torch.ones(2500)).result()
    s.close()
    s.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "outcore-1-deadbeef"]
    assert mine.read_text() == "keep me" and not s.folder.exists()
    with pytest.raises(RuntimeError, match="closed"):
        s.allocate(1)


def test_close_waits_for_in_flight_writes(tmp_path: Path, pool: BufferPool) -> None:
    with AioEngine(threads=1, block_bytes=ALIGN) as eng:
        s = NvmeStore(tmp_path, rank=0, engine=eng, pool=pool)
        future = s.write(s.allocate(4 << 20), aligned_empty(4 << 20))  # 1024 queued blocks
        s.close()
        assert future.done() and future.result() == 4 << 20
    assert list(tmp_path.iterdir()) == []


def test_store_abandoned_by_an_exception_is_cleaned_up(
    tmp_path: Path, engine: AioEngine, pool: BufferPool
) -> None:
    def crash() -> None:
        s = NvmeStore(tmp_path, rank=0, engine=engine, pool=pool)
        s.write(s.allocate(100), torch.ones(25)).result()
        raise KeyError("training failed")

    with pytest.raises(KeyError):
        crash()
    gc.collect()
    assert list(tmp_path.iterdir()) == []

    with pytest.raises(KeyError), NvmeStore(tmp_path, rank=1, engine=engine, pool=pool):
        raise KeyError("inside with")
    assert list(tmp_path.iterdir()) == []


def test_interpreter_exit_after_an_uncaught_exception_cleans_up(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import torch
        from outcore.offload.aio import AioEngine
        from outcore.offload.buffers import BufferPool
        from outcore.offload.nvme import NvmeStore
        engine = AioEngine(threads=2)
        store = NvmeStore({str(tmp_path)!r}, rank=0, engine=engine, pool=BufferPool(0, 4096))
        store.write(store.allocate(1 << 20), torch.ones(1 << 18))  # still in flight, maybe
        print(store.folder, flush=True)
        raise SystemExit("crash")
        """
    )
    repo = Path(nvme.__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert run.returncode == 1 and "crash" in run.stderr
    assert run.stdout.strip().startswith(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_forked_child_does_not_delete_the_parents_swap(store: NvmeStore) -> None:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        store.close()
        os._exit(0)
    os.waitpid(pid, 0)
    assert store.path.exists()


# --- O_DIRECT fallback ----------------------------------------------------------------------


@pytest.mark.usefixtures("fresh_warning")
def test_tmpfs_round_trips_direct_or_with_one_warning(engine: AioEngine, pool: BufferPool) -> None:
    if not os.path.isdir("/dev/shm"):  # pragma: no cover
        pytest.skip("no /dev/shm")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stores = [NvmeStore("/dev/shm", rank=r, engine=engine, pool=pool) for r in range(2)]
    src = _random(5000, torch.float32, seed=4)
    for s in stores:
        assert torch.equal(_round_trip(s, src), src)
        s.close()
    expected = 0 if stores[0].direct else 1  # Linux >= 6.6 tmpfs accepts O_DIRECT
    assert len([w for w in caught if "O_DIRECT" in str(w.message)]) == expected


@pytest.mark.usefixtures("fresh_warning")
@pytest.mark.parametrize("refused_at", ["open", "first_io"])
def test_refused_o_direct_falls_back_with_one_warning(
    tmp_path: Path,
    engine: AioEngine,
    pool: BufferPool,
    monkeypatch: pytest.MonkeyPatch,
    refused_at: str,
) -> None:
    if refused_at == "open":
        real_open = os.open

        def no_direct(path: os.PathLike, flags: int, mode: int = 0o777) -> int:
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(path, flags, mode)

        monkeypatch.setattr(os, "open", no_direct)
    else:

        def refuse(op: str, fd: int, view: memoryview, offset: int, path: str) -> int:
            raise AioError("EINVAL", op=op, path=path, offset=offset, code=errno.EINVAL)

        monkeypatch.setattr(nvme, "transfer", refuse)
    with pytest.warns(UserWarning, match="O_DIRECT") as caught:
        stores = [NvmeStore(tmp_path, rank=r, engine=engine, pool=pool) for r in range(2)]
    assert len(caught) == 1 and not any(s.direct for s in stores)
    src = _random(12_345, torch.bfloat16, seed=6)
    for s in stores:
        assert torch.equal(_round_trip(s, src), src)
        assert not os.fstat(s._fd).st_mode & 0o077
        s.close()
    assert list(tmp_path.iterdir()) == []


def test_a_swap_path_that_cannot_be_made_says_why(tmp_path: Path) -> None:
    """Found by a probe: a link to nothing read "cannot create a folder there (No such file
    or directory)", and a ``$HOME`` written in a config file gave no hint."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(StorageError, match=r"is a symbolic link to .*gone, which does not exist"):
        nvme._prepare_root(link)
    with pytest.raises(StorageError, match=r"\$HOME are not expanded in a path \(~ is\)"):
        nvme._prepare_root(tmp_path / "$HOME" / "swap")
