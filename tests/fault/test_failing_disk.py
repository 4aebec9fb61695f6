"""A disk that fails under the NVMe swap in the middle of training: one clear error, no thread
left behind, the swap removed (or, where the filesystem forbids it, removed by the next run),
and the last checkpoint, on a healthy disk, resumes exactly.

[Note: which real faults, and why not device-mapper]
The natural tool is a device-mapper ``error`` or ``flakey`` target over a loop device, but this
kernel has no device-mapper (``/proc/devices`` does not list it, ``dmsetup`` fails and there is
no module to load) and no ``fail_make_request`` fault injection. Loop devices and ext4 work, and
the kernel gives two real faults with them, both used here:

* EIO, on reads and on writes: ext4 on a loop device over an image file. Once the swap file is
  written, the image is truncated and ``losetup -c`` shrinks the device under the mounted
  filesystem, cutting through the middle of the swap file's blocks (found with ``filefrag``);
  the block layer then fails every I/O past the new end with EIO ("attempt to access beyond end
  of device"), O_DIRECT reads and writes alike. ext4's own metadata and journal lie before the
  swap, so the filesystem itself keeps working: the swap file can still be deleted.
* EROFS, on writes only: what ext4 mounted with ``errors=remount-ro`` does when it meets a
  failing disk, through its own error path (``/sys/fs/ext4/<dev>/trigger_fs_error`` calls
  ``ext4_error``). The journal is aborted and every later write, create or delete fails with
  EROFS, while reads go on working. ``mount -o remount,ro`` cannot stand in for it: the kernel
  refuses it (EBUSY) while outcore holds its swap file open for writing. Nothing can be
  deleted until the filesystem is unmounted, checked (``e2fsck``) and mounted again, so the run
  leaves its swap folder and the next run on that path removes it.

Checkpoints always go to ``tmp_path``, a healthy disk.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import outcore
from outcore.offload.aio import AioEngine
from outcore.offload.buffers import BufferPool, aligned_empty
from outcore.offload.nvme import NvmeStore

IMAGE_BYTES = 64 << 20  # sparse: the data written is what the disk holds (~25 MB at most)
TOOLS = ("losetup", "mkfs.ext4", "mount", "umount", "filefrag", "e2fsck", "sync")


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


class FailingDisk:
    """An ext4 filesystem on a loop device that the test can make fail (see the note above)."""

    def __init__(self, image: Path, device: str, mnt: Path) -> None:
        self.image, self.device, self.mnt = image, device, mnt

    def extents(self, path: Path) -> list[tuple[int, int, int]]:
        """(first byte, end byte, physical byte on the device) of each extent of ``path``."""
        out = _sh("filefrag", "-v", str(path)).stdout
        block = int(re.search(r"blocks of (\d+) bytes", out).group(1))
        rows = re.findall(r"^\s*\d+:\s+(\d+)\.\.\s*(\d+):\s+(\d+)\.\.", out, re.M)
        return [(int(a) * block, (int(b) + 1) * block, int(p) * block) for a, b, p in rows]

    def cut_through(self, path: Path) -> list[tuple[int, int]]:
        """Shrink the device to end at the physical block holding the first quarter's end of
        ``path``; return the byte ranges of ``path`` that now lie past the end (they fail
        with EIO). A quarter, not the middle: a run that clips reserves the file's second half
        for tentative updates, which it leaves unused while every step clips."""
        extents = self.extents(path)
        middle = max(end for _, end, _ in extents) // 4 // 4096 * 4096
        cut = next(phys + middle - lo for lo, end, phys in extents if lo <= middle < end)
        os.truncate(self.image, cut)
        done = _sh("losetup", "-c", self.device)
        assert done.returncode == 0, done.stderr
        assert int(Path(f"/sys/block/{Path(self.device).name}/size").read_text()) * 512 == cut
        return [(max(lo, lo + cut - phys), end) for lo, end, phys in extents
                if phys + end - lo > cut]

    def turn_read_only(self) -> None:
        """Make ext4 take its error path (errors=remount-ro), after committing what the run
        made so far (its swap folder), as a disk that has been failing for a while would."""
        trigger = Path(f"/sys/fs/ext4/{Path(self.device).name}/trigger_fs_error")
        if not trigger.exists():
            pytest.skip(f"{trigger} is missing: this kernel's ext4 cannot be made to fail")
        _sh("sync", "-f", str(self.mnt))
        trigger.write_text("outcore test: the disk under the NVMe swap failed")

    def repair(self) -> None:
        """What an operator does after ext4 went read-only: unmount, check, mount again."""
        for cmd in (("umount", str(self.mnt)), ("e2fsck", "-fy", self.device),
                    ("mount", "-o", "errors=remount-ro", self.device, str(self.mnt))):
            done = _sh(*cmd)
            assert done.returncode in ((0, 1) if cmd[0] == "e2fsck" else (0,)), (cmd, done)


@pytest.fixture
def failing_disk(tmp_path: Path) -> Iterator[FailingDisk]:
    """A 64 MiB ext4 filesystem on its own loop device, always unmounted and detached after;
    skipped, naming what is missing, where that needs a privilege or tool this machine lacks."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root to attach a loop device and mount it (running as uid "
                    f"{os.geteuid()})")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} on PATH")
    image, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(IMAGE_BYTES)
    made = _sh("mkfs.ext4", "-q", "-F", "-b", "4096", str(image))
    if made.returncode:
        pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
    attached = _sh("losetup", "-f", "--show", str(image))
    if attached.returncode:
        pytest.skip(f"no loop device can be attached here: {attached.stderr.strip()}")
    device = attached.stdout.strip()
    try:
        mounted = _sh("mount", "-o", "errors=remount-ro", device, str(mnt))
        if mounted.returncode:
            pytest.skip(f"mounting {device} is not permitted here: {mounted.stderr.strip()}")
        yield FailingDisk(image, device, mnt)
    finally:
        _sh("umount", "-l", str(mnt))
        _sh("losetup", "-d", device)


