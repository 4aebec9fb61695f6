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
any other. Slices are cut at multiples of ``_ALIGN_ELEMS`` elements so every piece starts on
a 4 KiB boundary of its extent in both the fp32 and the 16-bit files (O_DIRECT needs that).

[Note: torch's own kernels]
The update itself is ``torch.optim.adamw.adamw`` / ``torch.optim.sgd.sgd`` (fused when the
device supports it) over lists of shard tensors, so the arithmetic is exactly PyTorch's and a
parameter group's hyper-parameters (e.g. no weight decay on biases) apply per parameter.
Parameters that received no gradient in this step are skipped, as torch optimizers skip
parameters whose ``.grad`` is None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch.optim.adamw import adamw
from torch.optim.sgd import sgd

from outcore.config import OptimizerConfig
from outcore.param import ShardedParam
from outcore.runtime import Runtime
from outcore.storage import Tier
from outcore.tiers.buffers import aligned_empty

_STATE_KINDS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}
_ALIGN_ELEMS = 2048  # 8 KiB of fp32, 4 KiB of bf16/fp16


@dataclass
class _Slice:
    sp: ShardedParam
    lo: int
    hi: int

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.lo : self.hi]


@dataclass
class _Work:
    """One sub-group in flight: its slices and their master/state tensors in memory."""

    params: list[_Slice]
    master: list[torch.Tensor] = field(default_factory=list)
    states: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    pending: list = field(default_factory=list)
    slot: _Slot | None = None  # the buffers staged slices live in (None: all resident)
    places: list[int] = field(default_factory=list)  # each slice's offset in the slot

    def wait(self) -> None:
        """Wait for every transfer of this sub-group, then raise the first error, if any:
        its slot is reused next, so nothing may still be reading or writing it."""
        pending, self.pending = self.pending, []
        error: BaseException | None = None
        for f in pending:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the rest
                error = error or e
        if error is not None:
            raise error


class _Slot:
    """Page-aligned host buffers for one sub-group in flight, allocated once and reused.

    [Note: staging without copies]
    A staged slice is placed at a multiple of ``_ALIGN_ELEMS`` elements in every buffer, so
    its bytes start on a 4 KiB boundary in memory as they do in the swap file, and O_DIRECT
    moves them straight between disk and buffer: no bounce through the I/O pool and no fresh
    allocation (each of which page-faults on first touch, seconds per GiB on a VM). Three
    slots serve the pipeline: one being read, one being updated, one being written.
    """

    def __init__(self, elems: int, kinds: tuple[str, ...], cast: torch.dtype | None) -> None:
        # zero_() touches every page now, not in the first step; "grad" is where a gradient
        # held in the training dtype is cast for the update (param.py's [Note: gradients are
        # held, not copied]), not read from disk
        self.buffers = {k: aligned_empty(elems * 4).zero_().view(torch.float32) for k in kinds}
        self.cast = (aligned_empty(elems * cast.itemsize).zero_().view(cast)
                     if cast is not None else None)


