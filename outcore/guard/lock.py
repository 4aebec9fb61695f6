"""Two runs, one folder: an OS lock on the folder, and a refusal that names the holder.

[Note: two runs, one folder]
Two runs writing one ``--out`` (or one checkpoint root) would interleave metrics, replace each
other's checkpoints and leave a resume that belongs to neither. So a run holds an exclusive
``flock`` on ``<folder>/.outcore-lock`` while it uses the folder, and a second run asking for
it is refused at once with a ``FolderInUseError`` naming the folder and the holder (pid, host,
since when), which the holder wrote into the file. The kernel drops a ``flock`` with the
process's last descriptor, so a run killed with SIGKILL leaves the folder free at once; a pid
file alone would stay "held" by a dead pid, or by whatever process reuses it. Release unlinks
the file while still holding the lock, so an acquirer re-checks after locking that the name
still points at the file it locked (else it retries): no two processes can both believe they
hold a folder. A ``flock`` belongs to an open file description, so two opens in one process
would refuse each other: a process-wide table opens each lock file once and counts holders
(several engines in one script may save into one root). The lock is between processes only.
Filesystems without ``flock`` support (``ENOLCK``, ``EOPNOTSUPP``) get a warning and no lock.

[Note: which rank locks]
All ranks of one ``torchrun`` job share ``--out`` and the checkpoint root, and a second job must
be refused on every rank without any rank left waiting in a collective. Only rank 0 takes the
lock; the outcome (taken, or the refusal's text) goes to every rank in one all-reduce, at the
same point of the program on all of them, and every rank raises the same error. So ranks of one
job never contend for the lock, nothing has to recognize "my own job" from environment variables
(``TORCHELASTIC_RUN_ID`` is ``none`` unless ``--rdzv-id`` or ``--standalone`` is given; a master
address and port are reused by the next job), and a refused job ends on all ranks together: a
rank never enters a collective its rank 0 has left. The alternative, a lock file per rank,
refuses a second job of another world size only on the ranks both jobs have, lets the rest of it
go on to wait in collectives, and two jobs starting together can each win half the files and
both fail. The cost is that the process group is joined before the lock (``lock_run_folder``),
which creates no file. A folder that only some nodes see (``--out`` on local disks) is locked
where rank 0 sees it; checkpoints must be on a filesystem every rank sees anyway.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from outcore.device.accel import Accelerator
from outcore.errors import FolderInUseError, StorageError
from outcore.offload.stale import pid_alive
from outcore.runtime.bootstrap import join_world
from outcore.runtime.comm import Comm

LOCK_NAME = ".outcore-lock"
"""The lock file's name inside a locked folder."""

_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_WIRE = 512  # bytes of rank 0's message that travel to the other ranks
_OK, _IN_USE, _SKIPPED = 0, 1, 2


@dataclass(frozen=True)
class Holder:
    """Who holds a folder, as the holder wrote it into the lock file."""

    pid: int
    """The holding process (rank 0 of its job)."""
    host: str
    """The machine it runs on."""
    since: str
    """When it took the folder (local time)."""
    what: str
    """What it uses the folder for, e.g. ``outcore train --out``."""
    world_size: int
    """Ranks in the holder's job."""

    def describe(self) -> str:
        if self.pid < 0:
            return "a process that has not written who it is into the lock file"
        ranks = f", rank 0 of {self.world_size}" if self.world_size > 1 else ""
        return f"pid {self.pid} on host {self.host} ({self.what}{ranks}, since {self.since})"


class _Table:
    """This process's open lock files: one descriptor per file, counted (see the note)."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.held: dict[Path, tuple[int, int]] = {}  # lock file -> (descriptor, holders)


_TABLE = _Table()


class FolderLock:
    """This process's hold on one folder; ``release()`` (also at garbage collection) gives it
    back, and the kernel does when the process dies."""

    def __init__(self, folder: Path, path: Path) -> None:
        self.folder, self.path = folder, path
        self._finalizer = weakref.finalize(self, _drop, path)

    @property
    def held(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        """Give the folder back; idempotent."""
        self._finalizer()

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"FolderLock({self.folder}, {'held' if self.held else 'released'})"


def _drop(path: Path) -> None:
    with _TABLE.mutex:
        fd, count = _TABLE.held.pop(path)
        if count > 1:
            _TABLE.held[path] = (fd, count - 1)
            return
        with contextlib.suppress(OSError):  # unlink while locked: see the note
            if _same_file(path, fd):
                os.unlink(path)
        os.close(fd)


def _same_file(path: Path, fd: int) -> bool:
    try:
        a, b = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _open_locked(path: Path) -> int | None:
    """A descriptor of ``path`` holding its exclusive lock, or None if another holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:
            os.close(fd)
            raise
        if _same_file(path, fd):
            return fd
        os.close(fd)  # its holder unlinked it between our open and our lock: try again


def try_lock(folder: Path, what: str, world_size: int = 1) -> FolderLock | Holder | None:
    """Lock ``folder`` (which must exist) for this process: the lock, the ``Holder`` that has
    it, or None where the filesystem cannot lock (after a warning). Raises ``OSError``."""
    path = Path(folder).resolve() / LOCK_NAME  # one key per file, however it is spelled
    with _TABLE.mutex:
        if path in _TABLE.held:
            fd, count = _TABLE.held[path]
            _TABLE.held[path] = (fd, count + 1)
            return FolderLock(path.parent, path)
        try:
            fd = _open_locked(path)
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
            warnings.warn(f"outcore: {folder} cannot be locked ({e.strerror}); nothing stops "
                          "a second run from using it at the same time", stacklevel=3)
            return None
        if fd is not None:
            # the lock is the descriptor's: a full disk refusing the note of who holds it
            # (ENOSPC) must not leave it held and unrecorded, which refused this process's
            # own retry as "another run"; another run's refusal then names no holder
            with contextlib.suppress(OSError):
                _write_holder(fd, what, world_size)
            _TABLE.held[path] = (fd, 1)
            return FolderLock(path.parent, path)
    return read_holder(path.parent)


