"""The optimizer's units of work in flight: slices, sub-groups, jobs, and the feed that orders them.

optimizer.py's pipeline moves these between disk, host buffers and the update kernel; this module
holds only their book-keeping, so each piece can be read on its own.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from outcore.offload.buffers import aligned_empty
from outcore.zero.param import ShardedParam

ALIGN_ELEMS = 2048  # 8 KiB of fp32, 4 KiB of bf16/fp16: slices start on 4 KiB boundaries


@dataclass
class Slice:
    """Elements ``[lo, hi)`` of one parameter's shard: the update is elementwise, so a large
    shard is streamed in pieces (optimizer.py's [Note: streamed sub-groups])."""

    sp: ShardedParam
    lo: int
    hi: int

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.lo : self.hi]


@dataclass(eq=False)
class Job:
    """Parameters of one param group to update: one submission, or the rest at ``step()``."""

    group: int  # index into ``param_groups``
    hp: dict  # its hyper-parameters as they were when the job was made
    sps: list[ShardedParam]
    background: bool  # its gradients are freed once applied (optimizer.py's [Note: updating
    # during backward])
    done: Future = field(default_factory=Future)
    unsettled: int = 0  # sub-groups whose writes have not been waited for
    error: BaseException | None = None

    def settle(self, error: BaseException | None = None) -> None:
        """One sub-group's transfers are over; the job is done when all of its are."""
        self.error = self.error or error
        self.unsettled -= 1
        if self.unsettled == 0:
            if self.error is not None:
                self.fail(self.error)
            elif not self.done.done():
                self.done.set_result(None)

    def fail(self, error: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(error)


@dataclass(eq=False)
class Work:
    """One sub-group in flight: its slices and their master/state tensors in memory."""

    params: list[Slice]
    job: Job | None = None
    last: bool = False  # the job's last sub-group: its update completes the job's updates
    turn: int = 0  # which staging slot it uses: ``turn % plan.staging_slots``
    master: list[torch.Tensor] = field(default_factory=list)
    states: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    pending: list = field(default_factory=list)
    slot: Slot | None = None  # the buffers staged slices live in (None: all resident)
    places: list[int] = field(default_factory=list)  # each slice's offset in the slot

    def wait(self) -> None:
        """Wait for every transfer of this sub-group, then raise the first error, if any:
        its slot is reused next, so nothing may still be reading or writing it."""
        pending, self.pending = self.pending, []
        first_error(pending)


class Feed:
    """The sub-groups to update, job by job, from a queue; ``None`` queued ends the feed."""

    def __init__(self, subgroups: Callable[[list[ShardedParam]], Iterator[list[Slice]]]
                 ) -> None:
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._subgroups = subgroups
        self._current: Iterator[tuple[Job, list[Slice], bool]] = iter(())
        self._ended = False

    def next(self, block: bool) -> tuple[Job, list[Slice], bool] | None:
        """The next (job, sub-group, is the job's last); None if the feed ended or, unless
        ``block``, nothing is queued yet."""
        while not self._ended:
            item = next(self._current, None)
            if item is not None:
                return item
            try:
                job = self.jobs.get(block=block)
            except queue.Empty:
                return None
            if job is None:
                self._ended = True
            else:
                self._current = self._expand(job)
        return None

    def reverse_queued(self) -> None:
        """Reverse the order of the jobs not yet started (the worker may take one meanwhile:
        it then simply comes first)."""
        jobs: list[Job | None] = []
        with contextlib.suppress(queue.Empty):
            while True:
                jobs.append(self.jobs.get_nowait())
        ended = None in jobs
        for job in reversed([j for j in jobs if j is not None]):
            self.jobs.put(job)
        if ended:
            self.jobs.put(None)

    def _expand(self, job: Job) -> Iterator[tuple[Job, list[Slice], bool]]:
        chunks = list(self._subgroups(job.sps)) or [[]]  # one, even if empty: it ends the job
        job.unsettled = len(chunks)
        for i, chunk in enumerate(chunks):
            yield job, chunk, i == len(chunks) - 1


def settle(work: Work | None, error: BaseException | None = None) -> None:
    """Wait for what ``work`` still moves, then report it (and ``error``) to its job."""
    if work is None:
        return
    try:
        work.wait()
    except BaseException as e:  # noqa: BLE001 - handed to the job
        error = error or e
    work.job.settle(error)


def first_error(futures: Iterable[Future]) -> None:
    """Wait for every future (``concurrent.futures`` or I/O futures alike), then raise the
    first error among them, if any."""
    error: BaseException | None = None
    for fut in futures:
        e = fut.exception()
        error = error or e
    if error is not None:
        raise error


class Slot:
    """Page-aligned host buffers for one sub-group in flight, allocated once and reused.

    [Note: staging without copies]
    A staged slice is placed at a multiple of ``ALIGN_ELEMS`` elements in every buffer, so
    its bytes start on a 4 KiB boundary in memory as they do in the swap file, and O_DIRECT
    moves them straight between disk and buffer: no bounce through the I/O pool and no fresh
    allocation (each of which page-faults on first touch, and the kernel zeroes every page). Three
    slots serve the pipeline: one being read, one being updated, one being written.
    """

    def __init__(self, elems: int, kinds: tuple[str, ...], cast: torch.dtype | None) -> None:
        # zero_() touches every page now, not in the first step; "grad" is where a gradient
        # held in the training dtype is cast for the update (param.py's [Note: gradients are
        # held, not copied]), not read from disk
        self.buffers = {k: aligned_empty(elems * 4).zero_().view(torch.float32) for k in kinds}
        self.cast = (aligned_empty(elems * cast.itemsize).zero_().view(cast)
                     if cast is not None else None)
