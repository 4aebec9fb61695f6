"""Public PyTorch hooks that fetch parameters before use and release them after.

[Note: three hooks, three jobs]
* Module forward pre/post hooks fetch a module's own groups before it runs and release them
  after; this is the common path and where the schedule learns the order of use.
* A ``TorchFunctionMode`` active during the engine's forward sees every torch call: if one
  touches a sharded parameter (a tied head using the embedding's weight, a parent reading a
  child's weight), it fetches that parameter's group on the spot and holds it until the
  module now running finishes. So parameters used outside their module need no user action.
* ``saved_tensors_hooks`` see each tensor autograd keeps for backward. A saved parameter is
  kept as the parameter object, and when backward unpacks it, its group is fetched if it is
  not already there. So backward is correct however modules are nested, reused or skipped,
  and needs no per-module backward hook; the schedule only makes it faster. Any other saved
  tensor is kept as it is, its version checked at unpack as autograd would (saved.py).
After backward, a per-parameter post-accumulate-grad hook reduces a group's gradients as soon
as all of them are final, and the group is released.

Backward's release of groups no gradient hook releases (frozen ones, and those a
recomputation fetched) is backward_holds.py's [Note: frozen groups in backward].
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NoReturn, Protocol, TypeVar

import torch
from torch import nn

from outcore.overlap import abandoned
from outcore.overlap.abandoned import OuterCall
from outcore.overlap.backward_holds import BackwardHolds
from outcore.overlap.compiled import uncompiled
from outcore.overlap.plain_backward import refuse_plain_backward
from outcore.overlap.saved import Kept, SavedParam, pack
from outcore.overlap.tied_rows import TiedRows
from outcore.overlap.traced import refuse_untraceable
from outcore.overlap.unfrozen import refuse_unfrozen
from outcore.runtime.phase import Phase
from outcore.zero.access_mode import ParamAccessMode
from outcore.zero.forward_writes import WriteWatch
from outcore.zero.group import GatherGroup, PendingReduce
from outcore.zero.load_agreement import agree_on_load
from outcore.zero.state import GroupState
from outcore.zero.surface import REDUCES, refuse_replacing_load

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from outcore.overlap.schedule import Schedule
    from outcore.runtime import Runtime
    from outcore.zero.param import ShardedParam


class _Inert(Protocol):
    """Hook owners a copied model may carry: their hook methods do nothing while ``inert``."""

    inert: bool


_Owner = TypeVar("_Owner", bound=_Inert)


def inert_copy(cls: type[_Owner]) -> _Owner:
    """An instance of ``cls`` whose hook methods do nothing: what a copied or pickled model
    carries in place of outcore's hooks."""
    copy = object.__new__(cls)
    copy.inert = True
    return copy