def _write_holder(fd: int, what: str, world_size: int) -> None:
    me = {"pid": os.getpid(), "host": socket.gethostname(), "what": what,
          "since": time.strftime("%Y-%m-%d %H:%M:%S"), "world_size": world_size,
          "command": " ".join(sys.argv)[:300]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)


def read_holder(folder: Path, patience_s: float = 1.0) -> Holder:
    """The holder of a locked ``folder``, as it wrote itself into the lock file. A holder that
    has just taken the lock may not have written yet, and the file may still name a killed
    holder before it: both are waited out for ``patience_s``."""
    path, here = Path(folder) / LOCK_NAME, socket.gethostname()
    deadline = time.monotonic() + patience_s
    while True:
        try:
            rec = json.loads(path.read_text())
            who = Holder(int(rec["pid"]), str(rec["host"]), str(rec["since"]), str(rec["what"]),
                         int(rec.get("world_size", 1)))
        except (OSError, ValueError, KeyError, TypeError):
            who = None
        if who is not None and (who.host != here or pid_alive(who.pid)):
            return who
        if time.monotonic() > deadline:
            return who or Holder(-1, "unknown", "unknown", "another outcore run", 1)
        time.sleep(0.05)


# -- one job, many ranks ---------------------------------------------------------------------
def lock_folder(folder: Path, what: str, hint: str, comm: Comm, accel: Accelerator, *,
                create: bool = True, required: bool = True) -> tuple[FolderLock | None, bool]:
    """Lock ``folder`` for this job (see [Note: which rank locks]): rank 0 tries, every rank
    learns the outcome, and every rank raises ``FolderInUseError`` naming the folder and the
    holder, with ``hint`` saying what to do. Returns (the lock on rank 0, else None; whether
    the job now counts as holding the folder, the same on every rank). A folder that does not
    exist (``create`` False) or cannot be written is not held, and raises ``StorageError`` only
    where ``required``; a filesystem that cannot lock counts as held, unlocked."""
    folder = Path(folder).absolute()
    lock, kind, text = None, _OK, ""
    if comm.rank == 0:
        try:
            if create:
                folder.mkdir(parents=True, exist_ok=True)
            got = try_lock(folder, what, comm.world_size) if folder.is_dir() else False
            if isinstance(got, Holder):
                kind = _IN_USE
                text = f"{folder} is in use by another run: {got.describe()}; {hint}"
            elif got is False:
                kind = _SKIPPED
            else:
                lock = got
        except OSError as e:
            kind, text = _SKIPPED, f"cannot use {folder}: {_why(folder, e)}"
    kind, text = _share(comm, accel, kind, text)
    if kind == _IN_USE:
        raise FolderInUseError(text)
    if kind == _SKIPPED and required:
        raise StorageError(text or f"cannot use {folder}: it is not a folder")
    return lock, kind == _OK


def _why(folder: Path, error: OSError) -> str:
    """Why ``folder`` cannot be made or used: the file in its way, by name, where one is."""
    for part in (folder, *folder.parents):
        if part.exists():
            if not part.is_dir():
                return "it is a file, not a folder" if part == folder else \
                    f"{part} in its path is a file, not a folder"
            break
    return error.strerror or str(error)


def _share(comm: Comm, accel: Accelerator, kind: int, text: str) -> tuple[int, str]:
    """Rank 0's (kind, text) on every rank, in one all-reduce (the others send zeros)."""
    if comm.world_size == 1:
        return kind, text
    buf = torch.zeros(2 + _WIRE, dtype=torch.int64)
    if comm.rank == 0:
        raw = text.encode()[:_WIRE]
        buf[0], buf[1] = kind, len(raw)
        buf[2:2 + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
    dev = accel.to_device(buf)
    comm.all_reduce_sum(dev)
    buf = dev.cpu()
    n = int(buf[1])
    return int(buf[0]), bytes(buf[2:2 + n].tolist()).decode(errors="replace")


def lock_run_folder(out: Path, timeout_s: float) -> contextlib.AbstractContextManager:
    """``outcore train``'s hold on ``--out``, taken before the model or any swap file exists;
    leaving the returned context gives it back (a no-op on ranks other than 0). Joins the
    process group ``torchrun`` describes first; the Runtime finds it joined."""
    accel = Accelerator.detect()
    comm = join_world(accel.backend, timeout_s)
    lock, _ = lock_folder(out, "outcore train",
                          "wait for it to finish, or give another --out", comm, accel)
    return lock if lock is not None else contextlib.nullcontext()


class HeldFolders:
    """The checkpoint roots an engine holds: from its first save into a root (or load from
    one) until ``release_all()`` at ``engine.close()``."""

    def __init__(self) -> None:
        self._held: dict[Path, FolderLock | None] = {}

    def hold(self, folder: Path, comm: Comm, accel: Accelerator, *, create: bool) -> None:
        """Hold ``folder`` for this job unless it already does (every rank calls, with the
        same folder, so every rank makes the same decisions)."""
        key = Path(folder).absolute()
        if key in self._held:
            return
        lock, held = lock_folder(key, "checkpoints of an outcore Engine",
                                 "wait for it to finish, or save somewhere else", comm, accel,
                                 create=create, required=False)
        if held:
            self._held[key] = lock

    def release_all(self) -> None:
        """Give back every folder held; idempotent."""
        for lock in self._held.values():
            if lock is not None:
                lock.release()
        self._held.clear()
