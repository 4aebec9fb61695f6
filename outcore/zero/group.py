"""A group of parameters gathered, released and reduced together (one module's own params).

``GatherGroup`` is named for what it does, since "group" means two other things nearby: an
optimizer's *param group* (``engine.param_groups``, torch's hyper-parameter groups) and the
*process group* of the ranks (``runtime/comm.py``). In outcore's code a bare "group" is a
``GatherGroup``; the other two are always spelled out.

[Note: group states and moves]
A group is in exactly one state: SHARDED (only shards exist), FETCHING (shard reads issued,
not yet gathered) or UNSHARDED (every parameter shows its full tensor). The moves are
``unshard()`` (issue the reads; cheap, so a scheduler can call it early), ``wait_unshard()``
(finish reads, all-gather, show full tensors) and ``reshard()`` (drop the full tensors). A
test can ask ``group.state``.

[Note: one collective per group]
The shards of a group's parameters are packed into one buffer and all-gathered in one
collective; each rank's block of the result is then cut back into the parameters' full
tensors (a host copy, far cheaper than a collective's latency per parameter). Gradients go
the other way: packed rank-major, reduce-scattered once in fp32, and each parameter's slice
of the result becomes (or is added to) its gradient shard (param.py's [Note: gradients are
held, not copied]).

[Note: zero-copy at world size one]
With one rank and parameters resident on the compute device, a shard *is* the full tensor,
so the group shows views of the shards and never reshards: the hooks then cost nothing but
the Python call, which is how outcore without offload keeps pace with plain PyTorch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from outcore.errors import ParamAccessError
from outcore.offload.buffers import ALIGN, aligned_empty, round_up
from outcore.offload.ledger import Kind
from outcore.offload.storage import CastShard
from outcore.offload.tier import Tier
from outcore.profiling import ALL_GATHER, FETCH, REDUCE_SCATTER, UNSHARD, record_function
from outcore.runtime import Runtime
from outcore.zero.access import raw_data
from outcore.zero.collectives import (
    all_gather_blocks,
    copy_in_grads,
    copy_out_full,
    reduce_scatter_blocks,
)
from outcore.zero.param import ShardedParam
from outcore.zero.state import GROUP_MOVES, GroupState, ParamState

if TYPE_CHECKING:
    from outcore.device.accel import DeviceCopy
    from outcore.offload.storage import Future, StoredShard
    from outcore.runtime.comm import Handle


class PendingUpdate(Protocol):
    """An optimizer update of a group's shards that may still be running (a
    ``concurrent.futures.Future`` from the update pipeline): the group only asks whether it
    has finished, and waits for it (which raises the update's error)."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> object: ...


class GatherGroup:
    """Parameters that move together; see the notes above."""

    def __init__(self, index: int, name: str, params: list[ShardedParam], rt: Runtime,
                 persistence_threshold_bytes: int) -> None:
        self.index, self.name, self.params, self.rt = index, name, params, rt
        esize = rt.compute_dtype.itemsize
        # Shards read from disk into the packed buffer start on page boundaries of it, so
        # O_DIRECT reads land in place instead of passing through the I/O pool.
        self._aligned = rt.plan.aligned_gather
        align = ALIGN // esize if self._aligned else 1
        self.offsets: list[int] = []
        total = 0
        for sp in params:
            total = round_up(total, align)
            self.offsets.append(total)
            total += sp.shard_numel
            sp.group = self
        self.shard_numel = round_up(total, align)  # padding is never read
        self.full_bytes = sum(sp.numel for sp in params) * esize
        self.zero_copy = rt.plan.zero_copy
        self.persistent = self.zero_copy or self.full_bytes <= persistence_threshold_bytes
        self.state = GroupState.SHARDED  # moved only by _move
        self._unsharded = rt.ledger.charge(Tier.DEVICE, Kind.UNSHARDED)  # full tensors
        self.holds = 0  # running modules using it now (hooks.py); see hold()/unhold()
        self._send: torch.Tensor | None = None
        self._reads: list[Future] = []
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (full, host copy)
        self._copies: list[DeviceCopy] = []  # page-locked host shards on their way (one rank)
        self._grads_seen: set[int] = set()
        self.trainable = [sp for sp in params if sp.trainable]
        self._updates: list[PendingUpdate] = []  # optimizer updates of its shards still running

    def _move(self, to: GroupState) -> None:
        """The one place the group's state changes (zero/state.py's [Note: one state, one
        owner]); a move outside ``GROUP_MOVES`` is a bug in outcore."""
        assert (self.state, to) in GROUP_MOVES, (
            f"group {self.name}: {self.state.value} -> {to.value}")
        self.state = to

    # -- updates finishing after the step ----------------------------------------------------
    @property
    def updating(self) -> bool:
        """Whether an optimizer update of its shards may still be running (pipeline.py's
        [Note: the step's tail runs into the next forward]); a prefetch passes it by."""
        return any(not fut.done() for fut in self._updates)

    @property
    def awaits_update(self) -> bool:
        """Whether its next use must first wait for updates handed to it after a step (or
        raise their error: a failed one stays, so every later use raises it again)."""
        return bool(self._updates)

    def await_update(self) -> None:
        """Wait until the optimizer has finished with its shards; raise the update's error
        (again at every later fetch: the shards are not to be trusted after it)."""
        for fut in self._updates:
            fut.result()
        self._updates = []

    # -- use by running modules ------------------------------------------------------------------
    def hold(self) -> None:
        """A module that uses this group starts running (it must not be released meanwhile)."""
        self.holds += 1

    def unhold(self) -> bool:
        """That module finished; True when no running module holds the group any more."""
        self.holds -= 1
        return self.holds == 0

    # -- gather -----------------------------------------------------------------------------
    def unshard(self) -> None:
        """Start bringing the shards to the device (reads from the home tier)."""
        if self._updates:
            self.await_update()
        if self.state is not GroupState.SHARDED:
            return
        self._check_shown()
        self._move(GroupState.FETCHING)
        if self.zero_copy:
            return
        with record_function(UNSHARD):
            try:
                self._issue_reads()
            except BaseException:
                self._undo_fetch()
                raise

    def _undo_fetch(self) -> None:
        """[Note: a fetch that raises is undone]
        A fetch can fail part-way: an allocation or a read refused while the reads are issued,
        a read's error when they are waited for, a collective that fails. Left FETCHING, the
        group kept tensors without values (or without storage) that its next fetch took for
        done, so a persistent group then failed every forward, or ran one on whatever its
        memory held. So the fetch is cancelled as ``reshard`` cancels a prefetch: what it
        issued is waited for, what it allocated freed, and the group is SHARDED; the next use
        fetches afresh, and the error that stopped this one is the one raised."""
        with contextlib.suppress(Exception):  # a read's error again: the caller raises its own
            self.reshard()

    def _check_shown(self) -> None:
        """[Note: a forward inside gathered_parameters]
        The model may be called while ``gathered_parameters`` shows some of its parameters:
        those are used as shown (the user's full fp32 values, edits included) and only the
        group's other parameters are fetched. Shown values in another dtype than the compute
        dtype cannot enter the same kernels, which is refused in words here."""
        if not self.rt.shown:
            return
        for sp in self.params:
            shown = raw_data(sp.param) if sp.state is ParamState.SHOWN else None
            if shown is not None and shown.dtype != self.rt.compute_dtype:
                raise ParamAccessError(
                    f"the model runs parameter {sp.label()} inside gathered_parameters, which "
                    f"shows it in {shown.dtype} while the engine computes in "
                    f"{self.rt.compute_dtype}; call the model outside the context (or train "
                    "with dtype fp32)")

    def _fetched(self) -> list[ShardedParam]:
        """The parameters a fetch fills: all but those ``gathered_parameters`` shows."""
        if not self.rt.shown:  # the hot path: nothing is shown outside that context
            return self.params
        return [sp for sp in self.params if sp.state is not ParamState.SHOWN]

    def _issue_reads(self) -> None:
        # counted from the moment memory is committed to this fetch, prefetches included
        self._unsharded.set(self.full_bytes)
        # every parameter of a group has its training-dtype shard (prepare_for_training);
        # the reads are kept as they are issued, for _undo_fetch to wait for
        reads: list[Future] = []
        self._reads = reads
        if self.rt.world_size == 1:
            # A shard is the whole parameter: read it straight into the full tensor, or on an
            # accelerator, where disk reads cannot land, into host memory first
            for sp in self._fetched():
                shard = sp.compute_shard
                assert shard is not None
                full = sp.alloc_full().view(-1)
                pinned = self._pinned(shard)
                if pinned is not None:  # straight to the device, on the copy stream
                    self._copies.append(self.rt.accel.copy_to_device(full, pinned[: full.numel()]))
                    continue
                if self._stages(shard):
                    host = torch.empty(full.numel(), dtype=full.dtype,
                                       pin_memory=self.rt.accel.pin_host_buffers)
                    self._staged.append((full, host))
                    full = host
                reads.append(shard.load(full))
            return
        dtype = self.rt.compute_dtype
        send = (aligned_empty(self.shard_numel * dtype.itemsize).view(dtype) if self._aligned
                else torch.empty(self.shard_numel, dtype=dtype))
        for sp, off in zip(self.params, self.offsets, strict=True):
            shard = sp.compute_shard
            assert shard is not None
            reads.append(shard.load(send[off : off + sp.shard_numel]))
        self._send = send

    def _stages(self, shard: StoredShard) -> bool:
        """[Note: disk reads reach the device through host memory]
        The I/O path (``nvme.py``, ``source_file.py``) reads into CPU tensors only, so at one
        rank on an accelerator a shard on disk is read into a page-locked host tensor and
        copied to the device on the accelerator's copy stream once the read is done
        (``wait_unshard``); the compute stream waits for that copy, not the host. A training
        copy cast from a master in host memory (``CastShard``) is staged the same way: the
        cast runs on the host into the page-locked tensor, and half the master's bytes cross.
        A shard in device memory, or cast from a master there, is copied by its own ``load``.
        On the CPU nothing is staged."""
        if not self.rt.accel.is_cuda:
            return False
        if isinstance(shard, CastShard):
            return shard.master_on_host
        return shard.resident() is None

    def _pinned(self, shard: StoredShard) -> torch.Tensor | None:
        """A shard held in page-locked host memory (``Runtime.store``'s [Note: training copies
        in host memory are page-locked on an accelerator]), which the copy stream can read
        directly, overlapping compute; None for anything else."""
        if not self.rt.accel.is_cuda:
            return None
        resident = shard.resident()
        if resident is None or resident.device.type != "cpu" or not resident.is_pinned():
            return None
        return resident

    def _copy_staged(self) -> None:
        """The staged host copies to their full tensors (their reads are done)."""
        copies = [self.rt.accel.copy_to_device(full, host) for full, host in self._staged]
        self._staged = []
        for copy in copies:
            copy.wait()

    def settle_reads(self) -> None:
        """Wait until the reads of a fetch in flight have landed, and leave the rest of the
        fetch (an error too) to its use: ``wait_unshard``, which may all-gather, so it runs
        only where every rank runs it. Read-ahead in flight holds the shards' store, and
        with it the swap file, alive (engine/lifetime.py's ``quiesce``)."""
        for fut in self._reads:
            fut.exception()

    def wait_unshard(self) -> None:
        """Finish the fetch: wait for reads, all-gather, and show full tensors."""
        if self.state is GroupState.UNSHARDED:
            return
        if self.state is GroupState.SHARDED:
            self.unshard()
        if self.zero_copy:
            for sp in self._fetched():
                shard = sp.compute_shard
                assert shard is not None
                resident = shard.resident()
                assert resident is not None  # zero-copy: the shard is a tensor in memory
                sp.show_resident(resident[: sp.numel].view(sp.shape))
        else:
            try:
                self._finish_fetch()
            except BaseException:
                self._undo_fetch()  # see its note
                raise
            for sp in self._fetched():
                sp.mark_gathered()
        self._move(GroupState.UNSHARDED)

    def _finish_fetch(self) -> None:
        with record_function(FETCH):
            for fut in self._reads:
                fut.result()
            self._reads = []
            if self._staged:
                self._copy_staged()
            for copy in self._copies:
                copy.wait()
            self._copies = []
            if self._send is not None:
                self._gather()

    def _gather(self) -> None:
        assert self._send is not None  # wait_unshard gathers only after packed reads
        send = self.rt.accel.to_device(self._send)
        self._send = None
        self.rt.comm.note(2 * self.index)  # comm.py's [Note: the ranks' collectives are compared]
        with record_function(ALL_GATHER):
            blocks = all_gather_blocks(self.rt.comm, send, self.shard_numel)
        for sp, off in zip(self.params, self.offsets, strict=True):
            if sp.state is not ParamState.SHOWN:
                copy_out_full(blocks, sp.alloc_full().view(-1), off, sp.shard_numel, sp.layout)

    def reshard(self) -> None:
        """Free the full tensors' storage; only the shards remain.

        A group still FETCHING (prefetched, never used) is cancelled, not finished: its local
        reads are waited for and dropped, and no all-gather runs, so releasing an unused
        prefetch never issues a collective (see schedule.py's note). A read that failed is
        raised after the group is released.
        """
        failed: BaseException | None = None
        if self.state is GroupState.FETCHING and not self.zero_copy:
            for fut in self._reads:
                try:
                    fut.result()
                except BaseException as e:  # noqa: BLE001 - raised once the group is released
                    failed = failed or e
            for copy in self._copies:  # the full tensors are freed only after their copies
                copy.wait()
            self._reads, self._send, self._staged, self._copies = [], None, [], []
        elif self.state is GroupState.FETCHING:
            self._move(GroupState.SHARDED)
            return
        if self.state is GroupState.SHARDED or self.zero_copy:
            return
        for sp in self._fetched():
            sp.release()
        self._move(GroupState.SHARDED)
        self._unsharded.release()
        if failed is not None:
            raise failed

    def hide_resident(self) -> None:
        """A zero-copy group stops showing its shards (``gathered_parameters`` shows the
        user's copies instead, or the engine closes): its parameters become SHARDED."""
        if self.zero_copy and self.state is not GroupState.SHARDED:
            for sp in self._fetched():
                sp.release()
            self._move(GroupState.SHARDED)

    def shown_elsewhere(self) -> None:
        """Its parameters showed other tensors for a while (``gathered_parameters``) and now
        show placeholders: the group is SHARDED again (anything a forward inside the context
        fetched is released), and a zero-copy group shows its shards at once, as always."""
        self.reshard()
        self.hide_resident()
        if self.zero_copy:
            self.wait_unshard()

    def refresh_after_step(self, updates: Sequence[PendingUpdate] | None = None) -> None:
        """Kept-gathered groups hold stale full tensors once their shards are updated.

        A persistent group is needed by every forward, so its reads are issued again at once
        (local stages only; the all-gather still waits for the module to run). With
        ``updates`` still running on its shards, the group is only released: its next fetch
        waits for them first. A zero-copy group (its shards the tensors the model shows, as
        the resident copies of zero/build.py's ``keep_resident`` are) keeps showing them: a
        forward waits for its updates at its fetch, or at a direct read of one of its
        weights (overlap/hooks.py's ``_on_access``; a submodule called on its own waits for
        every such group's first), and a user's read or write outside a forward waits as
        well (``ShardedParam.check_values``). A failed update stays recorded, so each of
        those raises it again.
        """
        if updates:
            self._updates = list(updates)
            if not self.zero_copy:
                self.reshard()
            return
        if self.zero_copy:
            return
        if self.state is GroupState.UNSHARDED and self.rt.plan.carries_head:
            # carried into the next iteration (schedule.py's [Note: carrying the head
            # across iterations]): the new values come from the masters, not the disk
            for sp in self.params:
                if sp.master_shard is not None:
                    master = sp.master_shard.resident()
                    assert master is not None  # carries_head: the masters are in memory
                    sp.full.view(-1).copy_(master[: sp.numel])
            return
        if self.state is not GroupState.SHARDED:
            self.reshard()
        if self.persistent:
            self.unshard()

    # -- gradients ----------------------------------------------------------------------------
    def grad_arrived(self, sp: ShardedParam) -> bool:
        """Record that ``sp``'s gradient is final for this backward; True when all have arrived."""
        self._grads_seen.add(id(sp))
        return len(self._grads_seen) == len(self.trainable)

    def forget_grads_seen(self) -> None:
        self._grads_seen.clear()

    @property
    def has_pending_grads(self) -> bool:
        return any(sp.param.grad is not None for sp in self.trainable)

    def reduce_grads(self) -> PendingReduce | None:
        """Start reducing this backward's gradients into the gradient shards.

        At world size one the gradients are added at once and None is returned; otherwise the
        reduce-scatter runs in the background and the returned handle's ``finish()`` adds its
        result. Either way the parameters' full gradients are dropped here.
        """
        self._grads_seen.clear()
        live = [(sp, off) for sp, off in zip(self.params, self.offsets, strict=True)
                if sp.trainable and sp.param.grad is not None]
        if not live:
            return None
        w, rt = self.rt.world_size, self.rt
        if w == 1:
            for sp, _ in live:
                grad = sp.param.grad
                assert grad is not None  # `live` holds the parameters with a gradient
                flat, sp.param.grad = grad.reshape(-1), None
                # autograd may hand over a view into a larger buffer: only a tensor that is
                # its whole storage is held, so holding it pins nothing else
                sp.add_grad(flat, owned=flat.untyped_storage().nbytes() == flat.nbytes)
            return None
        grads = []
        for sp, off in live:
            grad = sp.param.grad
            assert grad is not None  # `live` holds the parameters with a gradient
            grads.append((grad.reshape(-1), off, sp.shard_numel, sp.layout))
        send = copy_in_grads(grads, w, self.shard_numel, rt.device)
        for sp, _ in live:
            sp.param.grad = None
        rt.comm.note(2 * self.index + 1)  # comm.py's [Note: the ranks' collectives are compared]
        with record_function(REDUCE_SCATTER):
            out, work = reduce_scatter_blocks(rt.comm, send)
        return PendingReduce(self, live, out, send, work)


class PendingReduce:
    """A reduce-scatter in flight; ``finish()`` waits and adds the mean to the grad shards."""

    _send: torch.Tensor | None  # the packed gradients, dropped once the collective finished

    def __init__(self, group: GatherGroup, live: list[tuple[ShardedParam, int]],
                 out: torch.Tensor, send: torch.Tensor, work: Handle) -> None:
        self.group, self._live, self._out, self._send, self._work = group, live, out, send, work

    def finish(self) -> GatherGroup:
        """Wait, then copy-out: each parameter's piece of the mean joins its gradient shard."""
        with record_function(REDUCE_SCATTER):
            self._work.wait()
        self._send = None
        self._out.div_(self.group.rt.world_size)
        for sp, off in self._live:
            sp.add_grad(self._out[off : off + sp.shard_numel], owned=True)
        return self.group