class Hooks:
    """Installs and owns every hook handle of one engine (``remove()`` takes them all out)."""

    inert = False  # a deep copy's: see __deepcopy__

    def __deepcopy__(self, memo: dict[int, object]) -> Hooks:
        """``copy.deepcopy(model)`` copies the model's hook tables, and with them this
        object: the copy is a plain model, so its copy of the hooks does nothing (and so
        for ``torch.save(model)``, through ``__reduce__``)."""
        return inert_copy(type(self))

    def __reduce__(self) -> tuple[Callable[[type[Hooks]], Hooks], tuple[type[Hooks]]]:
        return (inert_copy, (type(self),))

    def __init__(self, module_groups: dict[nn.Module, list[GatherGroup]],
                 groups: list[GatherGroup], schedule: Schedule, rt: Runtime) -> None:
        self.rt = rt  # its ``phase`` is moved here only: _sync_phase
        # zero/forward_writes.py's note: begun and checked as the phase moves
        self.writes = rt.write_watch = WriteWatch(sp for g in groups for sp in g.params)
        # only a step that returns early leaves zero-copy groups with updates to wait for
        self._defers = rt.plan.defers_updates
        self.module_groups = module_groups
        self.groups = groups
        self.schedule = schedule
        self.frames: list[list[GatherGroup]] = []
        self.outer = OuterCall()  # abandoned.py's [Note: a forward left without its post hooks]
        # what the outermost call of a submodule called on its own opened ([Note: a submodule
        # called on its own])
        self._direct: contextlib.ExitStack | None = None
        self._in_backward = False
        self.pending: deque[PendingReduce] = deque()
        # called with each group whose gradients for this backward are reduced (or None)
        self._on_reduced: Callable[[GatherGroup], None] | None = None
        self.mode = ParamAccessMode(self._on_access)
        # backward_holds.py's [Note: frozen groups in backward]
        self.holds = BackwardHolds(groups, schedule.done)
        # unfrozen.py's [Note: a parameter unfrozen after initialize]: made without its state
        self._born_frozen = [sp for g in groups for sp in g.params
                             if not any(sp is t for t in g.trainable)]
        # [Note: a tied weight's gradient waits unseen]: per group run by several modules, its
        # gradient bytes, reserved in each backward until its gradients arrive
        self._tied = {g.index: g.full_bytes for g in groups if g.trainable and sum(
            g in gs for gs in module_groups.values()) > 1}
        self._unseen: dict[int, int] = {}
        me = weakref.ref(self)  # no cycle from the rows' state back to these hooks
        rt.drop_abandoned = lambda: (h := me()) is not None and abandoned.drop(h)  # (nor rt's)
        self.tied_rows = TiedRows(module_groups.keys(), set(self._tied),
                                  lambda: (h := me()) is not None and h._in_backward)
        self._handles: list[RemovableHandle] = []
        for m, gs in module_groups.items():
            # a load that would replace sharded parameters: refused (surface.py); at more
            # ranks, one refused on any rank refused on all (load_agreement.py)
            for pre_load in (refuse_replacing_load, agree_on_load):
                self._handles.append(m.register_load_state_dict_pre_hook(  # type: ignore[no-untyped-call]
                    pre_load))  # torch leaves this method unannotated
            if gs:
                self._handles.append(m.register_forward_pre_hook(self._pre_forward))
                self._handles.append(m.register_forward_hook(self._post_forward, always_call=True))
        for g in groups:
            for sp in g.trainable:
                # torch leaves this method unannotated
                self._handles.append(
                    sp.param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        self._make_grad_hook(sp))
                )

    @property
    def active(self) -> bool:
        """Whether a forward (or backward) is running: a module call now is part of it."""
        return bool(self.frames) or self._in_backward

    def _sync_phase(self) -> None:
        """The runtime's ``Phase`` follows the frames and the backward flag (state.py)."""
        before, self.rt.phase = self.rt.phase, (Phase.BACKWARD if self._in_backward else
                                                Phase.FORWARD if self.frames else Phase.IDLE)
        if before is Phase.IDLE and self.rt.phase is not Phase.IDLE:
            self.writes.begin()
            self.rt.comm.take_sequence()  # what this phase gathers is compared at its end
        elif self.rt.phase is Phase.IDLE:  # ended unchecked (it raised): forward_writes.py
            self.writes.end()
        if not self.frames:
            self.outer.clear()

    def remove(self) -> None:
        self._close_direct()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.frames.clear()
        self._in_backward = False
        self._sync_phase()

    # -- forward -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Active around the wrapped module's forward: access mode, saved-tensor hooks, frames."""
        if not self.frames and not self._in_backward:
            refuse_untraceable(self)  # traced.py's note
            self.outer.note()
        self.frames.append([])
        self._sync_phase()
        # a recomputation inside backward continues its iteration; after a step the
        # schedule already began this one (schedule.py's [Note: prefetch across the step])
        if not self._in_backward:
            try:
                with self.mode.suspended():
                    self.schedule.begin_forward()
            except BaseException:  # (a prefetch's read failed): no forward began
                self.frames.pop()
                self._sync_phase()
                raise
        if not self.schedule.movable and not (self._defers and self.schedule.updating):
            # Nothing is ever released (one rank, every shard resident on the device, or its
            # training copies kept in host memory): every parameter is always present, so the
            # per-op checks would find nothing to fetch, nor an update to wait for (none
            # starts during a forward).
            try:
                yield
                self._check_writes()
            finally:
                self._end_frame()
            return
        saved = torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)
        try:
            with self.mode, saved:
                yield
            self._check_writes()
        finally:
            self._end_frame()

    def _check_writes(self) -> None:
        if len(self.frames) == 1 and not self._in_backward:  # the outermost forward ends
            self.writes.check("forward", self.rt.comm)

    def inside(self) -> bool:
        """``active``, once a forward left without its post hooks is closed (abandoned.py)."""
        abandoned.drop(self)
        return self.active

    def release_frames(self) -> None:
        """Release every frame's groups (a forward left: abandoned.py's note)."""
        with self.mode.suspended():
            while self.frames:
                self._release(self.frames.pop())
        self._sync_phase()

    def _end_frame(self) -> None:
        """Release what the forward's frame fetched. Its frame is gone where the hooks were
        removed meanwhile (a Ctrl-C in the forward closed the engine, and the interrupted
        forward's context is finalized later, by the garbage collector)."""
        if self.frames:
            with self.mode.suspended():
                self._release(self.frames.pop())
        self._sync_phase()

    @uncompiled  # compiled.py's [Note: hooks run outside a compiled graph]
    def _pre_forward(self, module: nn.Module, args: tuple[object, ...]) -> None:
        if self.inert:
            return
        refuse_untraceable(self)  # traced.py's note: before the frame, and outside suspended()
        with self.mode.suspended():
            # none for a module swapped in after initialize with these hooks copied onto it
            # (prepare_qat, fuse_modules): what it touches is fetched on access, as PyTorch runs
            groups = self.module_groups.get(module, [])
            # a submodule called on its own (after a forward left without its post hooks too)
            outer = not self._in_backward and (not self.frames or abandoned.drop(self))
            if outer:
                self._close_direct()  # what a forward left without its post hooks opened
            if self._in_backward:  # a recomputation (backward_holds.py's note)
                self.holds.recompute(groups)
            # push the frame and hold its groups before anything that may raise: the
            # post-forward hook (which always runs) pops this frame and unholds them
            self.frames.append(list(groups))
            self._sync_phase()
            for g in groups:
                g.hold()
            if outer:  # what the model's call does first (engine/core.py's _before_forward)
                self.outer.note()
                self.rt.before_forward()
                if self._defers:  # it may read any module's weights, unseen
                    self.schedule.await_updates()
            if self._plain_backward() and torch._C._current_autograd_node() is not None:
                self.refuse_plain_backward()  # a recomputation in loss.backward(): see its note
            self.schedule.need(groups)
        if outer:
            self._direct = self._open_direct()

    def _open_direct(self) -> contextlib.ExitStack | None:
        """The access mode and the saved-tensor hooks for a submodule called on its own.

        [Note: a submodule called on its own]
        A loop may call a model's parts itself, ``model.head(model.body(x))``, or hold its
        modules in a container with no forward (an ``nn.ModuleDict``). The entry modules'
        hooks (entry.py) never open a forward for those calls, so autograd kept the gathered
        full tensor that the release then freed, and backward crashed in torch
        ("setStorage: ... out of bounds for storage of size 0"); a parameter read outside its
        module was not fetched either. So the outermost such call opens what
        ``forward_context`` opens around the model's own call (its forward's frames, phase
        and end-of-forward check are this module's already), and its post hook closes it."""
        if not self.schedule.movable and not (self._defers and self.schedule.updating):
            return None  # nothing is ever released: forward_context opens nothing either
        stack = contextlib.ExitStack()
        stack.enter_context(self.mode)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, self._unpack))
        return stack

    def _close_direct(self) -> None:
        opened, self._direct = self._direct, None
        if opened is not None:
            opened.close()

    @uncompiled  # compiled.py's [Note: hooks run outside a compiled graph]
    def _post_forward(self, module: nn.Module, args: tuple[object, ...], output: object) -> object:
        if self.inert:
            return None
        with self.mode.suspended():
            self._release(self.frames.pop())
            try:  # a submodule called on its own ends its forward here (forward_writes.py)
                if not self.frames and not self._in_backward:
                    self.writes.check("forward", self.rt.comm)
            finally:
                self._sync_phase()
                if not self.frames:  # what its outermost call opened: [Note: a submodule ...]
                    self._close_direct()
            # a tied embedding's output: tied_rows.py's note
            return self.tied_rows.wrap(module, args, output) if self.tied_rows.modules else None

    def _on_access(self, sp: ShardedParam, func: object) -> None:
        if not self.frames and not self._in_backward:
            return  # a forward left by a KeyboardInterrupt: abandoned.py's note
        g = sp.group
        if g is not None and self._in_backward:  # a recomputation reads it
            self.holds.pin(g)
        if g is not None and g.awaits_update:  # a zero-copy group, shown while the step's
            g.await_update()  # tail writes it (group.py's refresh_after_step), read directly
        if g is None or g.state is GroupState.UNSHARDED:
            return
        g.hold()
        with self.mode.suspended():
            self.schedule.need([g], on_demand=True)
        self.frames[-1].append(g)  # forward_context always pushed one

    def _release(self, groups: list[GatherGroup]) -> None:
        for g in groups:
            if g.unhold() and not self._in_backward:
                self.schedule.done(g)

    # -- backward ------------------------------------------------------------------------------
    def _unpack(self, saved: Kept | SavedParam) -> torch.Tensor:
        if type(saved) is Kept:
            return saved.get()
        assert type(saved) is SavedParam
        g = saved.sp.group
        if g is None:
            return saved.tensor
        frozen = self.holds.frozen(g)
        with self.mode.suspended():
            record = self.holds.unpacking(g, frozen)  # backward_holds.py's note
            # a group kept from forward is already there, but its first use in backward
            # still goes through the schedule: it advances the trace and starts prefetches
            if g.state is not GroupState.UNSHARDED or g.index in self.schedule.ahead:
                self.schedule.need([g], on_demand=True)
        record()
        return saved.tensor

    def _make_grad_hook(self, sp: ShardedParam) -> Callable[[torch.Tensor], None]:
        """The parameter's post-accumulate-grad hook. It holds these hooks weakly: torch keeps
        a tensor's hooks on the C++ side, where the garbage collector cannot see a cycle
        (parameter -> hook -> hooks -> model -> parameter), so a strong reference would keep
        a dropped model, and its swap files, alive until the process exits."""
        me = weakref.ref(self)

        def hook(_: torch.Tensor) -> None:
            hooks = me()
            if hooks is None:
                return
            if hooks._plain_backward():  # loss.backward(), not engine.backward(loss)
                hooks.refuse_plain_backward()
            g = sp.group
            assert g is not None  # grouped before install, ungrouped only after remove()
            hooks.tied_rows.add_kept(sp)  # a tied embedding's rows: tied_rows.py's note
            if g.grad_arrived(sp):
                hooks._unseen.pop(g.index, None)
                with hooks.mode.suspended():
                    hooks._reduce(g)
                    if g.holds == 0:
                        hooks.schedule.done(g)

        setattr(hook, REDUCES, True)  # surface.py's [Note: hooks on a gradient run before ...]
        return hook

    def _plain_backward(self) -> bool:
        """Whether autograd runs here in a backward no engine started (see the next note): a
        backward of another engine (a GAN's generator through the discriminator) is not."""
        return not self._in_backward and _engine_backwards == 0

    def refuse_plain_backward(self) -> NoReturn:
        refuse_plain_backward(self)  # plain_backward.py's [Note: loss.backward() is refused]

    @property
    def unseen_grad_bytes(self) -> int:
        """Gradient bytes autograd may hold where no hook sees them (see the note).

        [Note: a tied weight's gradient waits unseen]
        A weight that several modules use (a head tied to the embedding) gets its gradient in
        parts, one per use, and autograd sums them in a buffer of its own: the parameter's
        hook fires once, after the last part. That buffer exists from the first use backward
        reaches (the head, at its start) to the last (the embedding, at its end). It was 62
        MiB on gpt-335m, on top of the gradients queued for updates
        (bench/results/2026-11-26-intel-amx-bf16-small-buffers.md); a tied ``nn.Embedding``
        adds its part as rows, not as a second full buffer and a sum (tied_rows.py's note).
        The optimizer's limit on waiting gradients counts it from the start of backward until
        the weight's gradient arrives. Only weights tied between modules are known ahead: a
        module called twice in one forward, or a weight read by a function instead of its
        module, also leaves a buffer like it, and is not counted."""
        return sum(self._unseen.values())

    def _reduce(self, g: GatherGroup) -> None:
        """Start ``g``'s reduction; keep at most two in flight while backward goes on.

        [Note: another engine's backward reaches this model]
        A GAN's generator step backpropagates through the discriminator, whose gradient hooks
        then run in another engine's backward: its own never ends to finish what they start.
        Reductions left in flight were finished in its next backward, after its
        ``zero_grad()``, so at more ranks the gradients it should have dropped went into its
        next step (a GAN's losses 0.5 off PyTorch's). So outside this engine's backward a
        reduction is finished at once, and ``zero_grad()`` drops the result (or the next step
        adds it, as PyTorch accumulates)."""
        pending = g.reduce_grads()
        if pending is None or not self._in_backward:
            self._reduced(g if pending is None else pending.finish())
            return
        self.pending.append(pending)
        while len(self.pending) > 2:
            self._reduced(self.pending.popleft().finish())

    def _reduced(self, g: GatherGroup) -> None:
        if self._on_reduced is not None:
            self._on_reduced(g)

    @contextlib.contextmanager
    def backward(self, on_reduced: Callable[[GatherGroup], None] | None = None,
                 before_abort: Callable[[], None] | None = None) -> Iterator[None]:
        """Active around ``loss.backward()``: fetches become recomputations'
        (backward_holds.py's [Note: frozen groups in backward]), ``on_reduced(group)`` is
        called as each group's gradients are reduced, and on exit every reduction is finished
        (``finish_backward``). If the body or the finish raises, ``before_abort`` runs, then
        the partial backward is dropped (``abort_backward``), and the error goes on."""
        global _engine_backwards
        refuse_unfrozen(self._born_frozen)  # unfrozen.py's note
        self._in_backward, self._on_reduced = True, on_reduced
        _engine_backwards += 1
        self._unseen = dict(self._tied)
        self._sync_phase()
        self.rt.sample_working_set()  # every activation is alive now (host_memory.py's note)
        try:
            yield
            with self.mode.suspended():
                self.finish_backward()
            self.writes.check("backward", self.rt.comm)
        except BaseException:
            if before_abort is not None:
                before_abort()
            with self.mode.suspended():
                self.abort_backward()
            raise
        finally:
            self._in_backward, self._on_reduced, self._unseen = False, None, {}
            _engine_backwards -= 1
            self._sync_phase()

    def abort_backward(self) -> None:
        """Backward raised: forget its partial reductions so the next one starts clean."""
        for pending in self.pending:
            with contextlib.suppress(Exception):
                pending.finish()
        self.pending.clear()
        for g in self.groups:
            g.forget_grads_seen()
        self.tied_rows.clear()
        self.holds.clear()
        self.schedule.end_iteration()

    def forget_partial(self) -> None:
        """``zero_grad()``: a group another engine's backward reached in part starts over."""
        for g in self.groups:
            g.forget_grads_seen()

    def finish_backward(self) -> None:
        """Reduce what autograd left partial (params without grads), finish every reduction
        in flight, and release everything fetched for this iteration."""
        self._unseen = {}  # what is left is reduced here: nothing waits unseen any more
        self.tied_rows.flush()
        for g in self.groups:
            if g.has_pending_grads:
                self._reduce(g)
        while self.pending:
            self._reduced(self.pending.popleft().finish())
        self.holds.clear()
        self.schedule.end_iteration(carry=True)


_engine_backwards = 0  # backwards of any engine running now, for _plain_backward

