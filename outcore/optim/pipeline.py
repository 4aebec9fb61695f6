"""The update pipeline: every optimizer update that runs off the step's critical path, in one
object (``UpdatePipeline``) with its book-keeping.

[Note: one pipeline, one owner]
An update is queued as an ``UpdateJob`` (one param group's parameters whose gradients are
final), expanded by a ``JobQueue`` into sub-groups, and moved through three staging slots as
``InFlight`` sub-groups: read, updated, written (optimizer.py's [Note: streamed sub-groups]).
Jobs submitted during backward run on the pipeline's worker thread (optimizer.py's [Note:
updating during backward]); the step's remaining jobs run on the caller's thread through the
same loop; with the step's tail deferred, ``after_step`` hands back the jobs still running,
latest layers last, and ``unfinished_by_group`` tells each gathered group which updates it
must wait for before reading its shards (this file's [Note: the step's tail runs into the
next forward]). Everything that starts, orders, waits for or stops an update is here; the
optimizer supplies only the arithmetic and the bytes (``Kernel``), the groups only wait.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from outcore.optim.staging import ShardSlice, StagingSlot
from outcore.profiling import OPTIM_READ, OPTIM_UPDATE, OPTIM_WRITE, record_function
from outcore.zero.param import ShardedParam

if TYPE_CHECKING:
    from outcore.offload.storage import Future as ShardFuture


@dataclass(eq=False)
class UpdateJob:
    """Parameters of one param group to update: one submission, or the rest at ``step()``."""

    group: int  # index into ``param_groups``
    hp: dict[str, Any]  # its hyper-parameters as they were when the job was made
    sps: list[ShardedParam]
    background: bool  # its gradients are freed once applied (optimizer.py's [Note: updating
    # during backward])
    tentative: bool = False  # writes aside, keeps its gradients (speculation.py's [Note: a
    # speculative step])
    grad_scale: float = 1.0  # clipping's coefficient, or 1 / fp16's loss scale for a tentative
    # job, applied as the update reads a gradient (staging.py's [Note: the gradient an update
    # reads])
    done: Future[None] = field(default_factory=Future)
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
class InFlight:
    """One sub-group in flight: its slices and their master/state tensors in memory."""

    params: list[ShardSlice]
    job: UpdateJob
    last: bool = False  # the job's last sub-group: its update completes the job's updates
    turn: int = 0  # which staging slot it uses: ``turn % slot_count``
    master: list[torch.Tensor] = field(default_factory=list)
    states: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    pending: list[ShardFuture] = field(default_factory=list)  # its reads, then its writes
    slot: StagingSlot | None = None  # the buffers staged slices live in (None: all resident)
    places: list[int] = field(default_factory=list)  # each slice's offset in the slot

    def wait(self) -> None:
        """Wait for every transfer of this sub-group, then raise the first error, if any:
        its slot is reused next, so nothing may still be reading or writing it."""
        pending, self.pending = self.pending, []
        first_error(pending)


class Kernel(Protocol):
    """What the pipeline needs of the optimizer: how to cut, stage, update and store."""

    def subgroups(self, sps: list[ShardedParam]) -> Iterator[list[ShardSlice]]: ...

    def slots(self) -> list[StagingSlot] | None: ...

    def stage_in(self, work: InFlight, slot: StagingSlot | None) -> None: ...

    def apply(self, work: InFlight, hp: dict[str, Any]) -> None: ...

    def stage_out(self, work: InFlight) -> None: ...

    def finished(self, job: UpdateJob) -> None: ...


Item = tuple[UpdateJob, list[ShardSlice], bool]


class JobQueue:
    """The sub-groups to update, job by job, from a queue; ``None`` queued ends it."""

    def __init__(self, kernel: Kernel) -> None:
        self.jobs: queue.SimpleQueue[UpdateJob | None] = queue.SimpleQueue()
        self._kernel = kernel
        self._current: Iterator[Item] = iter(())
        self._ended = False

    def end_now(self) -> None:
        """End the queue after the sub-groups already taken (the process is exiting: see
        ``_end_at_exit``); the jobs left are never done."""
        self._ended = True
        self.jobs.put(None)  # wakes a worker waiting for work

    def next(self, block: bool) -> Item | None:
        """The next (job, sub-group, is the job's last); None if the queue ended or, unless
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
        jobs: list[UpdateJob | None] = []
        with contextlib.suppress(queue.Empty):
            while True:
                jobs.append(self.jobs.get_nowait())
        ended = None in jobs
        for job in reversed([j for j in jobs if j is not None]):
            self.jobs.put(job)
        if ended:
            self.jobs.put(None)

    def _expand(self, job: UpdateJob) -> Iterator[Item]:
        chunks = list(self._kernel.subgroups(job.sps)) or [[]]  # one even if empty: ends the job
        job.unsettled = len(chunks)
        for i, chunk in enumerate(chunks):
            yield job, chunk, i == len(chunks) - 1


_EXIT_WAIT_S = 60.0  # the most an exiting process waits for the sub-groups in flight


def _end_at_exit(jobs: JobQueue, worker: threading.Thread) -> None:
    """[Note: a process that ends with updates running]
    A script may end, or raise, between a backward that started updates and ``step()``, or
    after a ``step()`` whose tail still runs, without ``close()``. The worker is a daemon
    thread, so the interpreter would finalize with it inside an update (a torch kernel, a wait
    for the disk); when that returns, the thread is ended by a forced unwind through C++
    frames, which calls ``std::terminate``: the process aborts (status 134, "terminate
    called without an active exception") instead of exiting with its own status. So, at
    exit (``weakref.finalize`` runs this before the interpreter finalizes, and before the
    I/O threads', made earlier, stop), the worker finishes the sub-groups it has taken and
    stops; the updates still queued are dropped, as is everything else an engine that was
    not closed holds when its process ends (its swap files are deleted)."""
    jobs.end_now()
    worker.join(_EXIT_WAIT_S)


def _start(worker: threading.Thread, jobs: JobQueue) -> None:
    """``worker.start()``; if that raises, no worker is left running.

    [Note: a Ctrl-C while the worker starts]
    ``Thread.start`` launches the thread, then waits for it to run; a ``KeyboardInterrupt``
    in that wait left a thread the pipeline had recorded but ``join`` refused ("cannot join
    thread before it is started"), raised from the backward's clean-up instead of the
    interrupt, and the next step waited forever for updates no worker would make. So the
    pipeline records a worker only once it runs; one launched but interrupted is ended here
    (it meets the end of its queue first), and the interrupt goes on."""
    try:
        worker.start()
    except BaseException:
        jobs.jobs.put(None)  # what it meets first, once it runs
        for _ in range(200):  # launched, it runs within moments; otherwise it never will
            if worker.ident is not None:  # it ran: join once start()'s handshake is done
                with contextlib.suppress(RuntimeError):  # "before it is started": not yet
                    worker.join(_EXIT_WAIT_S)
                    break
            time.sleep(0.005)
        raise


def settle(work: InFlight | None, error: BaseException | None = None) -> None:
    """Wait for what ``work`` still moves, then report it (and ``error``) to its job."""
    if work is None:
        return
    try:
        work.wait()
    except BaseException as e:  # noqa: BLE001 - handed to the job
        error = error or e
    work.job.settle(error)


def first_error(futures: Iterable[ShardFuture]) -> None:
    """Wait for every future (``concurrent.futures`` or I/O futures alike), then raise the
    first error among them, if any."""
    error: BaseException | None = None
    for fut in futures:
        e = fut.exception()
        error = error or e
    if error is not None:
        raise error


class UpdatePipeline:
    """Runs updates read-ahead and write-behind, on its worker or the caller's thread."""

    def __init__(self, kernel: Kernel, slot_count: int, pending_grad_limit: int | None,
                 single_threaded_worker: bool) -> None:
        self._kernel = kernel
        self._slot_count = slot_count
        # gradients waiting for a background update may hold at most this many bytes; the
        # backward that submits more waits for the oldest update (None: no limit)
        #
        # [Note: paced only where updates free gradients]
        # The limit bounds the host memory of gradients that wait for their update, so it
        # applies where an update frees the gradients it read (state on NVMe). Where the state
        # is in memory, every gradient's buffer is kept from step to step (param.py's [Note:
        # gradient buffers]): waiting costs no byte, and a limit would only stall backward.
        # On a GPU with gpt-1.3b's state in host memory, the limit (512 MiB) less its tied
        # head's reserved 131 MB let about 1.7 layers' updates wait, 2.3 before that
        # reservation. Unpaced, backward took 0.40 s there instead of 0.60, and the
        # optimizer's tail after it grew by about as much: the host's update is that step's
        # bound, not backward (bench/gpu/2026-11-27-h100/README.md).
        self.pending_grad_limit = pending_grad_limit
        self._single = single_threaded_worker
        self._worker: threading.Thread | None = None
        self._at_exit: weakref.finalize[[JobQueue, threading.Thread], UpdatePipeline] | None = None
        self._queue: JobQueue | None = None  # what the worker updates, in order
        self.broken: BaseException | None = None  # the worker died of this (a bug)
        self._submitted: list[tuple[UpdateJob, int]] = []  # with the gradient bytes each holds

    # -- the worker ------------------------------------------------------------------------------
    def submit(self, job: UpdateJob, grad_bytes: int, unseen: int = 0) -> None:
        """Queue ``job`` for the worker (started on first use); first wait for the oldest
        jobs while the gradients they hold, ``grad_bytes`` and ``unseen`` (held for later
        jobs: hooks.py's [Note: a tied weight's gradient waits unseen]) would pass the limit. A job
        that failed meanwhile does not stop this one: its error is raised by ``wait()`` or
        ``after_step()``, with every job submitted before them accounted for."""
        if self.broken is not None:
            raise RuntimeError("the optimizer's update thread failed") from self.broken
        if self._worker is None:
            queue = JobQueue(self._kernel)
            worker = threading.Thread(target=self._serve, args=(queue,), name="outcore-optim",
                                      daemon=True)
            _start(worker, queue)
            self._queue, self._worker = queue, worker
            self._at_exit = weakref.finalize(self, _end_at_exit, queue, worker)
        held, limit = sum(n for _, n in self._submitted), self.pending_grad_limit
        kept: list[tuple[UpdateJob, int]] = []
        for older, n in self._submitted:
            if n and limit is not None and held + grad_bytes + unseen > limit:
                wait_for([older.done])  # its gradients are freed once it is done
                held -= n
                if older.done.exception() is None:
                    continue  # done: forgotten, as wait() would
                n = 0  # failed: kept for wait() or after_step() to raise, not raised here
            kept.append((older, n))
        self._submitted = [*kept, (job, grad_bytes)]
        assert self._queue is not None
        self._queue.jobs.put(job)

    @property
    def pending(self) -> list[UpdateJob]:
        """Submitted jobs not yet waited for (they free their own gradients)."""
        return [job for job, _ in self._submitted]

    def wait(self) -> None:
        """Wait for every submitted job; then raise the first error, if any."""
        submitted, self._submitted = self._submitted, []
        try:
            first_error(job.done for job, _ in submitted)
        finally:
            self._retire_worker()

    def after_step(self) -> list[UpdateJob]:
        """The step returns now: raise a finished job's error, and hand back the jobs still
        running, the not yet started reversed so the first layers come first.

        [Note: the step's tail runs into the next forward]
        Backward finishes with the first layers, so their updates (with the optimizer state
        on NVMe: reads and writes of all their state) are what the step would still wait for, and
        they are what the next forward needs first. Instead, the step re-orders the updates
        not yet started so the first layers come first, and returns. Each group's next fetch
        waits for the updates of its shards (``GatherGroup.await_update``); a prefetch passes a
        group still being updated; ``gathered_parameters``, checkpoints and the next step
        wait as well. So the next forward runs layer by layer behind the updates instead of
        after all of them, and nothing ever reads a shard mid-update. Hyper-parameters are
        taken when an update is submitted, so a learning-rate change after ``step()`` applies
        to the next step, as with torch. An update that fails raises from the fetch (or the
        wait) that needed it.
        Not done where the step must see every update first: with the gradient norm tracked
        (it sums gradients the updates free), and with shards that are the full tensors at
        one rank (the forward would read them while they are written in place; fp32 ones are
        read and written by plain torch calls outside a forward, with no wait). The training
        copies kept in host memory (zero/build.py's ``keep_resident``) are full tensors too,
        yet never the masters: every read of one outside a forward waits for its updates
        (``ShardedParam.check_values``), and in a forward its fetch and every direct read of
        it wait as well (overlap/hooks.py's ``_on_access``; a submodule called on its own
        waits for all of them first, ``Schedule.await_updates``), so with those it is done.
        Off unless ``zero.overlap_step_with_forward`` asks. On a CPU host with few cores it makes
        no difference beyond noise (measured side by side at two settings:
        bench/results/2026-11-27-amd-zen5-bf16-pipeline-ab.md, section 3, and
        2026-11-28-amd-zen5-bf16-offload-cpu.md), because the forward running behind the updates
        takes the cores their digests and page zeroing need; and it moves a failed update's error
        from ``step()`` to a later call. Where the forward runs on an accelerator it would not
        compete for the host's cores, so there it applies to a state in host memory too, whose
        tail after backward took 0.26-0.57 s of a 0.9-1.1 s step (runtime/plan.py; not
        measured yet with it on).
        """
        if not self._submitted:
            self._retire_worker()
            return []
        first_error(job.done for job, _ in self._submitted if job.done.done())
        self._submitted = [(job, n) for job, n in self._submitted if not job.done.done()]
        assert self._queue is not None
        self._queue.reverse_queued()
        return self.pending

    @staticmethod
    def unfinished_by_group(jobs: list[UpdateJob]) -> dict[int, list[Future[None]]]:
        """For each gathered group (by index) whose shards ``jobs`` update: the futures its
        next fetch must wait for (zero/group.py's ``await_update``)."""
        out: dict[int, list[Future[None]]] = {}
        for job in jobs:
            for sp in job.sps:
                group = sp.group
                assert group is not None  # the engine groups every parameter it optimizes
                futures = out.setdefault(group.index, [])
                if job.done not in futures:
                    futures.append(job.done)
        return out

    def close(self) -> None:
        """Forget what was submitted and stop the worker."""
        self._submitted = []
        self._retire_worker()

    def _retire_worker(self) -> None:
        """Stop the idle worker (the next submit starts another). A thread waiting for work
        would hold the optimizer, and through its groups the model, alive after the user
        dropped both: its swap files would then outlive them."""
        if self._worker is not None and not self._submitted:
            assert self._queue is not None
            self._queue.jobs.put(None)
            self._worker.join()
            self._worker = self._queue = None
            if self._at_exit is not None:
                self._at_exit.detach()

    def _serve(self, jobs: JobQueue) -> None:
        """The worker thread: updates submitted jobs until the queue ends."""
        if self._single:
            # backward already runs torch's intra-op threads on every core; one more thread
            # for the update competes less than a second team of them would
            torch.set_num_threads(1)
        try:
            self._pump(jobs)
        except BaseException as e:  # a bug, not an I/O error (those fail their own job)
            self.broken = e
            for job, _ in list(self._submitted):
                job.fail(e)
            raise

    # -- on this thread ---------------------------------------------------------------------------
    def run_now(self, jobs: list[UpdateJob]) -> None:
        """Run ``jobs`` on this thread, with all of torch's threads (nothing else runs now);
        raise the first job's error once all are done."""
        queued = JobQueue(self._kernel)
        for job in [*jobs, None]:
            queued.jobs.put(job)
        self._pump(queued)
        first_error(job.done for job in jobs)

    def _pump(self, jobs: JobQueue) -> None:
        """Update every sub-group ``jobs`` yields, read ahead and written behind.

        [Note: one pipeline across submissions]
        Sub-group k + 1 is read while k is updated and k - 1 written, and the pipeline does not
        drain between jobs: the worker's jobs are single modules, a sub-group or two each, and
        draining after each leaves the disk idle through every update and every digest of the
        writes, a large part of the step's tail after backward with the state on NVMe; one
        pipeline shortens that tail and the step (measured:
        bench/results/2026-11-22-intel-amx-bf16-training-update-pipeline.md). Only when no job
        is queued does it wait for all of its writes, so a job is done, and ``wait()``
        returns, once its bytes are on disk. A failed sub-group fails its job; the pipeline goes
        on with the others.
        """
        count = self._slot_count
        staged = self._kernel.slots()
        slots: list[StagingSlot | None] = list(staged) if staged else [None] * count
        owners: list[InFlight | None] = [None] * count  # whose writes may still use a slot
        turn = 0
        ahead: InFlight | None = None

        def start(item: Item) -> InFlight | None:
            nonlocal turn
            job, chunk, last = item
            work = InFlight(chunk, job=job, last=last, turn=turn)
            slot = turn % count
            turn += 1
            settle(owners[slot])
            owners[slot] = None
            try:
                with record_function(OPTIM_READ):
                    self._kernel.stage_in(work, slots[slot])
            except BaseException as e:  # noqa: BLE001 - fails the job, after its reads end
                settle(work, e)
                return None
            return work

        try:
            while True:
                if ahead is None:
                    item = jobs.next(block=False)
                    if item is None:  # idle: let every write land so waiters see their jobs done
                        for slot in range(count):
                            settle(owners[slot])
                            owners[slot] = None
                        item = jobs.next(block=True)
                        if item is None:
                            return
                    ahead = start(item)
                    continue
                work, ahead = ahead, None
                item = jobs.next(block=False)
                if item is not None:
                    ahead = start(item)
                try:
                    with record_function(OPTIM_READ):
                        work.wait()  # its reads
                    if work.job.error is None:
                        with record_function(OPTIM_UPDATE):
                            self._kernel.apply(work, work.job.hp)
                            if work.last:
                                self._kernel.finished(work.job)
                        with record_function(OPTIM_WRITE):
                            self._kernel.stage_out(work)
                except BaseException as e:  # noqa: BLE001 - fails the job, after its writes end
                    settle(work, e)
                    continue
                if work.pending:  # its writes land behind the next sub-groups' updates
                    owners[work.turn % count] = work
                else:  # nothing written behind (state in memory): done now, so a fetch that
                    settle(work)  # waits for it does not wait for the updates after it too
        finally:
            for left in (ahead, *owners):
                settle(left)
