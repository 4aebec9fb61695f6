"""The byte ledger: what each tier holds, by kind, charged by the objects that own the bytes.

[Note: a charge belongs to its owner]
Every byte outcore holds on purpose is on the ledger as a ``Charge``: one (tier, kind) amount
held by one owner (a stored shard, a parameter's gradient, a group's gathered tensors, the I/O
pool, an activation's extent). The owner keeps the charge as an attribute and moves its
amount with ``set``/``change``; ``release`` (also leaving a ``with`` block) takes it off. There
is no paired add and subtract to keep in step: a charge's amount can only be replaced, so a
double release or a release of a never-set charge is harmless, and a charge whose owner is
collected without releasing it is settled by its finalizer, so a forgotten release cannot
leave bytes counted for ever. ``memory_report()`` and the metrics read ``snapshot()``, whose
keys (``"<tier>.<kind>"``, ``"peak.<tier>"``, ``"peak.<tier>.<kind>"``) are part of the
report's format.

[Note: a finalizer never takes the lock]
A finalizer may run inside the garbage collector, and the collector may run at any allocation
of the thread that is inside ``Ledger._hold`` with the lock held: a finalizer taking that
(non-reentrant) lock would deadlock the thread, and a reentrant one would let it change the
counts halfway through the outer update. So a finalizer only appends its amount to a queue
(``deque.append`` is atomic), and every locked method first takes the queued amounts off.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict, deque
from enum import Enum
from types import TracebackType

from outcore.offload.tier import Tier


class Kind(str, Enum):
    """What the bytes are (the second part of a ledger key)."""

    PARAMS = "params"  # training-dtype parameter shards
    MASTER = "master"  # fp32 master shards (where they are not the params themselves)
    OPTIMIZER = "optimizer"  # optimizer state (moments, factors, momentum)
    GRADS = "grads"  # gradient shards (fp32, or the compute dtype where held raw)
    UNSHARDED = "unsharded"  # gathered full parameters, counted from the fetch's start
    IO_BUFFERS = "io_buffers"  # the I/O pool and the optimizer's staging slots
    PARAM_CACHE = "param_cache"  # aligned memory kept for full tensors' reuse
    ACTIVATIONS = "activations"  # activation checkpoints offloaded to the swap file
    TENTATIVE = "tentative"  # room for updates written aside until step() (storage.py)


Key = tuple[str, str]


class Ledger:
    """Bytes held per (tier, kind); thread-safe, as I/O threads and the optimizer's worker
    move charges concurrently. Only ``Charge`` changes the amounts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[Key, int] = defaultdict(int)
        self._peak: dict[str, int] = defaultdict(int)
        self._kind_peak: dict[Key, int] = defaultdict(int)
        self._dropped: deque[tuple[Key, int]] = deque()  # settled by finalizers, not yet applied

    def charge(self, tier: Tier, kind: Kind, nbytes: int = 0) -> Charge:
        """A new charge of ``nbytes`` for its owner to keep (see the note above)."""
        return Charge(self, tier, kind, nbytes)

    def _hold(self, key: Key, held: list[int], nbytes: int | None, delta: int = 0) -> None:
        """Make a charge's amount (``held[0]``) ``nbytes``, or move it by ``delta``, and the
        ledger with it, atomically: I/O threads may move the same charge concurrently."""
        with self._lock:
            self._apply_dropped()
            new = held[0] + delta if nbytes is None else nbytes
            assert new >= 0, f"a charge of {new} bytes ({key})"
            delta, held[0] = new - held[0], new
            self._move(key, delta)

    def _move(self, key: Key, delta: int) -> None:
        """Move ``key``'s bytes by ``delta`` and the peaks with them (the lock is held)."""
        if not delta:
            return
        self._bytes[key] += delta
        self._kind_peak[key] = max(self._kind_peak[key], self._bytes[key])
        tier = key[0]
        total = sum(v for (t, _), v in self._bytes.items() if t == tier)
        self._peak[tier] = max(self._peak[tier], total)

    def _apply_dropped(self) -> None:
        """Take the amounts finalizers queued off the counts (the lock is held)."""
        while self._dropped:
            key, amount = self._dropped.popleft()
            self._move(key, -amount)

    def tier_bytes(self, tier: str) -> int:
        with self._lock:
            self._apply_dropped()
            return sum(v for (t, _), v in self._bytes.items() if t == tier)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            self._apply_dropped()
            out = {f"{t}.{k}": v for (t, k), v in sorted(self._bytes.items())}
            out.update({f"peak.{t}": v for t, v in self._peak.items()})
            out.update({f"peak.{t}.{k}": v for (t, k), v in sorted(self._kind_peak.items())})
            return out

    def reset_peaks(self) -> None:
        """Start peak tracking afresh from the current values (e.g. after warm-up)."""
        with self._lock:
            self._apply_dropped()
            self._kind_peak = defaultdict(int, self._bytes)
            tiers = {t for t, _ in self._bytes}
            self._peak = defaultdict(int, {t: sum(v for (u, _), v in self._bytes.items()
                                                  if u == t) for t in tiers})


def _settle(ledger: Ledger, key: Key, held: list[int]) -> None:
    """Take what a charge still holds off the ledger (its release)."""
    ledger._hold(key, held, 0)


def _dropped(ledger: Ledger, key: Key, held: list[int]) -> None:
    """A charge collected unreleased: queue what it held ([Note: a finalizer never takes
    the lock]); nothing else can touch ``held`` any more, its charge is gone."""
    amount, held[0] = held[0], 0
    if amount:
        ledger._dropped.append((key, amount))


class Charge:
    """``nbytes`` of one kind in one tier, held by the object that keeps this charge."""

    __slots__ = ("__weakref__", "_finalizer", "_held", "_key", "_ledger")

    def __init__(self, ledger: Ledger, tier: Tier, kind: Kind, nbytes: int = 0) -> None:
        self._ledger, self._key = ledger, (tier.value, kind.value)
        self._held = [0]  # shared with the finalizer, which must not hold the charge itself
        self._finalizer = weakref.finalize(self, _dropped, ledger, self._key, self._held)
        self._finalizer.atexit = False  # at the process's end there is no one left to count
        self.set(nbytes)

    @property
    def nbytes(self) -> int:
        return self._held[0]

    def set(self, nbytes: int) -> None:
        """The owner now holds ``nbytes`` (the ledger moves by the difference)."""
        self._ledger._hold(self._key, self._held, nbytes)

    def change(self, delta: int) -> None:
        """The owner's bytes grew (or shrank) by ``delta``."""
        self._ledger._hold(self._key, self._held, None, delta)

    def release(self) -> None:
        """The owner holds none of these bytes any more (again: a no-op)."""
        _settle(self._ledger, self._key, self._held)

    def __enter__(self) -> Charge:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