def _aio_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("outcore-aio-"))


@contextlib.contextmanager
def _no_hang(seconds: int) -> Iterator[None]:
    """Turn a hang (a wait for I/O that never ends) into a failure, with the mount cleaned up."""
    def hung(signum: int, frame: object) -> None:
        raise TimeoutError(f"still waiting after {seconds} s: a hang on a failing disk")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _assert_names_the_fault(err: BaseException, swap: Path, op: str, code: int) -> int:
    """The error names the operation, the swap file, the offset and the errno; return offset."""
    assert isinstance(err, outcore.StorageError), repr(err)
    assert err.errno == code, repr(err)
    found = re.search(rf"{op} of \d+ bytes at offset (\d+) in {re.escape(str(swap))} failed: "
                      rf".*\(errno {code}, {errno.errorcode[code]}", str(err))
    assert found, str(err)
    assert int(found[1]) == err.offset
    return err.offset


def test_a_shrunk_device_fails_direct_reads_and_writes_with_eio(
        failing_disk: FailingDisk) -> None:
    """The fault itself, on the swap store: EIO past the cut, for reads and for writes, each
    naming the file and offset; the part before the cut still reads back; nothing left."""
    before = _aio_threads()
    engine = AioEngine(threads=4, block_bytes=1 << 20)
    store = NvmeStore(failing_disk.mnt, rank=0, engine=engine, pool=BufferPool(1 << 20, 1 << 20))
    assert store.direct  # the swap is opened with O_DIRECT, so nothing comes from the cache
    extents = [store.allocate(4 << 20) for _ in range(4)]
    for i, extent in enumerate(extents):
        store.write(extent, aligned_empty(4 << 20).fill_(i + 1)).result()
    dead = failing_disk.cut_through(store.path)
    assert dead and min(lo for lo, _ in dead) > 0  # the first quarter still works
    with _no_hang(30):
        back = aligned_empty(4 << 20)
        store.read(extents[0], back).result()
        assert bool((back == 1).all())
        for op in ("read", "write"):
            buf = aligned_empty(4 << 20).fill_(9)
            future = (store.read if op == "read" else store.write)(extents[-1], buf)
            with pytest.raises(outcore.StorageError) as info:
                future.result()
            at = _assert_names_the_fault(info.value, store.path, op, errno.EIO)
            assert any(lo <= at < end for lo, end in dead), (at, dead)
        store.close()
        engine.close()
    assert _aio_threads() == before
    assert sorted(os.listdir(failing_disk.mnt)) == ["lost+found"]


