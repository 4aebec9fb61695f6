"""The optimizer step over this rank's fp32 shards, streamed in sub-groups from their tier.

[Note: streamed sub-groups]
With optimizer state in memory, a shard's master weights and moments are resident tensors
and the update runs on them in place. With optimizer state on NVMe they are read into host
memory a sub-group at a time, sized so three sub-groups fit the optimizer's share of
``offload.host_buffer_bytes`` (runtime/context.py's [Note: one host budget, two users]):
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

import shutil
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from outcore.config import OptimizerConfig
from outcore.guard.memory import available_memory
from outcore.offload.ledger import Kind
from outcore.offload.storage import CastShard, StoredShard
from outcore.offload.tier import Tier
from outcore.optim import adafactor
from outcore.optim.hyperparams import HyperParamWatch, frozen
from outcore.optim.param_groups import check_momentum_kept
from outcore.optim.pipeline import InFlight, UpdateJob, UpdatePipeline
from outcore.optim.speculation import (
    ParamState,
    keep_tentative,
    release_asides,
    reserve_asides,
    take_back,
    written,
)
from outcore.optim.staging import (
    ALIGN_ELEMS,
    ShardSlice,
    StagingSlot,
    cut_subgroups,
    fp32_grad,
    global_norm,
    step_counts,
)
from outcore.optim.zero_filled import ZeroFilledGrads
from outcore.runtime import Runtime
from outcore.zero.param import ShardedParam


class ShardedOptimizer:
    """AdamW or SGD over ShardedParams; ``param_groups`` is editable like torch's (e.g. lr).

    [Note: updating during backward]
    ``submit(params)`` queues an update of parameters whose gradients are final on a worker
    thread, so it runs (and, with state on NVMe, does its reads and writes) while backward
    continues on earlier layers; torch kernels and file I/O release the GIL. ``step()`` waits
    for the queue, or with ``defer`` hands back the jobs still queued (pipeline.py's [Note: the
    step's tail runs into the next forward]), and updates whatever was not submitted. The
    engine only submits when the update cannot depend on gradients still to come, no fp16 (an
    overflow anywhere must cancel the whole step) and no clipping (the global norm needs every
    gradient), unless the update is tentative (speculation.py's [Note: a speculative step]).
    A job's hyper-parameters are copied, tensors too, when it is submitted (hyperparams.py).
    """

    def __init__(self, groups: list[tuple[dict[str, Any], list[ShardedParam]]],
                 cfg: OptimizerConfig, rt: Runtime) -> None:
        self.kind = cfg.type
        self.rt = rt
        self.param_groups: list[dict[str, Any]] = []
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
            sp: ParamState({k: self._zeros_state(sp)
                            for k in (self.adafactor.kinds_of(sp) if self.adafactor
                                      else self.state_kinds)})
            for sp in self.params}
        # what a slice stages in host memory per element (staging.py's [Note: staging without
        # copies]); the plan says which tensors that is
        self._staged_kinds = plan.staged_kinds
        self._cast_dtype = rt.compute_dtype if plan.staged_cast else None
        self._grad_slot = plan.grad_slot
        self._slot_count = plan.staging_slots
        self._stage_elem_bytes = 4 * (len(self._staged_kinds) + self._grad_slot) + (
            rt.compute_dtype.itemsize if plan.staged_cast else 0)
        per_slot = rt.staging_bytes // self._slot_count // max(self._stage_elem_bytes, 1)
        self._subgroup_elems = max(ALIGN_ELEMS, per_slot // ALIGN_ELEMS * ALIGN_ELEMS)
        self._slot_list: list[StagingSlot] = []
        self._staging = rt.ledger.charge(Tier.HOST, Kind.IO_BUFFERS)  # the slots' bytes
        self._fused = rt.device.type in ("cpu", "cuda")
        # everything that runs an update off the critical path (pipeline.py's note), paced where
        # updates free gradients (pipeline.py's [Note: paced only where updates free gradients])
        limit = None if plan.keeps_grad_buffers else 2 * rt.cfg.offload.host_buffer_bytes
        self.pipeline = UpdatePipeline(self, self._slot_count, pending_grad_limit=limit,
                                       single_threaded_worker=rt.device.type == "cpu")
        self._dropped_sq = 0.0  # squared norm of gradients already consumed and freed
        # speculation.py's [Note: a speculative step]: whether it is on, whether the last
        # step's gradients fitted the clipping norm, and whether the room for tentative writes
        # was made (None: not yet tried)
        self._speculates = plan.speculates
        self._fits = False  # speculation starts after a step that needed no clipping
        self._asides: bool | None = None
        self._tentative = False  # some update of this round is tentative
        self._round = 0  # optimizer steps taken; see ParamState.round
        self.hyperparams = HyperParamWatch()  # hyperparams.py's note
        self.zero_filled = ZeroFilledGrads()  # zero_filled.py's note
        self.stats = {"updates_during_backward": 0, "updates_at_step": 0, "updates_after_step": 0,
                      "tentative_kept": 0, "tentative_redone": 0, "tentative_dropped": 0}

    @property
    def params(self) -> Iterator[ShardedParam]:
        for sps in self._members:
            yield from sps

    def zero_grad(self, keep: Iterable[UpdateJob] = ()) -> None:
        """Drop every gradient except those ``keep``'s updates still read (they free them);
        tentative updates of this round are taken back first (speculation.py's note)."""
        if self._tentative:
            self.abandon()
            keep = ()  # every update has finished, and a tentative one keeps its gradients
        kept = {id(sp) for job in keep for sp in job.sps}
        for sp in self.params:
            if id(sp) not in kept:
                sp.drop_grad()

    def submit(self, sps: list[ShardedParam], unseen: int = 0, grad_scale: float = 1.0) -> None:
        """Update ``sps`` in the background (note above); ``unseen``: hooks.unseen_grad_bytes;
        ``grad_scale``: the reciprocal of fp16's loss scale (1 without), for tentative ones."""
        todo = [sp for sp in sps if sp.has_grad and id(sp) in self._hp_index
                and self.state[sp].round != self._round]
        if not todo:
            return
        if self.pipeline.broken is not None:
            raise RuntimeError("the optimizer's update thread failed") from self.pipeline.broken
        tentative = self._tentative = self._speculates
        for sp in todo:
            self.state[sp].round = self._round
            self.state[sp].tentative = tentative
        self.stats["updates_during_backward"] += len(todo)
        for i, members in sorted(self._by_group(todo).items()):
            job = UpdateJob(i, frozen(self.param_groups[i]), members, background=True,
                            tentative=tentative, grad_scale=grad_scale)
            grad_bytes = 0
            for sp in members:
                assert sp.grad is not None  # ``todo`` holds only parameters with a gradient
                grad_bytes += sp.grad.nbytes
            # a tentative update keeps its gradients for step(), but the limit still paces
            # backward to the updates, as without speculation
            self.pipeline.submit(job, grad_bytes, unseen)

    @property
    def submits(self) -> bool:
        """Whether a boundary backward may hand updates to ``submit`` now: always without
        speculation; with it, once the last step's gradients fitted the clipping norm (never
        in the first step) and while the room for tentative writes is there
        (speculation.py's [Note: a speculative step]); never once hyper-parameters moved
        between backward and ``step()`` (hyperparams.py's note)."""
        if self.hyperparams.late:  # for the rest of the run: the room for tentative writes
            if self._asides:       # goes back to the disk
                self._asides = False
                release_asides(self.params, self.state)
            return False
        if not self._speculates:
            return True
        if not self._fits:
            return False
        if self._asides is None:
            self._asides = reserve_asides(
                [stored for sp in self.params for stored in written(sp, self.state[sp])],
                shutil.disk_usage(self.rt.nvme.folder).free)
        return self._asides

    def conclude(self, fits: bool) -> None:
        """At ``step()``, with every update of this backward finished and the gradients' norm
        known: keep the tentative updates if ``fits`` (the clipping left the gradients as
        they were), else take them back so the step redoes them with clipped gradients
        (speculation.py's [Note: a speculative step]).
        """
        self._fits = fits
        if fits:
            self.stats["tentative_kept"] += keep_tentative(self.state)
            self._tentative = False
        else:
            self._take_back()

    def skip(self) -> None:
        """An fp16 overflow skips the step: every update of this backward was tentative
        (nothing else submits with loss scaling), so all are dropped with the training
        copies they overwrote, every gradient goes, and speculation waits for a step that
        fits again (speculation.py's [Note: a speculative step])."""
        self._fits = False
        self.wait()
        self._take_back(restore_copies=True, counted="tentative_dropped")
        self.zero_grad()

    def take_back_tentative(self) -> None:
        """Before a write of values between backward and ``step()`` (a user's, a load): the
        tentative updates were computed from the values it replaces, so they are taken back
        and ``step()`` updates every parameter from the written values, as torch's optimizer
        would."""
        if self._tentative:
            self.abandon()

    def abandon(self) -> list[ShardedParam]:
        """Wait for every submitted update and take back the tentative ones, restoring the
        training copies in memory they overwrote (``zero_grad()`` or a write of values came
        before ``step()``); returns the parameters taken back."""
        try:
            self.wait()
        finally:
            taken = self._take_back(restore_copies=True)
        return taken

    def abandon_backward(self) -> None:
        """A boundary backward failed: wait for its updates, and take back the tentative
        ones with the gradients they kept, which hold this failed backward's share (its retry
        computes them again). The other updates stay applied (engine/core.py's [Note: a failed
        boundary backward])."""
        for sp in self.abandon():
            sp.drop_grad()

    def _take_back(self, restore_copies: bool = False,
                   counted: str = "tentative_redone") -> list[ShardedParam]:
        """Forget this round's tentative updates (speculation.py's ``take_back``), to be redone
        at ``step()`` (or dropped with a skipped one: ``counted``); returns the parameters
        taken back."""
        taken = take_back(self.state, restore_copies)
        self.stats[counted] += len(taken)
        self._tentative = False
        return taken

    def step(self, defer: bool = False, grad_scale: float = 1.0) -> list[UpdateJob]:
        """Update every parameter that got a gradient and was not submitted, then end the round;
        ``grad_scale`` (clipping's coefficient) scales each gradient as its update reads it
        (staging.py's [Note: the gradient an update reads]). Submitted updates are waited for,
        unless ``defer``: the unfinished ones are returned in the next forward's order."""
        self.rt.sample_working_set()  # gradients not yet consumed are alive now
        self.zero_filled.fill(self.params, lambda sp: self.state[sp].round == self._round,
                              self.rt.grad_device)
        rest = [sp for sp in self.params if sp.has_grad and self.state[sp].round != self._round]
        if self.adafactor is not None:  # never submitted during backward (the plan)
            for sp in rest if grad_scale != 1.0 else ():
                assert sp.grad is not None  # has_grad
                sp.grad = sp.grad.float().mul_(grad_scale)  # a copy if held in 16 bits
            self.adafactor.step(rest, self.state)
            self.stats["updates_at_step"] += len(rest)
            self._end_round()
            return []
        if rest or not defer:  # the rest goes through the worker's three slots: let it finish;
            self.wait()  # a parameter this forward skipped may have had its deferred update
            rest = [sp for sp in rest if sp.has_grad]  # end only now, its old gradient with it
        for sp in rest:
            self.state[sp].round = self._round
        self.stats["updates_at_step"] += len(rest)
        self._end_round()
        if rest:
            self.pipeline.run_now([UpdateJob(i, self.param_groups[i], members, background=False,
                                             grad_scale=grad_scale)
                                   for i, members in sorted(self._by_group(rest).items())])
        pending = self.pipeline.after_step()
        self.stats["updates_after_step"] += sum(len(job.sps) for job in pending)
        return pending

    def _end_round(self) -> None:
        self._round += 1
        if self.rt.working_set is not None:  # the first step: host_memory.py's [Note: reuse
            self.rt.settle_reuse(available_memory().bytes)  # decided by the first step]

    @property
    def updated_this_round(self) -> bool:
        """Whether an update of this round (since the last ``step()``) was applied for good
        (a tentative one can still be taken back)."""
        return any(self._applied(st) for st in self.state.values())

    @property
    def applied_this_round(self) -> list[ShardedParam]:
        """The parameters whose update of this round was applied for good."""
        return [sp for sp, st in self.state.items() if self._applied(st)]

    def _applied(self, st: ParamState) -> bool:
        return st.round == self._round and not st.tentative

    @property
    def pending_jobs(self) -> list[UpdateJob]:
        """Submitted updates not yet waited for (they free their own gradients)."""
        return self.pipeline.pending

    def wait(self) -> None:
        """Wait for every submitted update; then raise the first error, if any."""
        self.pipeline.wait()

    def global_norm(self, grads: list[torch.Tensor]) -> float:
        """L2 norm over every rank's gradient shards, those background updates freed too."""
        dropped, self._dropped_sq = self._dropped_sq, 0.0
        return global_norm(grads, dropped, self.rt.comm)

    def hyperparams_moved(self) -> bool:
        """At ``step()``: whether ``param_groups`` moved since the boundary backward ended."""
        return self.hyperparams.moved(self.param_groups, self._tentative, lambda: sum(
            s.round == self._round and not s.tentative for s in self.state.values()))

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

    def _zeros_state(self, sp: ShardedParam) -> StoredShard:
        """A fresh optimizer state tensor of ``sp``'s shard, zero, in the state tier."""
        zeros = torch.zeros(sp.shard_numel, dtype=torch.float32, device=self.rt.device)
        return self.rt.store(zeros, self.rt.state_tier, Kind.OPTIMIZER)

    def close(self) -> None:
        """Stop the worker and give back the staging buffers, every moment's storage and the
        room for tentative writes. Tentative updates no step concluded are forgotten with it:
        the masters never showed them, and the model leaves with its masters' values."""
        self.pipeline.close()  # lets the worker finish what it was given
        release_asides(self.params, self.state)
        if self._slot_list:  # no update runs any more: give the staging buffers back
            self._slot_list = []
            self._staging.release()
        for state in self.state.values():
            state.free()

    def _by_group(self, sps: list[ShardedParam]) -> dict[int, list[ShardedParam]]:
        by_group: dict[int, list[ShardedParam]] = {}
        for sp in sps:
            by_group.setdefault(self._hp_index[id(sp)], []).append(sp)
        check_momentum_kept(self.param_groups, self.kind, self.state_kinds)  # every job's way
        return by_group

    # -- the pipeline's kernel (pipeline.py's Kernel) ---------------------------------------------
    def finished(self, job: UpdateJob) -> None:
        """Every sub-group of ``job`` was updated: count its step, free background gradients
        (a tentative job's wait for ``conclude``)."""
        if job.tentative:
            return
        for sp in job.sps:
            self.state[sp].step += 1
        if not job.background:
            return
        if self.rt.cfg.track_grad_norm:  # the sum is only read by global_norm
            grads: list[torch.Tensor] = []
            for sp in job.sps:
                assert sp.grad is not None  # submitted with one, dropped only below
                grads.append(sp.grad)
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            self._dropped_sq += float(torch.stack(norms).double().pow(2).sum())
        for sp in job.sps:
            sp.drop_grad()

    @property
    def _stages(self) -> bool:
        """Whether updates stream through host buffers (some state they touch is on NVMe)."""
        return self._stage_elem_bytes > 0

    def slots(self) -> list[StagingSlot] | None:
        """The staging slots, allocated on first use; None where nothing is staged."""
        if not self._stages:
            return None
        if not self._slot_list:
            elems = self._subgroup_elems
            kinds = (*self._staged_kinds, "grad") if self._grad_slot else self._staged_kinds
            self._slot_list = [StagingSlot(elems, kinds, self._cast_dtype)
                               for _ in range(self._slot_count)]
            self._staging.set(self._slot_count * elems * self._stage_elem_bytes)
        return self._slot_list

    def subgroups(self, sps: list[ShardedParam]) -> Iterator[list[ShardSlice]]:
        """``sps``' shards cut into sub-groups of slices that fit a staging slot."""
        if not self._stages:
            if sps:
                yield [ShardSlice(sp, 0, sp.shard_numel) for sp in sps]
            return
        yield from cut_subgroups(sps, self._subgroup_elems)

    def stage_in(self, work: InFlight, slot: StagingSlot | None) -> None:
        """Start reading a sub-group; each slice gets an aligned place in ``slot``'s buffers
        (see staging.py's [Note: staging without copies]) unless its state is resident."""
        work.states, work.slot = {k: [] for k in self.state_kinds}, slot
        pos = 0
        for sl in work.params:
            sp, n = sl.sp, sl.hi - sl.lo
            assert sp.master_shard is not None  # trainable: it keeps its fp32 master
            for kind, dst, stored in [("master", work.master, sp.master_shard)] + [
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

    def apply(self, work: InFlight, hp: dict[str, Any]) -> None:
        if not work.params:
            return
        grads = [self._fp32_grad(work, i, sl) for i, sl in enumerate(work.params)]
        if self.kind in ("adamw", "adam"):
            # a copy of its parameter's step count per slice, which the kernel increments (a
            # parameter cut in several slices advances once), beside the masters for a fused
            # kernel: staging.py's [Note: step counts cross in one copy]
            steps = step_counts([self.state[sl.sp].step for sl in work.params],
                                work.master[0].device, self.rt.accel)
            adam(
                work.master, grads, work.states["exp_avg"], work.states["exp_avg_sq"], [], steps,
                fused=self._fused, foreach=False if self._fused else None, amsgrad=False,
                decoupled_weight_decay=self.kind == "adamw",
                beta1=hp["betas"][0], beta2=hp["betas"][1], lr=hp["lr"],
                weight_decay=hp["weight_decay"], eps=hp["eps"], maximize=False,
            )
        else:
            bufs: list[torch.Tensor] | list[None] = (
                work.states.get("momentum_buffer") or [None] * len(grads))
            # torch types them list[Tensor | None], and lists are invariant (torch takes this)
            sgd(
                work.master, grads, bufs,  # type: ignore[arg-type]
                weight_decay=hp["weight_decay"],
                momentum=hp["momentum"], lr=hp["lr"], dampening=0.0, nesterov=hp["nesterov"],
                maximize=False,
            )

    @staticmethod
    def _fp32_grad(work: InFlight, i: int, sl: ShardSlice) -> torch.Tensor:
        """Slice ``i``'s gradient as the update reads it (staging.py's [Note: the gradient an
        update reads]), cast or unscaled into the slot's "grad" buffer where it has one."""
        assert sl.sp.grad is not None  # only parameters that got a gradient are updated
        grad = sl.of(sl.sp.grad)
        bufs = work.slot.buffers if work.slot is not None else {}
        buf = (bufs["grad"][work.places[i] : work.places[i] + grad.numel()]
               if "grad" in bufs else None)
        return fp32_grad(grad, buf, work.job.grad_scale, keep=work.job.tentative)

    def stage_out(self, work: InFlight) -> None:
        """Write back what lives on disk (aside, for a tentative job) and refresh each compute
        shard from its master."""
        def save(stored: StoredShard, start: int, t: torch.Tensor) -> None:
            write = stored.save_range_aside if work.job.tentative else stored.save_range
            work.pending.append(write(start, t))

        for i, sl in enumerate(work.params):
            sp = sl.sp
            # trainable, and prepared for training: both shards are there
            assert sp.master_shard is not None and sp.compute_shard is not None
            if sp.master_shard.resident() is None:
                save(sp.master_shard, sl.lo, work.master[i])
                for k in self.state_kinds:
                    save(self.state[sp].moments[k], sl.lo, work.states[k][i])
            if sp.compute_shard is sp.master_shard or isinstance(sp.compute_shard, CastShard):
                continue  # the next read of the training copy casts the updated master
            resident = sp.compute_shard.resident()
            if resident is not None:  # copy_ casts in one pass, no temporary
                sl.of(resident).copy_(work.master[i])
            else:
                pos, n = work.places[i], sl.hi - sl.lo
                # a compute shard on disk is cast in the slot's buffer (plan.staged_cast)
                assert work.slot is not None and work.slot.cast is not None
                cast = work.slot.cast[pos : pos + n]
                cast.copy_(work.master[i])
                save(sp.compute_shard, sl.lo, cast)
