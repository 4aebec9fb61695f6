"""What the optimizer's update pipeline does through a step, by phase (issue 29): for
``bench/cpu_split.py --pipeline``.

Wraps one engine's ``UpdatePipeline`` and its kernel (the ``ShardedOptimizer``) and records
intervals: a submit that waited for the limit on held gradients (backward stalls on it), the
pipeline idle for want of a job, waiting for a sub-group's reads or writes, issuing reads
(``stage_in``), the update's arithmetic (``apply``) and issuing writes with the casts
(``stage_out``); and on the main thread, issuing a layer's fetch (``unshard``) and waiting
for it (``wait_unshard``). The sum of each kind inside each phase (forward, backward, the
step's tail) says whether the disk idles because the pipeline has nothing queued, waits on the
disk, or is held up by its own CPU work. For measurements by hand.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from outcore.optim import pipeline as pipeline_mod
from outcore.zero.group import GatherGroup

KINDS = ("submit blocked", "idle (no job)", "wait reads", "wait writes", "stage_in", "apply",
         "stage_out", "unshard", "wait_unshard")
APPLIED = "_trace_applied"  # set on a sub-group past its update: what it waits for is writes


class PipelineTrace:
    """Intervals of the pipeline's work, recorded from install() to uninstall()."""

    def __init__(self, engine: Any) -> None:
        self.opt = engine.sharded_optimizer
        self.events: list[tuple[str, str, float, float]] = []  # kind, thread, start, end
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []
        self.recording = False

    def _add(self, kind: str, t0: float, t1: float) -> None:
        if self.recording:
            name = "main" if threading.current_thread() is threading.main_thread() else "worker"
            with self._lock:
                self.events.append((kind, name, t0, t1))

    def _wrap(self, owner: Any, attr: str, kind: str,
              when: Callable[..., bool] | None = None) -> None:
        original = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if when is not None and not when(*args, **kwargs):
                return original(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._add(kind, t0, time.perf_counter())

        if isinstance(owner, type):
            setattr(owner, attr, timed)
            self._undo.append(lambda: setattr(owner, attr, original))
        else:
            setattr(owner, attr, timed)
            self._undo.append(lambda: delattr(owner, attr))

    def install(self) -> None:
        self._wrap(self.opt.pipeline, "submit", "submit blocked")
        for attr in ("stage_in", "stage_out"):
            self._wrap(self.opt, attr, attr)
        apply = self.opt.apply

        def noting(work: Any, hp: Any) -> None:
            setattr(work, APPLIED, True)
            apply(work, hp)

        self.opt.apply = noting
        self._wrap(self.opt, "apply", "apply")
        self._wrap(pipeline_mod.InFlight, "wait", "wait reads",
                   when=lambda work: not getattr(work, APPLIED, False))
        self._wrap(pipeline_mod.InFlight, "wait", "wait writes",
                   when=lambda work: getattr(work, APPLIED, False))
        self._wrap(pipeline_mod.JobQueue, "next", "idle (no job)",
                   when=lambda _self, block: block)
        self._wrap(GatherGroup, "unshard", "unshard")
        self._wrap(GatherGroup, "wait_unshard", "wait_unshard")

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    def by_phase(self, windows: list[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
        """Seconds of each kind inside each named window, summed over windows of one name
        (``submit blocked`` is the main thread's; the rest are the pipeline's, whichever
        thread runs it)."""
        out: dict[str, dict[str, float]] = {}
        for phase, a, b in windows:
            row = out.setdefault(phase, dict.fromkeys(KINDS, 0.0))
            for kind, _, t0, t1 in self.events:
                row[kind] += max(0.0, min(b, t1) - max(a, t0))
        return out

    def first_submit_after(self, a: float) -> float | None:
        starts = [t0 for kind, _, t0, _ in self.events if kind == "submit blocked" and t0 >= a]
        return min(starts) - a if starts else None