# -- training through the library -------------------------------------------------------------
STEPS, SAVED_AT = 5, 2
FAULTS = {  # fault: (optimizer placement, errno, first operation to fail, when it strikes)
    "read-eio": ("nvme", errno.EIO, "read", "before_forward"),
    "step-read-eio": ("nvme", errno.EIO, "read", "before_step"),
    "write-erofs": ("nvme", errno.EROFS, "write", "before_forward"),
}
_REFERENCE: dict[str, list[float]] = {}


def _config(optimizer: str, nvme_path: Path) -> outcore.Config:
    # the optimizer runs inside step(), so the first swap write of a step comes after backward
    return outcore.Config(dtype="fp32", optimizer={"lr": 1e-3}, zero={"overlap_optimizer": False},
                          offload={"params": "nvme", "optimizer": optimizer,
                                   "nvme_path": str(nvme_path), "host_buffer_bytes": 16 << 20})


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # 263k parameters: 1-4 MB of swap, extents each side of the cut
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 256, generator=torch.Generator().manual_seed(step))


def _step(engine: outcore.Engine, step: int, before_step=lambda: None) -> float:
    loss = engine(_batch(step)).pow(2).mean()
    engine.backward(loss)
    before_step()
    engine.step()
    return float(loss.detach())


def _reference(optimizer: str, root: Path) -> list[float]:
    if optimizer not in _REFERENCE:
        with outcore.initialize(_model(), _config(optimizer, root / f"ref-{optimizer}")) as e:
            _REFERENCE[optimizer] = [_step(e, s) for s in range(1, STEPS + 1)]
    return _REFERENCE[optimizer]


