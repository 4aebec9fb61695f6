"""``UpdatePipeline`` on its own, over a fake ``Kernel`` that records every call: submitted jobs
run in order on the ``outcore-optim`` worker, sub-group k + 1 is read before k is written
(across jobs too: pipeline.py's [Note: one pipeline across submissions]), a failing sub-group
fails only its job and ``wait()`` raises the first job's error once all are done,
``after_step()`` reverses the jobs not yet started, ``pending_grad_limit`` makes ``submit``
wait for the oldest job, and ``close()`` stops the worker.

(tests/unit/optim/test_pipeline.py tests the same object through an engine with its state on
NVMe.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, cast

import pytest

from outcore.optim.pipeline import InFlight, UpdateJob, UpdatePipeline
from outcore.optim.staging import ShardSlice, StagingSlot
from outcore.zero.param import ShardedParam

WORKER = "outcore-optim"
NO_LIMIT = 1 << 40


def _sp(name: str, group: int = 0) -> ShardedParam:
    """A stand-in parameter: the pipeline only passes it to the kernel (and reads its group's
    index in ``unfinished_by_group``)."""
    return cast(ShardedParam, SimpleNamespace(name=name, group=SimpleNamespace(index=group)))


def _job(*names: str, group: int = 0, background: bool = True) -> UpdateJob:
    return UpdateJob(group=group, hp={"lr": 0.1}, sps=[_sp(n) for n in names],
                     background=background)


class FakeKernel:
    """Cuts a job into one sub-group per parameter and logs ``(call, name, thread)``; a name
    in ``fail_in``/``fail_apply`` makes that call raise, one in ``block`` makes ``apply``
    wait for ``release`` (after setting ``entered``)."""

    def __init__(self, fail_in: tuple[str, ...] = (), fail_apply: tuple[str, ...] = (),
                 block: tuple[str, ...] = (), slots: list[Any] | None = None,
                 writes: dict[str, Future[None]] | None = None) -> None:
        self.log: list[tuple[str, str, str]] = []
        self.slots_seen: list[tuple[str, Any]] = []
        self.fail_in, self.fail_apply, self.block = fail_in, fail_apply, block
        self._slots = slots
        self.writes = writes or {}
        self.entered = threading.Event()
        self.release = threading.Event()

    def _note(self, call: str, name: str) -> None:
        self.log.append((call, name, threading.current_thread().name))

    @staticmethod
    def _name(work: InFlight) -> str:
        return "+".join(cast(Any, s.sp).name for s in work.params) or "-"

    def calls(self, *kinds: str) -> list[tuple[str, str]]:
        return [(c, n) for c, n, _ in self.log if not kinds or c in kinds]

    def subgroups(self, sps: list[ShardedParam]) -> Iterator[list[ShardSlice]]:
        for sp in sps:
            yield [ShardSlice(sp, 0, 1)]

    def slots(self) -> list[StagingSlot] | None:
        return self._slots

    def stage_in(self, work: InFlight, slot: StagingSlot | None) -> None:
        name = self._name(work)
        self._note("in", name)
        self.slots_seen.append((name, slot))
        if name in self.fail_in:
            raise OSError(f"read of {name} failed")

    def apply(self, work: InFlight, hp: dict[str, Any]) -> None:
        name = self._name(work)
        self._note("apply", name)
        if name in self.block:
            self.entered.set()
            assert self.release.wait(10)
        if name in self.fail_apply:
            raise ValueError(f"update of {name} failed")

    def stage_out(self, work: InFlight) -> None:
        name = self._name(work)
        self._note("out", name)
        if name in self.writes:
            work.pending.append(self.writes[name])

    def finished(self, job: UpdateJob) -> None:
        self._note("finished", "+".join(cast(Any, sp).name for sp in job.sps) or "-")


def _workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == WORKER}


def _pipeline(kernel: FakeKernel, limit: int = NO_LIMIT, slots: int = 3) -> UpdatePipeline:
    return UpdatePipeline(kernel, slot_count=slots, pending_grad_limit=limit,
                          single_threaded_worker=False)


def test_submitted_jobs_run_in_order_on_the_worker_thread() -> None:
    kernel = FakeKernel()
    pipe = _pipeline(kernel)
    jobs = [_job(f"p{i}") for i in range(4)]
    for job in jobs:
        pipe.submit(job, 0)
    pipe.wait()
    assert all(job.done.done() and job.done.exception() is None for job in jobs)
    assert kernel.calls("apply") == [("apply", f"p{i}") for i in range(4)]
    assert kernel.calls("finished") == [("finished", f"p{i}") for i in range(4)]
    assert {thread for _, _, thread in kernel.log} == {WORKER}
    assert pipe.pending == []


def test_a_job_is_finished_after_its_last_sub_group_is_applied() -> None:
    kernel = FakeKernel()
    pipe = _pipeline(kernel)
    pipe.submit(_job("a", "b", "c"), 0)
    pipe.wait()
    applies = kernel.calls("apply", "finished")
    assert applies == [("apply", "a"), ("apply", "b"), ("apply", "c"), ("finished", "a+b+c")]


def test_the_next_sub_group_is_read_before_the_last_one_is_written() -> None:
    kernel = FakeKernel()
    pipe = _pipeline(kernel)
    pipe.run_now([_job("a", "b", "c")])
    assert kernel.calls("in", "apply", "out") == [
        ("in", "a"), ("in", "b"), ("apply", "a"), ("out", "a"),
        ("in", "c"), ("apply", "b"), ("out", "b"),
        ("apply", "c"), ("out", "c"),
    ]


def test_read_ahead_crosses_jobs_without_draining() -> None:
    kernel = FakeKernel()
    pipe = _pipeline(kernel)
    pipe.run_now([_job("a", "b"), _job("c", "d")])
    order = kernel.calls("in", "out")
    for k, nxt in zip("abc", "bcd", strict=True):
        assert order.index(("in", nxt)) < order.index(("out", k)), (k, order)


def test_run_now_runs_on_the_callers_thread() -> None:
    before = _workers()
    kernel = FakeKernel()
    _pipeline(kernel).run_now([_job("a"), _job("b")])
    assert {thread for _, _, thread in kernel.log} == {threading.current_thread().name}
    assert _workers() <= before  # no worker started
    assert kernel.calls("finished") == [("finished", "a"), ("finished", "b")]


def test_staging_slots_are_used_in_turn() -> None:
    slots = ["slot0", "slot1", "slot2"]
    kernel = FakeKernel(slots=slots)
    _pipeline(kernel, slots=3).run_now([_job("a", "b", "c", "d", "e")])
    assert kernel.slots_seen == [("a", "slot0"), ("b", "slot1"), ("c", "slot2"),
                                 ("d", "slot0"), ("e", "slot1")]


def test_without_staging_slots_the_kernel_gets_none() -> None:
    kernel = FakeKernel(slots=None)
    _pipeline(kernel, slots=2).run_now([_job("a", "b")])
    assert [slot for _, slot in kernel.slots_seen] == [None, None]


def test_a_job_is_done_only_once_its_writes_have_landed() -> None:
    write: Future[None] = Future()
    kernel = FakeKernel(writes={"a": write})
    pipe = _pipeline(kernel)
    job = _job("a")
    pipe.submit(job, 0)
    time.sleep(0.05)
    assert kernel.calls("out") == [("out", "a")]
    assert not job.done.done()
    write.set_result(None)
    pipe.wait()
    assert job.done.done() and job.done.exception() is None


def test_a_job_with_nothing_to_write_is_done_before_the_next_is_applied() -> None:
    """State in memory writes nothing behind: a fetch waiting for the first job's update
    (group.py's ``await_update``) must not wait for the update after it as well."""
    kernel = FakeKernel(block=("b",))
    pipe = _pipeline(kernel)
    first, second = _job("a"), _job("b")
    pipe.submit(first, 0)
    pipe.submit(second, 0)
    assert kernel.entered.wait(10)  # b's update is under way, and held there
    try:
        first.done.result(timeout=10)
        assert not second.done.done()
    finally:
        kernel.release.set()
    pipe.wait()


def test_a_failed_write_fails_its_job() -> None:
    write: Future[None] = Future()
    write.set_exception(OSError("disk full"))
    kernel = FakeKernel(writes={"a": write})
    pipe = _pipeline(kernel)
    job = _job("a")
    pipe.submit(job, 0)
    with pytest.raises(OSError, match="disk full"):
        pipe.wait()
    assert isinstance(job.done.exception(), OSError)


def test_a_job_without_sub_groups_still_completes() -> None:
    kernel = FakeKernel()
    pipe = _pipeline(kernel)
    job = _job()
    pipe.submit(job, 0)
    pipe.wait()
    assert job.done.done() and job.done.exception() is None
    assert kernel.calls("finished") == [("finished", "-")]


def test_wait_raises_the_first_jobs_error_after_all_have_finished() -> None:
    kernel = FakeKernel(fail_apply=("b", "c"))
    pipe = _pipeline(kernel)
    jobs = [_job("a"), _job("b"), _job("c"), _job("d")]
    for job in jobs:
        pipe.submit(job, 0)
    with pytest.raises(ValueError, match="update of b failed"):
        pipe.wait()
    assert all(job.done.done() for job in jobs)
    assert jobs[0].done.exception() is None and jobs[3].done.exception() is None
    assert str(jobs[2].done.exception()) == "update of c failed"
    assert ("apply", "d") in kernel.calls()  # the pipeline went on after the failures
    assert kernel.calls("finished") == [("finished", "a"), ("finished", "d")]
    assert pipe.pending == []


def test_a_failing_sub_group_fails_only_its_job() -> None:
    kernel = FakeKernel(fail_in=("b2",))
    pipe = _pipeline(kernel)
    ok_before, bad, ok_after = _job("a1", "a2"), _job("b1", "b2", "b3"), _job("c1", "c2")
    for job in (ok_before, bad, ok_after):
        pipe.submit(job, 0)
    with pytest.raises(OSError, match="read of b2 failed"):
        pipe.wait()
    assert ok_before.done.exception() is None and ok_after.done.exception() is None
    assert isinstance(bad.done.exception(), OSError)
    applied = [n for c, n in kernel.calls("apply")]
    assert {"a1", "a2", "c1", "c2"} <= set(applied)
    assert "b2" not in applied and "b3" not in applied
    assert ("finished", "b1+b2+b3") not in kernel.calls()
    assert kernel.calls("finished") == [("finished", "a1+a2"), ("finished", "c1+c2")]


def test_run_now_raises_the_first_error_once_every_job_is_done() -> None:
    kernel = FakeKernel(fail_apply=("a",))
    jobs = [_job("a"), _job("b")]
    with pytest.raises(ValueError, match="update of a failed"):
        _pipeline(kernel).run_now(jobs)
    assert jobs[1].done.done() and jobs[1].done.exception() is None


def test_after_step_reverses_the_jobs_not_yet_started() -> None:
    kernel = FakeKernel(block=("first",))
    pipe = _pipeline(kernel)
    first = _job("first")
    pipe.submit(first, 0)
    assert kernel.entered.wait(10)  # the worker is inside first's update, with nothing queued
    later = [_job(f"j{i}") for i in range(1, 4)]
    for job in later:
        pipe.submit(job, 0)
    running = pipe.after_step()
    assert running == [first, *later]  # still running: handed back
    kernel.release.set()
    pipe.wait()
    assert [n for _, n in kernel.calls("apply")] == ["first", "j3", "j2", "j1"]


def test_after_step_drops_finished_jobs_and_raises_a_finished_jobs_error() -> None:
    kernel = FakeKernel(fail_apply=("bad",))
    pipe = _pipeline(kernel)
    good = _job("good")
    pipe.submit(good, 0)
    good.done.result(timeout=10)
    assert pipe.after_step() == []
    bad = _job("bad")
    pipe.submit(bad, 0)
    assert bad.done.exception(timeout=10) is not None
    with pytest.raises(ValueError, match="update of bad failed"):
        pipe.after_step()
    pipe.close()


def test_after_step_with_nothing_submitted_stops_the_worker() -> None:
    before = _workers()
    pipe = _pipeline(FakeKernel())
    job = _job("a")
    pipe.submit(job, 0)
    pipe.wait()
    assert pipe.after_step() == []
    assert _workers() <= before


def test_submit_waits_for_the_oldest_job_when_pending_gradients_pass_the_limit() -> None:
    kernel = FakeKernel(block=("old",))
    pipe = _pipeline(kernel, limit=100)
    old, young = _job("old"), _job("young")
    pipe.submit(old, 60)
    assert kernel.entered.wait(10)
    submitted = threading.Event()

    def submit_young() -> None:
        pipe.submit(young, 60)  # 60 + 60 > 100: waits for ``old``
        submitted.set()

    t = threading.Thread(target=submit_young)
    t.start()
    assert not submitted.wait(0.2)
    assert not old.done.done()
    kernel.release.set()
    assert submitted.wait(10)
    t.join()
    assert old.done.done()
    assert pipe.pending == [young]  # the oldest was waited for and forgotten
    pipe.wait()


def test_a_job_waited_for_that_failed_does_not_drop_the_next() -> None:
    """Waiting for room behind a job that failed queues the new job all the same; the
    failure is raised by ``wait()``, once the new job is done too."""
    kernel = FakeKernel(fail_apply=("old",))
    pipe = _pipeline(kernel, limit=100)
    old, young = _job("old"), _job("young")
    pipe.submit(old, 60)
    assert isinstance(old.done.exception(timeout=10), Exception)
    pipe.submit(young, 60)  # 60 + 60 > 100: waits for ``old``, which failed
    assert young in pipe.pending
    with pytest.raises(Exception, match="old"):
        pipe.wait()
    assert young.done.done() and young.done.exception() is None
    assert ("apply", "young") in kernel.calls("apply")


def test_submit_does_not_wait_while_pending_gradients_fit() -> None:
    kernel = FakeKernel(block=("a",))
    pipe = _pipeline(kernel, limit=100)
    a, b = _job("a"), _job("b")
    pipe.submit(a, 50)
    assert kernel.entered.wait(10)
    pipe.submit(b, 50)  # 100 fits: returns while ``a`` still runs
    assert not a.done.done()
    assert pipe.pending == [a, b]
    kernel.release.set()
    pipe.wait()
    assert b.done.exception() is None


def test_wait_stops_the_worker_and_the_next_submit_starts_one() -> None:
    before = _workers()
    kernel = FakeKernel()
    pipe = _pipeline(kernel)
    pipe.submit(_job("a"), 0)
    assert len(_workers() - before) == 1
    pipe.wait()
    assert _workers() <= before
    pipe.submit(_job("b"), 0)
    pipe.wait()
    assert _workers() <= before
    assert kernel.calls("finished") == [("finished", "a"), ("finished", "b")]


def test_close_stops_the_worker_thread() -> None:
    before = _workers()
    kernel = FakeKernel()
    pipe = _pipeline(kernel)
    job = _job("a")
    pipe.submit(job, 0)
    job.done.result(timeout=10)
    assert len(_workers() - before) == 1
    pipe.close()
    assert _workers() <= before
    assert pipe.pending == []


def test_unfinished_by_group_lists_each_groups_jobs_once() -> None:
    one = UpdateJob(group=0, hp={}, sps=[_sp("w0", 0), _sp("w1", 1)], background=True)
    two = UpdateJob(group=0, hp={}, sps=[_sp("w2", 1), _sp("w3", 1)], background=True)
    three = UpdateJob(group=1, hp={}, sps=[_sp("w4", 2)], background=False)
    out = UpdatePipeline.unfinished_by_group([one, two, three])
    assert out == {0: [one.done], 1: [one.done, two.done], 2: [three.done]}
    assert UpdatePipeline.unfinished_by_group([]) == {}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_worker_that_dies_fails_its_jobs_and_refuses_new_ones() -> None:
    """An error outside a job's transfers (here: cutting it into sub-groups) is a bug: the
    worker stops, every job it held fails with the error, and ``submit`` says so."""

    class Broken(FakeKernel):
        def subgroups(self, sps: list[ShardedParam]) -> Iterator[list[ShardSlice]]:
            raise RuntimeError("kernel bug")

    pipe = _pipeline(Broken())
    job = _job("a")
    pipe.submit(job, 0)
    assert isinstance(job.done.exception(timeout=10), RuntimeError)
    assert isinstance(pipe.broken, RuntimeError)
    with pytest.raises(RuntimeError, match="update thread failed"):
        pipe.submit(_job("b"), 0)
    pipe.close()
