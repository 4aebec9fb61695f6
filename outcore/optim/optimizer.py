"""The optimizer step over this rank's fp32 shards, streamed in sub-groups from their tier.

[Note: streamed sub-groups]
With optimizer state in memory, a shard's master weights and moments are resident tensors
and the update runs on them in place. With optimizer state on NVMe they are read into host
memory a sub-group at a time, sized so three sub-groups fit the optimizer's share of
``offload.host_buffer_bytes`` (runtime.py's [Note: one host budget, two users]):
while sub-group k is updated, k+1 is being read and k-1 written back. Both cases run the
same loop; for memory tiers a "read" is simply handing over the resident tensor.

A sub-group is a list of *slices* of parameter shards, not of whole parameters: the update
is elementwise, so a 100M-element embedding shard is streamed in budget-sized pieces like
any other. Slices are cut at multiples of ``ALIGN_ELEMS`` elements so every piece starts on
a 4 KiB boundary of its extent in both the fp32 and the 16-bit files (O_DIRECT needs that).

[Note: torch's own kernels]
The update itself is ``torch.optim.adam.adam`` (AdamW's decoupled weight decay, or Adam's L2)
or ``torch.optim.sgd.sgd`` (fused when the device supports it) over lists of shard tensors, so
the arithmetic is exactly PyTorch's and a parameter group's hyper-parameters (e.g. no weight
decay on biases) apply per parameter.
Parameters that received no gradient in this step are skipped, as torch optimizers skip
parameters whose ``.grad`` is None.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from outcore.config import OptimizerConfig
from outcore.offload.storage import Stored, Tier
from outcore.optim import adafactor
from outcore.optim.work import ALIGN_ELEMS, Feed, Job, Slice, Slot, Work, first_error, settle
from outcore.profiling import OPTIM_READ, OPTIM_UPDATE, OPTIM_WRITE, record_function
from outcore.runtime import Runtime
from outcore.zero.param import ShardedParam


@dataclass(eq=False)
class ParamState:
    """What the optimizer keeps for one parameter shard, as ``torch.optim`` keeps it in
    ``optimizer.state[p]``: its step count and moment tensors (each in the state tier), plus
    the round (optimizer step) that last updated it, so no shard is updated twice a step."""

    moments: dict[str, Stored]
    step: int = 0
    round: int = -1

    def free(self) -> None:
        for stored in self.moments.values():
            stored.free()
        self.moments = {}


class ShardedOptimizer:
    """AdamW or SGD over ShardedParams; ``param_groups`` is editable like torch's (e.g. lr).

    [Note: updating during backward]
    ``submit(params)`` queues an update of parameters whose gradients are final on a worker
    thread, so it runs (and, with state on NVMe, does its reads and writes) while backward
    continues on earlier layers; torch kernels and file I/O release the GIL. ``step()`` waits
    for the queue, or with ``defer`` hands back the jobs still queued (engine.py's [Note: the
    step's tail runs into the next forward]), and updates whatever was not submitted. The
    engine only submits when the update cannot depend on gradients still to come: no
    clipping (the global norm needs every gradient) and no fp16 (an overflow anywhere must
    cancel the whole step). A job's hyper-parameters are copied when it is submitted.
    """

    def __init__(self, groups: list[tuple[dict, list[ShardedParam]]], cfg: OptimizerConfig,
                 rt: Runtime) -> None:
        self.kind = cfg.type
        self.rt = rt
        self.param_groups: list[dict] = []
        self._members: list[list[ShardedParam]] = []
        self._hp_index: dict[int, int] = {}
        for i, (hp, sps) in enumerate(groups):
            self.param_groups.append(hp)
            self._members.append(sps)
            for sp in sps:
                self._hp_index[id(sp)] = i
        plan = rt.plan
        self.state_kinds = plan.state_kinds
        self.adafactor = (adafactor.Runner(self.param_groups, self._members, rt)
                          if self.kind == "adafactor" else None)
        self.state: dict[ShardedParam, ParamState] = {
            sp: ParamState({k: rt.store(torch.zeros(sp.shard_numel, dtype=torch.float32,
                                                    device=rt.device), rt.state_tier, "optimizer")
                            for k in (self.adafactor.kinds_of(sp) if self.adafactor
                                      else self.state_kinds)})
            for sp in self.params}
        # what a slice stages in host memory per element (work.py's [Note: staging without
        # copies]); the plan says which tensors that is
        self._staged_kinds = plan.staged_kinds
        self._cast_dtype = rt.compute_dtype if plan.staged_cast else None
        self._grad_slot = plan.grad_slot
        self._slot_count = plan.staging_slots
        self._stage_elem_bytes = 4 * (len(self._staged_kinds) + self._grad_slot) + (
            rt.compute_dtype.itemsize if plan.staged_cast else 0)
        per_slot = rt.staging_bytes // self._slot_count // max(self._stage_elem_bytes, 1)
        self._subgroup_elems = max(ALIGN_ELEMS, per_slot // ALIGN_ELEMS * ALIGN_ELEMS)
        self._slot_list: list[Slot] = []
        self._fused = rt.device.type in ("cpu", "cuda")
        self._worker: threading.Thread | None = None
        self._feed: Feed | None = None  # what the worker updates, in order
        self._broken: BaseException | None = None  # the worker died of this (a bug)
        self._submitted: list[tuple[Job, int]] = []  # with the gradient bytes each holds
        # gradients waiting for a background update may hold at most this many bytes; the
        # backward that submits more waits for the oldest update (see the note above)
        self.pending_grad_limit = 2 * rt.cfg.offload.host_buffer_bytes
        self._dropped_sq = 0.0  # squared norm of gradients already consumed and freed
        self._round = 0  # optimizer steps taken; see ParamState.round
        self.stats = {"updates_during_backward": 0, "updates_at_step": 0, "updates_after_step": 0}

    @property
    def params(self) -> Iterator[ShardedParam]:
        for sps in self._members:
            yield from sps

    def zero_grad(self, keep: list[Job] = ()) -> None:
        """Drop every gradient except those ``keep``'s updates still read (they free them)."""
        kept = {id(sp) for job in keep for sp in job.sps}
        for sp in self.params:
            if id(sp) not in kept:
                sp.drop_grad()

    def submit(self, sps: list[ShardedParam]) -> None:
        """Update ``sps`` (gradients final) in the background; see the note above."""
        todo = [sp for sp in sps if sp.has_grad and id(sp) in self._hp_index
                and self.state[sp].round != self._round]
        if not todo:
            return
        if self._broken is not None:
            raise RuntimeError("the optimizer's update thread failed") from self._broken
        for sp in todo:
            self.state[sp].round = self._round
        self.stats["updates_during_backward"] += len(todo)
        if self._worker is None:
            self._feed = Feed(self._subgroups)
            self._worker = threading.Thread(target=self._serve, args=(self._feed,),
                                            name="outcore-optim", daemon=True)
            self._worker.start()
        held = sum(n for _, n in self._submitted)
        for i, members in sorted(self._by_group(todo).items()):
            nbytes = sum(sp.grad.nbytes for sp in members)
            while self._submitted and held + nbytes > self.pending_grad_limit:
                oldest, n = self._submitted.pop(0)
                oldest.done.result()
                held -= n
            held += nbytes
            job = Job(i, dict(self.param_groups[i]), members, background=True)
            self._submitted.append((job, nbytes))
            self._feed.jobs.put(job)

    def step(self, defer: bool = False) -> list[Job]:
        """Update every parameter that got a gradient and was not submitted, then end the
        round. Submitted updates are waited for, unless ``defer``: then the unfinished ones
        are returned, re-ordered for the next forward (engine.py's [Note: the step's tail runs
        into the next forward])."""
        rest = [sp for sp in self.params if sp.has_grad and self.state[sp].round != self._round]
        if self.adafactor is not None:  # never submitted during backward (the plan)
            self.adafactor.step(rest, self.state)
            self.stats["updates_at_step"] += len(rest)
            self._round += 1
            return []
        if rest or not defer:  # the rest goes through the worker's three slots: let it finish
            self.wait()
        for sp in rest:
            self.state[sp].round = self._round
        self.stats["updates_at_step"] += len(rest)
        self._round += 1
        if rest:
            # on this thread, with all of torch's threads: nothing else runs now
            feed = Feed(self._subgroups)
            jobs = [Job(i, self.param_groups[i], members, background=False)
                    for i, members in sorted(self._by_group(rest).items())]
            for job in [*jobs, None]:
                feed.jobs.put(job)
            self._pump(feed)
            first_error(job.done for job in jobs)
        if not self._submitted:
            self._retire_worker()
            return []
        first_error(job.done for job, _ in self._submitted if job.done.done())
        self._submitted = [(job, n) for job, n in self._submitted if not job.done.done()]
        self._feed.reverse_queued()
        pending = [job for job, _ in self._submitted]
        self.stats["updates_after_step"] += sum(len(job.sps) for job in pending)
        return pending

    @property
    def updated_this_round(self) -> bool:
        """Whether an update of this round (since the last ``step()``) was submitted."""
        return any(state.round == self._round for state in self.state.values())

    @property
    def pending_jobs(self) -> list[Job]:
        """Submitted updates not yet waited for (they free their own gradients)."""
        return [job for job, _ in self._submitted]

    def wait(self) -> None:
        """Wait for every submitted update; then raise the first error, if any."""
        submitted, self._submitted = self._submitted, []
        try:
            first_error(job.done for job, _ in submitted)
        finally:
            self._retire_worker()

    def _retire_worker(self) -> None:
        """Stop the idle worker (the next submit starts another). A thread waiting for work
        would hold this optimizer, and through its groups the model, alive after the user
        dropped both: its swap files would then outlive them."""
        if self._worker is not None and not self._submitted:
            self._feed.jobs.put(None)
            self._worker.join()
            self._worker = self._feed = None

    def take_freed_norm_sq(self) -> float:
        """Squared L2 norm of the gradients that background updates consumed and freed."""
        sq, self._dropped_sq = self._dropped_sq, 0.0
        return sq

    def step_of(self, sp: ShardedParam) -> int:
        """How many updates ``sp`` has had (AdamW's bias correction counts them)."""
        state = self.state.get(sp)
        return state.step if state is not None else 0

    def restore_step(self, sp: ShardedParam, step: int) -> None:
        """Set ``sp``'s update count from a checkpoint (its moments are loaded in place)."""
        self.state[sp].step = step

    @property
    def members(self) -> list[list[ShardedParam]]:
        """The parameters of each of ``param_groups``, in order."""
        return self._members

    def close(self) -> None:
        """Stop the worker and give back the staging buffers and every moment's storage."""
        self._submitted = []
        self._retire_worker()
        if self._slot_list:  # no update runs any more: give the staging buffers back
            self._slot_list = []
            self.rt.ledger.add(Tier.HOST.value, "io_buffers",
                               -self._slot_count * self._subgroup_elems * self._stage_elem_bytes)
        for state in self.state.values():
            state.free()

    def _by_group(self, sps: list[ShardedParam]) -> dict[int, list[ShardedParam]]:
        by_group: dict[int, list[ShardedParam]] = {}
        for sp in sps:
            by_group.setdefault(self._hp_index[id(sp)], []).append(sp)
        return by_group

    def _serve(self, feed: Feed) -> None:
        """The worker thread: updates submitted jobs until ``close()``."""
        if self.rt.device.type == "cpu":
            # backward already runs torch's intra-op threads on every core; one more thread
            # for the update competes less than a second team of them would
            torch.set_num_threads(1)
        try:
            self._pump(feed)
        except BaseException as e:  # a bug, not an I/O error (those fail their own job)
            self._broken = e
            for job, _ in list(self._submitted):
                job.fail(e)
            raise

    def _pump(self, feed: Feed) -> None:
        """Update every sub-group ``feed`` yields, read ahead and written behind.

        [Note: one pipeline across submissions]
        Sub-group k + 1 is read while k is updated and k - 1 written, and the pipeline does not
        drain between jobs: the worker's jobs are single modules, a sub-group or two each, and
        draining after each leaves the disk idle through every update and every digest of the
        writes, a large part of the step's tail after backward with the state on NVMe; one
        pipeline shortens that tail and the step (measured: bench/RESULTS.md, 'update
        pipeline'). Only when no job is queued does it wait for all of its writes, so a job is done,
        and ``wait()`` returns, once its bytes are on disk. A failed sub-group fails its job;
        the pipeline goes on with the others.
        """
        count = self._slot_count
        slots: list[Slot | None] = self._slots() if self._stages else [None] * count
        owners: list[Work | None] = [None] * count  # whose writes may still use a slot
        turn = 0
        ahead: Work | None = None

        def start(item: tuple[Job, list[Slice], bool]) -> Work | None:
            nonlocal turn
            job, chunk, last = item
            work = Work(chunk, job=job, last=last, turn=turn)
            slot = turn % count
            turn += 1
            settle(owners[slot])
            owners[slot] = None
            try:
                with record_function(OPTIM_READ):
                    self._load(work, slots[slot])
            except BaseException as e:  # noqa: BLE001 - fails the job, after its reads end
                settle(work, e)
                return None
            return work

        try:
            while True:
                if ahead is None:
                    item = feed.next(block=False)
                    if item is None:  # idle: let every write land so waiters see their jobs done
                        for slot in range(count):
                            settle(owners[slot])
                            owners[slot] = None
                        item = feed.next(block=True)
                        if item is None:
                            return
                    ahead = start(item)
                    continue
                work, ahead = ahead, None
                item = feed.next(block=False)
                if item is not None:
                    ahead = start(item)
                try:
                    with record_function(OPTIM_READ):
                        work.wait()  # its reads
                    if work.job.error is None:
                        with record_function(OPTIM_UPDATE):
                            self._update(work, work.job.hp)
                            if work.last:
                                self._updated(work.job)
                        with record_function(OPTIM_WRITE):
                            self._store(work)
                except BaseException as e:  # noqa: BLE001 - fails the job, after its writes end
                    settle(work, e)
                    continue
                owners[work.turn % count] = work
        finally:
            for work in (ahead, *owners):
                settle(work)

    def _updated(self, job: Job) -> None:
        """Every sub-group of ``job`` was updated: count its step, free background gradients."""
        for sp in job.sps:
            self.state[sp].step += 1
        if not job.background:
            return
        if self.rt.cfg.track_grad_norm:  # the sum is only read by Engine._global_norm
            norms = torch._foreach_norm([sp.grad for sp in job.sps], 2, dtype=torch.float32)
            self._dropped_sq += float(torch.stack(norms).double().pow(2).sum())
        for sp in job.sps:
            sp.drop_grad()

    @property
    def _stages(self) -> bool:
        """Whether updates stream through host buffers (some state they touch is on NVMe)."""
        return self._stage_elem_bytes > 0

    def _slots(self) -> list[Slot]:
        if not self._slot_list:
            elems = self._subgroup_elems
            kinds = (*self._staged_kinds, "grad") if self._grad_slot else self._staged_kinds
            self._slot_list = [Slot(elems, kinds, self._cast_dtype)
                               for _ in range(self._slot_count)]
            self.rt.ledger.add(Tier.HOST.value, "io_buffers",
                               self._slot_count * elems * self._stage_elem_bytes)
        return self._slot_list

    def _subgroups(self, sps: list[ShardedParam]) -> Iterator[list[Slice]]:
        if not self._stages:
            if sps:
                yield [Slice(sp, 0, sp.shard_numel) for sp in sps]
            return
        limit = self._subgroup_elems
        chunk: list[Slice] = []
        room = limit
        for sp in sps:
            lo = 0
            while lo < sp.shard_numel:
                hi = min(sp.shard_numel, lo + room)
                chunk.append(Slice(sp, lo, hi))
                room -= hi - lo
                lo = hi
                if room < ALIGN_ELEMS:
                    yield chunk
                    chunk, room = [], limit
                else:  # keep the next slice of any parameter aligned
                    room -= room % ALIGN_ELEMS
        if chunk:
            yield chunk

    def _load(self, work: Work, slot: Slot | None) -> None:
        """Start reading a sub-group; each slice gets an aligned place in ``slot``'s buffers
        (see work.py's [Note: staging without copies]) unless its state is resident."""
        work.states, work.slot = {k: [] for k in self.state_kinds}, slot
        pos = 0
        for sl in work.params:
            sp, n = sl.sp, sl.hi - sl.lo
            for kind, dst, stored in [("master", work.master, sp.master)] + [
                (k, work.states[k], self.state[sp].moments[k]) for k in self.state_kinds
            ]:
                t = stored.resident()
                if t is None:
                    assert slot is not None
                    t = slot.buffers[kind][pos : pos + n]
                    work.pending.append(stored.load_range(sl.lo, t))
                else:
                    t = sl.of(t)
                dst.append(t)
            work.places.append(pos)
            pos += -(-n // ALIGN_ELEMS) * ALIGN_ELEMS

    def _update(self, work: Work, hp: dict) -> None:
        if not work.params:
            return
        grads = [self._fp32_grad(work, i, sl) for i, sl in enumerate(work.params)]
        if self.kind in ("adamw", "adam"):
            # each slice gets its own copy of the parameter's step count: the kernel
            # increments it, and a parameter cut in several slices must advance only once
            steps = [torch.tensor(float(self.state[sl.sp].step), dtype=torch.float32)
                     for sl in work.params]
            adam(
                work.master, grads, work.states["exp_avg"], work.states["exp_avg_sq"], [], steps,
                fused=self._fused, foreach=False if self._fused else None, amsgrad=False,
                decoupled_weight_decay=self.kind == "adamw",
                beta1=hp["betas"][0], beta2=hp["betas"][1], lr=hp["lr"],
                weight_decay=hp["weight_decay"], eps=hp["eps"], maximize=False,
            )
        else:
            bufs = work.states.get("momentum_buffer") or [None] * len(grads)
            sgd(
                work.master, grads, bufs, weight_decay=hp["weight_decay"],
                momentum=hp["momentum"], lr=hp["lr"], dampening=0.0, nesterov=hp["nesterov"],
                maximize=False,
            )

    @staticmethod
    def _fp32_grad(work: Work, i: int, sl: Slice) -> torch.Tensor:
        """Slice ``i``'s gradient in fp32: the shard itself, or its cast into the slot's
        reused buffer when it is held in the training dtype."""
        grad = sl.of(sl.sp.grad)
        if grad.dtype == torch.float32:
            return grad
        if work.slot is None or "grad" not in work.slot.buffers:
            return grad.float()
        pos = work.places[i]
        return work.slot.buffers["grad"][pos : pos + grad.numel()].copy_(grad)

    def _store(self, work: Work) -> None:
        """Write back what lives on disk and refresh each compute shard from its master."""
        for i, sl in enumerate(work.params):
            sp = sl.sp
            if sp.master.resident() is None:
                work.pending.append(sp.master.save_range(sl.lo, work.master[i]))
                for k in self.state_kinds:
                    work.pending.append(
                        self.state[sp].moments[k].save_range(sl.lo, work.states[k][i]))
            if sp.compute is sp.master:
                continue
            resident = sp.compute.resident()
            if resident is not None:  # copy_ casts in one pass, no temporary
                sl.of(resident).copy_(work.master[i])
            else:
                pos, n = work.places[i], sl.hi - sl.lo
                cast = work.slot.cast[pos : pos + n]
                cast.copy_(work.master[i])
                work.pending.append(sp.compute.save_range(sl.lo, cast))