@pytest.mark.parametrize("fault", list(FAULTS))
def test_training_on_a_failing_disk_raises_cleans_up_and_resumes_exactly(
        fault: str, failing_disk: FailingDisk, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    optimizer, code, op, when = FAULTS[fault]
    expected = _reference(optimizer, tmp_path)
    before = _aio_threads()
    engine = outcore.initialize(_model(), _config(optimizer, failing_disk.mnt))
    losses = [_step(engine, s) for s in range(1, SAVED_AT + 1)]
    ckpt = engine.save_checkpoint(tmp_path / "ckpt" / f"step-{SAVED_AT}")
    swap = Path(engine.rt.nvme.path)
    dead: list[tuple[int, int]] = []

    def strike() -> None:
        if code == errno.EIO:
            dead.extend(failing_disk.cut_through(swap))
        else:
            failing_disk.turn_read_only()

    with _no_hang(60):
        if when == "before_forward":
            strike()
        with pytest.raises(outcore.StorageError) as info:  # within the very next step
            _step(engine, SAVED_AT + 1, strike if when == "before_step" else lambda: None)
        at = _assert_names_the_fault(info.value, swap, op, code)
        with caplog.at_level(logging.WARNING, logger="outcore"):
            engine.close()
    assert _aio_threads() == before
    if code == errno.EIO:
        assert any(lo <= at < end for lo, end in dead), (at, dead)
        assert sorted(os.listdir(failing_disk.mnt)) == ["lost+found"]
    else:  # nothing can be deleted on a read-only ext4: kept, and said so
        assert swap.exists()
        assert f"could not remove {swap}: Read-only file system" in caplog.text

    # the next run, on a healthy disk, resumes from the checkpoint with the same losses
    with outcore.initialize(_model(), _config(optimizer, tmp_path / "healthy")) as engine:
        engine.load_checkpoint(ckpt)
        losses += [_step(engine, s) for s in range(SAVED_AT + 1, STEPS + 1)]
    assert losses == expected


# -- the `outcore train` command ---------------------------------------------------------------
CLI_STEPS = 10


def _train(out: Path, data: Path, nvme_path: Path, resume: bool = False) -> list[str]:
    return [sys.executable, "-m", "outcore", "train", "--model", "tiny", "--dtype", "fp32",
            "--data", str(data), "--out", str(out), "--nvme-path", str(nvme_path),
            "--steps", str(CLI_STEPS), "--save-every", "2", "--batch", "2", "--seq", "32",
            "--offload", "nvme", "--seed", "3"] + (["--resume"] if resume else [])


def _losses(out: Path) -> dict[int, float]:
    path = out / "metrics.jsonl"
    rows = path.read_text().splitlines() if path.exists() else []
    return {r["step"]: r["loss"] for r in map(json.loads, filter(None, rows))}


@pytest.fixture
def start() -> Iterator:
    """Start ``outcore train`` runs; any still running at the end is killed (before the
    disk's own teardown, since this fixture is set up after it)."""
    started: list[subprocess.Popen] = []

    def run(cmd: list[str]) -> subprocess.Popen:
        started.append(subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
        return started[-1]

    yield run
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"{proc.args} hung on a failing disk:\n{err[-2000:]}")
    return proc.returncode, err


def _fail_mid_run(proc: subprocess.Popen, out: Path, disk: FailingDisk, fault: str) -> None:
    """Strike once the run has a checkpoint (step 2) and its swap is on the disk."""
    deadline = time.monotonic() + 90
    while proc.poll() is None and time.monotonic() < deadline:
        swaps = list(disk.mnt.glob("outcore-*/rank0.swap"))
        if swaps and outcore.latest_checkpoint(out / "checkpoints") is not None:
            if fault == "eio":
                disk.cut_through(swaps[0])
            else:
                disk.turn_read_only()
            return
        time.sleep(0.02)
    pytest.fail(f"the run ended or stalled before step 2 (exit {proc.poll()})")


@pytest.mark.parametrize("fault", ["eio", "erofs"])
def test_outcore_train_on_a_failing_disk(fault: str, failing_disk: FailingDisk,
                                         tmp_path: Path, start) -> None:
    """The CLI ends with one line naming the swap file, offset and errno (exit 1, no
    traceback). EIO: the run removed its swap. EROFS: it could not, said so, and the resumed
    run removes it once the filesystem is repaired, and reproduces the uninterrupted losses."""
    data = tmp_path / "corpus.txt"
    data.write_text(Path(outcore.__file__).read_text() * 3)
    out, reference = tmp_path / "run", tmp_path / "ref"
    # the uninterrupted run, on a healthy disk, alongside (only the EROFS case resumes)
    ref_proc = start(_train(reference, data, tmp_path / "ref-swap")) if fault == "erofs" \
        else None
    proc = start(_train(out, data, failing_disk.mnt))
    _fail_mid_run(proc, out, failing_disk, fault)
    code, err = _finish(proc)
    last = err.strip().splitlines()[-1]
    assert code == 1 and "Traceback" not in err, err[-3000:]
    name = "EIO" if fault == "eio" else "EROFS"
    assert re.fullmatch(rf"outcore train: error: (read|write) of \d+ bytes at offset \d+ in "
                        rf"{failing_disk.mnt}/outcore-{proc.pid}-[0-9a-f]{{8}}/rank0\.swap "
                        rf"failed: .*\(errno \d+, {name}; .*\)", last), last
    latest = outcore.latest_checkpoint(out / "checkpoints")
    assert latest is not None and int(latest.name.split("-")[-1]) >= 2
    left = sorted(p.name for p in failing_disk.mnt.iterdir())
    if ref_proc is None:
        assert left == ["lost+found"]
        return
    # the read-only filesystem kept the swap; the run said it could not remove it
    assert f"could not remove {failing_disk.mnt}/outcore-{proc.pid}-" in err
    (stale,) = failing_disk.mnt.glob(f"outcore-{proc.pid}-*")
    failing_disk.repair()
    assert stale.exists()
    code, ref_err = _finish(ref_proc)
    assert code == 0, ref_err[-3000:]
    code, resume_err = _finish(start(_train(out, data, failing_disk.mnt, resume=True)))
    assert code == 0, resume_err[-3000:]
    assert f"removed {stale}" in resume_err
    assert sorted(p.name for p in failing_disk.mnt.iterdir()) == ["lost+found"]
    assert _losses(out) == _losses(reference)
    assert sorted(_losses(out)) == list(range(1, CLI_STEPS + 1))
