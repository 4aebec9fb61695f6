"""What the optimizer's update pipeline does through a step, by phase (issue 29): for
``bench/cpu_split.py --pipeline``.

Wraps one engine's ``UpdatePipeline`` and its kernel (the ``ShardedOptimizer``) and records
intervals of the pipeline's thread: idle for want of a job, waiting for a sub-group's reads,
waiting for the writes of the sub-group whose staging slot it reuses, issuing reads
(``stage_in``), the update's arithmetic (``apply``) and the casts, digests and write issues
(``stage_out``). On the thread that runs backward's hooks it records each ``submit`` (its
wait for the limit on held gradients included); on the thread that runs the model, a layer's
fetch (``unshard``, ``wait_unshard``: the outermost call only, so a ``wait_unshard`` that
issues its own reads is counted once) and, inside those, the wait for the previous step's
updates of that layer (``wait update``). The sum of each kind inside each phase (forward,
backward, the step's tail) says whether the disk idles because the pipeline has nothing
queued, waits on the disk, or is held up by its own CPU work.

On CUDA ``apply`` and ``stage_out`` time kernel launches and host casts, not the device's
arithmetic. For measurements by hand.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from outcore.optim import pipeline as pipeline_mod
from outcore.zero.group import GatherGroup

KINDS = ("submit", "idle (no job)", "wait reads", "wait writes", "stage_in", "apply",
         "stage_out", "unshard", "wait_unshard", "wait update")
APPLIED = "_trace_applied"  # set on a sub-group past its update: what it waits for is writes
_MISSING = object()


class PipelineTrace:
    """Intervals of the pipeline's work, recorded while ``recording``, from ``install()`` to
    ``uninstall()``."""

    def __init__(self, engine: Any) -> None:
        self.opt = engine.sharded_optimizer
        self.events: list[tuple[str, float, float]] = []  # kind, start, end
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []
        self._inside = threading.local()  # families with a call in progress on this thread
        self.recording = False

    def _add(self, kind: str, t0: float, t1: float) -> None:
        if self.recording:
            with self._lock:
                self.events.append((kind, t0, t1))

    def _wrap(self, owner: Any, attr: str, kind: str,
              when: Callable[..., bool] | None = None, family: str | None = None) -> None:
        """Time ``owner.attr`` as ``kind`` (where ``when`` says so); of nested calls in one
        ``family`` on one thread, only the outermost is timed."""
        original = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if when is not None and not when(*args, **kwargs):
                return original(*args, **kwargs)
            active: set[str] = self._inside.__dict__.setdefault("families", set())
            if family is not None and family in active:
                return original(*args, **kwargs)
            if family is not None:
                active.add(family)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._add(kind, t0, time.perf_counter())
                if family is not None:
                    active.discard(family)

        self._set(owner, attr, timed)

    def _set(self, owner: Any, attr: str, value: Any) -> None:
        """``owner.attr = value``, undone by ``uninstall()`` to what ``owner`` itself held
        (an inherited or class attribute shows through again)."""
        before = owner.__dict__.get(attr, _MISSING)
        setattr(owner, attr, value)

        def undo() -> None:
            if before is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, before)

        self._undo.append(undo)

    def install(self) -> None:
        """Wrap the pipeline, its kernel and the layers' fetches (before the steps to trace;
        nothing is recorded until ``recording`` is set)."""
        self._wrap(self.opt.pipeline, "submit", "submit")
        for attr in ("stage_in", "stage_out"):
            self._wrap(self.opt, attr, attr)
        apply = self.opt.apply

        def noting(work: Any, hp: Any) -> None:
            setattr(work, APPLIED, True)
            apply(work, hp)

        self._set(self.opt, "apply", noting)
        self._wrap(self.opt, "apply", "apply")
        self._wrap(pipeline_mod.InFlight, "wait", "wait reads",
                   when=lambda work: not getattr(work, APPLIED, False))
        self._wrap(pipeline_mod.InFlight, "wait", "wait writes",
                   when=lambda work: getattr(work, APPLIED, False))
        self._wrap(pipeline_mod.JobQueue, "next", "idle (no job)",
                   when=lambda _self, block: block)
        self._wrap(GatherGroup, "unshard", "unshard", family="fetch")
        self._wrap(GatherGroup, "wait_unshard", "wait_unshard", family="fetch")
        self._wrap(GatherGroup, "await_update", "wait update")

    def uninstall(self) -> None:
        """Put every wrapped method back, the last wrapped first."""
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    def by_phase(self, windows: list[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
        """Seconds of each kind inside each named window, summed over windows of one name
        (``wait update`` is also inside ``unshard`` or ``wait_unshard``)."""
        out: dict[str, dict[str, float]] = {}
        for phase, a, b in windows:
            row = out.setdefault(phase, dict.fromkeys(KINDS, 0.0))
            for kind, t0, t1 in self.events:
                row[kind] += max(0.0, min(b, t1) - max(a, t0))
        return out

    def first_submit(self, a: float, b: float) -> float | None:
        """Seconds from ``a`` to the first submit in ``[a, b)``; None if there was none."""
        starts = [t0 for kind, t0, _ in self.events if kind == "submit" and a <= t0 < b]
        return min(starts) - a if starts else None