class ShardedOptimizer:
    """AdamW or SGD over ShardedParams; ``param_groups`` is editable like torch's (e.g. lr).

    [Note: updating during backward]
    ``submit(params)`` queues an update of parameters whose gradients are final on a worker
    thread, so it runs (and, with state on NVMe, does its reads and writes) while backward
    continues on earlier layers; torch kernels and file I/O release the GIL. ``step()`` waits
    for the queue and updates whatever was not submitted. The engine only submits when the
    update cannot depend on gradients still to come: no clipping (the global norm needs every
    gradient) and no fp16 (an overflow anywhere must cancel the whole step).
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
        kinds = _STATE_KINDS[cfg.type] if (cfg.type == "adamw" or cfg.momentum) else ()
        for sp in self.params:
            sp.optim = {k: rt.store(torch.zeros(sp.shard_numel, dtype=torch.float32,
                                                device=rt.device), rt.state_tier, "optimizer")
                        for k in kinds}
            sp.step = 0
        self.state_kinds = kinds
        # what a slice stages in host memory per element (see [Note: staging without copies])
        self._staged_kinds = (("master", *kinds) if rt.state_tier is Tier.NVME else ())
        staged_cast = rt.param_tier is Tier.NVME and not rt.compute_is_master
        self._cast_dtype = rt.compute_dtype if staged_cast else None
        # only a gradient held in a 16-bit training dtype needs a cast for the update
        self._grad_slot = (bool(self._staged_kinds) and rt.holds_raw_grads
                           and rt.compute_dtype != torch.float32)
        self._stage_elem_bytes = 4 * (len(self._staged_kinds) + self._grad_slot) + (
            rt.compute_dtype.itemsize if staged_cast else 0)
        per_slot = rt.staging_bytes // 3 // max(self._stage_elem_bytes, 1)
        self._subgroup_elems = max(_ALIGN_ELEMS, per_slot // _ALIGN_ELEMS * _ALIGN_ELEMS)
        self._slot_list: list[_Slot] = []
        self._fused = rt.device.type in ("cpu", "cuda")
        self._worker: ThreadPoolExecutor | None = None
        self._submitted: list[tuple[Future, int]] = []
        # gradients waiting for a background update may hold at most this many bytes; the
        # backward that submits more waits for the oldest update (see the note above)
        self.pending_grad_limit = 2 * rt.cfg.offload.host_buffer_bytes
        self._dropped_sq = 0.0  # squared norm of gradients already consumed and freed
        self.stats = {"updates_during_backward": 0, "updates_at_step": 0}

    @property
    def params(self) -> Iterator[ShardedParam]:
        for sps in self._members:
            yield from sps

    def zero_grad(self) -> None:
        for sp in self.params:
            sp.drop_grad()

    def submit(self, sps: list[ShardedParam]) -> None:
        """Update ``sps`` (gradients final) in the background; see the note above."""
        todo = [sp for sp in sps if sp.has_grad and not sp.stepped and id(sp) in self._hp_index]
        if not todo:
            return
        for sp in todo:
            sp.stepped = True
        self.stats["updates_during_backward"] += len(todo)
        if self._worker is None:
            # On CPU, backward already runs torch's intra-op threads on every core; one more
            # thread for the update competes less than a second team of them would.
            init = (lambda: torch.set_num_threads(1)) if self.rt.device.type == "cpu" else None
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="outcore-optim",
                                              initializer=init)
        nbytes = sum(sp.grad.nbytes for sp in todo)
        while self._submitted and (sum(n for _, n in self._submitted) + nbytes
                                   > self.pending_grad_limit):
            self._submitted.pop(0)[0].result()
        self._submitted.append((self._worker.submit(self._update_and_free, todo), nbytes))

    def step(self) -> None:
        """Finish submitted updates, then update every other parameter that got a gradient."""
        self.wait()
        rest = [sp for sp in self.params if sp.has_grad and not sp.stepped]
        for sp in rest:
            sp.stepped = True
        self.stats["updates_at_step"] += len(rest)
        self._update_all(rest)

    def wait(self) -> None:
        submitted, self._submitted = self._submitted, []
        for fut, _ in submitted:
            fut.result()

    def take_freed_norm_sq(self) -> float:
        """Squared L2 norm of the gradients that background updates consumed and freed."""
        sq, self._dropped_sq = self._dropped_sq, 0.0
        return sq

    def _update_and_free(self, sps: list[ShardedParam]) -> None:
        """Background update; the gradients are freed as soon as they are applied."""
        self._update_all(sps)
        if self.rt.cfg.track_grad_norm:  # the sum is only read by Engine._global_norm
            norms = torch._foreach_norm([sp.grad for sp in sps], 2, dtype=torch.float32)
            self._dropped_sq += float(torch.stack(norms).double().pow(2).sum())
        for sp in sps:
            sp.drop_grad()
            sp.stepped = True

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        if self._slot_list:  # no update runs any more: give the staging buffers back
            self._slot_list = []
            self.rt.ledger.add(Tier.HOST.value, "io_buffers",
                               -3 * self._subgroup_elems * self._stage_elem_bytes)

    def _update_all(self, sps: list[ShardedParam]) -> None:
        by_group: dict[int, list[ShardedParam]] = {}
        for sp in sps:
            by_group.setdefault(self._hp_index[id(sp)], []).append(sp)
        for i, members in sorted(by_group.items()):
            self._run(self.param_groups[i], members)
            for sp in members:
                sp.step += 1

    def _run(self, hp: dict, live: list[ShardedParam]) -> None:
        """The streamed pipeline over sub-groups: read k+1, update k, write k-1."""
        chunks = list(self._subgroups(live))
        if not chunks:
            return
        slots = self._slots() if self._stages else [None, None, None]
        in_flight: list[_Work] = []
        try:
            ahead = self._load(chunks[0], slots[0])
            in_flight.append(ahead)
            for i in range(len(chunks)):
                work = ahead
                # slot (i + 1) % 3 last served chunk i - 2, whose writes finished last round
                if i + 1 < len(chunks):
                    ahead = self._load(chunks[i + 1], slots[(i + 1) % 3])
                    in_flight.append(ahead)
                work.wait()
                self._update(work, hp)
                if i > 0:
                    in_flight.pop(0).wait()  # chunk i - 1's writes
                self._store(work)
            while in_flight:
                in_flight.pop(0).wait()
        finally:
            # after an error, no read or write may still target a slot the next step reuses
            for work in in_flight:
                with contextlib.suppress(BaseException):
                    work.wait()

    @property
    def _stages(self) -> bool:
        """Whether updates stream through host buffers (some state they touch is on NVMe)."""
        return self._stage_elem_bytes > 0

    def _slots(self) -> list[_Slot]:
        if not self._slot_list:
            elems = self._subgroup_elems
            kinds = (*self._staged_kinds, "grad") if self._grad_slot else self._staged_kinds
            self._slot_list = [_Slot(elems, kinds, self._cast_dtype)
                               for _ in range(3)]
            self.rt.ledger.add(Tier.HOST.value, "io_buffers", 3 * elems * self._stage_elem_bytes)
        return self._slot_list

    def _subgroups(self, sps: list[ShardedParam]) -> Iterator[list[_Slice]]:
        if not self._stages:
            if sps:
                yield [_Slice(sp, 0, sp.shard_numel) for sp in sps]
            return
        limit = self._subgroup_elems
        chunk: list[_Slice] = []
        room = limit
        for sp in sps:
            lo = 0
            while lo < sp.shard_numel:
                hi = min(sp.shard_numel, lo + room)
                chunk.append(_Slice(sp, lo, hi))
                room -= hi - lo
                lo = hi
                if room < _ALIGN_ELEMS:
                    yield chunk
                    chunk, room = [], limit
                else:  # keep the next slice of any parameter aligned
                    room -= room % _ALIGN_ELEMS
        if chunk:
            yield chunk

    def _load(self, slices: list[_Slice], slot: _Slot | None) -> _Work:
        """Start reading a sub-group; each slice gets an aligned place in ``slot``'s buffers
        (see [Note: staging without copies]) unless its state is resident."""
        work = _Work(slices, states={k: [] for k in self.state_kinds}, slot=slot)
        pos = 0
        for sl in slices:
            sp, n = sl.sp, sl.hi - sl.lo
            for kind, dst, stored in [("master", work.master, sp.master)] + [
                (k, work.states[k], sp.optim[k]) for k in self.state_kinds
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
            pos += -(-n // _ALIGN_ELEMS) * _ALIGN_ELEMS
        return work

    def _update(self, work: _Work, hp: dict) -> None:
        grads = [self._fp32_grad(work, i, sl) for i, sl in enumerate(work.params)]
        if self.kind == "adamw":
            # each slice gets its own copy of the parameter's step count: the kernel
            # increments it, and a parameter cut in several slices must advance only once
            steps = [torch.tensor(float(sl.sp.step), dtype=torch.float32) for sl in work.params]
            adamw(
                work.master, grads, work.states["exp_avg"], work.states["exp_avg_sq"], [], steps,
                fused=self._fused, foreach=False if self._fused else None, amsgrad=False,
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
    def _fp32_grad(work: _Work, i: int, sl: _Slice) -> torch.Tensor:
        """Slice ``i``'s gradient in fp32: the shard itself, or its cast into the slot's
        reused buffer when it is held in the training dtype."""
        grad = sl.of(sl.sp.grad)
        if grad.dtype == torch.float32:
            return grad
        if work.slot is None or "grad" not in work.slot.buffers:
            return grad.float()
        pos = work.places[i]
        return work.slot.buffers["grad"][pos : pos + grad.numel()].copy_(grad)

    def _store(self, work: _Work) -> None:
        """Write back what lives on disk and refresh each compute shard from its master."""
        for i, sl in enumerate(work.params):
            sp = sl.sp
            if sp.master.resident() is None:
                work.pending.append(sp.master.save_range(sl.lo, work.master[i]))
                for k in self.state_kinds:
                    work.pending.append(sp.optim[k].save_range(sl.lo, work.states[k][i]))
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
