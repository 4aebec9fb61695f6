"""One user parameter under sharding: its shards in their home tiers and what ``param.data`` shows.

[Note: free the storage, keep the tensor]
Each parameter owns one full-shape tensor in the compute dtype, and while outcore computes,
``param.data`` *is* that tensor. Releasing a parameter resizes the tensor's storage to zero
bytes; fetching it allocates the storage again and fills it. Swapping ``.data`` instead
would not free anything: autograd keeps views of weights for backward (``weight.t()`` inside
``linear``), and a view pins the storage it was made from. With the storage freed in place,
those saved views see the bytes vanish and, once backward fetches the group again (hooks.py
maps a saved view's storage back to its parameter), see them come back.

A released parameter still answers ``p.shape``, ``p.numel()`` and ``p.dtype`` truthfully,
so init code computing fan-in and parameter counts keeps working. What any other call on it
does is decided by its ``ParamState`` (state.py) in surface.py, never by a torch kernel
meeting a zero-byte storage. The user's ``nn.Parameter`` object is never replaced, so
optimizers, tied references and ``named_parameters`` keep pointing at the same object.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from outcore.errors import ConfigError, ParamAccessError
from outcore.offload.file_shard import FileShard
from outcore.offload.ledger import Charge, Kind
from outcore.offload.storage import CastShard, StoredShard, load_now
from outcore.offload.tier import Tier
from outcore.runtime import Runtime
from outcore.zero import registry, surface
from outcore.zero.access import dropped_message, raw_data
from outcore.zero.sharding import ShardLayout
from outcore.zero.state import PARAM_MOVES, ParamState

if TYPE_CHECKING:
    from outcore.zero.group import GatherGroup


class ShardedParam:
    """Rank-local state of one parameter: its shards, gradient, and ``ParamState``."""

    def __init__(self, param: nn.Parameter, rt: Runtime, *,
                 shards: tuple[StoredShard | None, StoredShard | None] | None = None) -> None:
        """``shards``: (master, compute) made elsewhere (zero/deferred.py reads them from the
        model's files); otherwise they are cut from ``param``'s values."""
        if not param.is_floating_point():
            shape = tuple(param.shape)
            raise ConfigError(f"cannot shard a {param.dtype} parameter of shape {shape}")
        self._param: Callable[[], nn.Parameter | None] = weakref.ref(param)
        self.rt = rt
        self.name = ""
        self.shape = param.shape
        self.numel = param.numel()
        self.dtype = param.dtype
        self.user_dtype = param.dtype  # what the model is handed back in (close())
        self.user_device = param.device  # where close() and a failed build hand it back
        self.layout = ShardLayout(self.numel, rt.world_size, rt.rank)
        self.master_shard: StoredShard | None = None
        self.compute_shard: StoredShard | None = None
        values = param.detach()
        if shards is not None:
            self.master_shard, self.compute_shard = shards
        # [Note: a parameter born frozen] outcore.init(frozen=True): values only, in the
        # training dtype, in the parameter tier; there is never an fp32 master to drop
        elif not param.requires_grad and not rt.plan.compute_is_master:
            self.compute_shard = rt.store(self.layout.cut(values, rt.compute_dtype),
                                          rt.param_tier, Kind.PARAMS)
        else:
            self.master_shard = rt.store(self.layout.cut(values, torch.float32),
                                         rt.state_tier, Kind.MASTER)
        self.grad: torch.Tensor | None = None
        self._grad_buffer: torch.Tensor | None = None  # see [Note: gradient buffers]
        self._grad_charge: Charge | None = None  # the bytes of both, on the ledger
        self.has_grad = False  # a gradient arrived since the last step
        self.group: GatherGroup | None = None  # the group that gathers it (set by the engine)
        self.shown_modify = False  # SHOWN: whether gathered_parameters writes .data back
        self.state = ParamState.SHARDED
        self.full = self._new_full(self.dtype)
        self.user_class = surface.dress(param)
        self._show(self.full)

    def _new_full(self, dtype: torch.dtype) -> torch.Tensor:
        full = torch.empty(self.shape, dtype=dtype, device=self.rt.device)
        full.untyped_storage().resize_(0)
        registry.register_storage(registry.storage_key(full), self)
        return full

    @property
    def param(self) -> nn.Parameter:
        """The user's parameter (held weakly, so a dropped model frees its shards)."""
        p = self._param()
        assert p is not None, "parameter was garbage-collected while its shard was in use"
        return p

    @property
    def alive(self) -> bool:
        """False once the parameter object is gone (e.g. replaced by a tied one)."""
        return self._param() is not None

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad

    def label(self) -> str:
        """How messages name it: its name in the model, else its shape."""
        return self.name or f"of shape {list(self.shape)}"

    # -- state moves (state.py's [Note: one state, one owner]) ---------------------------------
    def _move(self, to: ParamState) -> None:
        assert to in PARAM_MOVES[self.state], (
            f"parameter {self.label()}: {self.state.value} -> {to.value}")
        self.state = to

    def _show(self, tensor: torch.Tensor) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            self.param.data = tensor

    def alloc_full(self) -> torch.Tensor:
        """SHARDED -> FETCHING: give the full tensor storage (contents undefined). ``.data``
        already is that tensor: a SHARDED parameter always shows it."""
        self._alloc_storage()
        if self.state is ParamState.SHARDED:
            self._move(ParamState.FETCHING)
        return self.full

    def _alloc_storage(self) -> None:
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            nbytes = self.numel * self.full.element_size()
            regions = self.rt.full_regions
            if regions is not None and nbytes > 0:  # disk reads land here (buffers.py's note)
                regions.fill(storage, nbytes)
            else:
                storage.resize_(nbytes)

    def mark_gathered(self) -> None:
        """FETCHING -> GATHERED: the full tensor now holds the values."""
        if self.state is not ParamState.GATHERED:
            self._move(ParamState.GATHERED)

    def show_resident(self, view: torch.Tensor) -> None:
        """SHARDED -> GATHERED without a copy: ``view`` is the resident shard itself (group.py's
        [Note: zero-copy at world size one])."""
        self._move(ParamState.GATHERED)
        self._show(view)

    def release(self) -> None:
        """FETCHING or GATHERED -> SHARDED: free the full tensor's storage in place."""
        if self.state is ParamState.SHARDED:
            return
        assert self.state in (ParamState.FETCHING, ParamState.GATHERED), self.state
        self._free_full()
        self._move(ParamState.SHARDED)
        self._show(self.full)

    def _free_full(self) -> None:
        storage, regions = self.full.untyped_storage(), self.rt.full_regions
        if regions is not None:
            regions.release(storage)  # whoever allocated it
        else:
            storage.resize_(0)

    def show_user(self, values: torch.Tensor, modify: bool) -> None:
        """SHARDED -> SHOWN: ``gathered_parameters`` shows full fp32 ``values``."""
        self._move(ParamState.SHOWN)
        self.shown_modify = modify
        self.rt.shown += 1
        self._show(values)

    def open_for_build(self, values: torch.Tensor | None) -> None:
        """SHARDED -> BUILDING: construction code (outcore.init) works on the full tensor;
        ``values`` None means its next call overwrites every element.

        The full tensor lives on the device the model is being built on, not the compute
        device: construction code then draws its random numbers from that device's generator,
        as plain construction does (init.py's [Note: custom init sees the full tensor, and the
        same random numbers]); on a GPU host a model built on the CPU would otherwise get
        other weights from the same seed."""
        home = self.user_device
        if home.type != "meta" and home != self.rt.device:
            full = torch.empty(self.shape, dtype=self.full.dtype, device=home)
        else:
            self._alloc_storage()
            full = self.full
        if values is not None:
            full.copy_(values)
        self._move(ParamState.BUILDING)
        self._show(full)

    def end_shown(self, write_back: bool) -> None:
        """SHOWN or BUILDING -> SHARDED: cut what ``.data`` holds now back into the shards
        (``write_back``), then show the placeholder. ``.data`` may be a new tensor (after
        ``p.data = t`` or ``model.to(dtype)`` during construction)."""
        assert self.state in (ParamState.SHOWN, ParamState.BUILDING), self.state
        current = raw_data(self.param)
        if write_back:
            self.write_values(current)
        if self.state is ParamState.SHOWN:
            self.rt.shown -= 1
        if self.state is ParamState.BUILDING:
            if self.full.untyped_storage().nbytes():  # none when built on another device
                self._free_full()
            if current.dtype != self.dtype:
                self.user_dtype = current.dtype
                self.adopt_dtype(current.dtype)
        self._move(ParamState.SHARDED)
        self._show(self.full)

    def hand_back(self, values: torch.Tensor) -> None:
        """SHARDED or DROPPED -> HANDED_BACK: the parameter becomes plain again, holding
        ``values``; its shards are freed and outcore forgets it (engine.close())."""
        param = self.param
        self.free_storage()
        registry.forget_storage(registry.storage_key(self.full))
        self._move(ParamState.HANDED_BACK)
        self._show(values)
        surface.undress(param, self.user_class)
        registry.unregister(param)
        # plain again, weakly referred to by nothing (torch swaps no tensor that is)
        self.group, self._param = None, lambda: None

    def drop(self) -> None:
        """SHARDED -> DROPPED: the engine closed without keeping values (close()); the
        parameter stays a placeholder whose reads name what to do."""
        self.free_storage()
        self._move(ParamState.DROPPED)
        self.group = None

    def adopt_dtype(self, dtype: torch.dtype) -> None:
        """Switch the full tensor to ``dtype`` (the compute dtype, or a ``.to()`` during init)."""
        assert self.state in (ParamState.SHARDED, ParamState.BUILDING), self.state
        if dtype != self.full.dtype:
            registry.forget_storage(registry.storage_key(self.full))
            self.full = self._new_full(dtype)
            if self.state is ParamState.SHARDED:
                self._show(self.full)
        self.dtype = dtype

    # -- shards ---------------------------------------------------------------------------------
    def prepare_for_training(self, home: Tier | None = None) -> None:
        """Create the training-dtype shard in the parameter tier (or ``home``: build.py's
        ``keep_resident``); drop fp32 state if frozen.

        Called by every engine that takes the parameter (a second engine on the same model
        replaces the first one's training-dtype shard).

        [Note: fp32 shards are shared, not copied]
        With fp32 compute and parameters in the same tier as the optimizer state, the compute
        shard *is* the master shard: the optimizer's update is what the next forward sees.
        """
        rt = self.rt
        if self.master_shard is None:  # only 16-bit values: see [Note: a parameter born frozen]
            self._prepare_values_only()
            return
        if self.compute_shard is not None and self.compute_shard is not self.master_shard:
            self.compute_shard.free()
        if rt.plan.compute_is_master:
            self.compute_shard = self.master_shard
        elif self.trainable and rt.plan.derives_compute_copy:
            self.compute_shard = CastShard(self.master_shard, rt.compute_dtype)
        else:
            values = load_now(self.master_shard, rt.device).to(rt.compute_dtype)
            self.compute_shard = rt.store(values, home or rt.param_tier, Kind.PARAMS)
            if not self.trainable:
                self.master_shard.free()
                self.master_shard = None
        self.adopt_dtype(rt.compute_dtype)

    def _prepare_values_only(self) -> None:
        """[Note: a parameter born frozen]
        A base that LoRA will freeze can be built under ``outcore.init(cfg, frozen=True)``:
        its parameters are created with ``requires_grad=False`` and stored as they are meant to
        stay, one training-dtype shard in the parameter tier, from the first byte written.
        Built the ordinary way, every parameter would first get an fp32 master in the optimizer
        tier (4 bytes each, twice the base's 16-bit size, in host memory when the optimizer
        lives there) only to drop it when the engine finds it frozen. Such a parameter has no
        exact fp32 values to train from, so making it trainable later is refused; the same
        holds for a parameter an earlier engine kept frozen, in 16 bits only.
        """
        rt = self.rt
        assert self.compute_shard is not None
        if self.trainable:
            raise ConfigError(
                f"parameter {self.label()} holds only its {self.compute_shard.dtype} values "
                "(it was frozen when outcore sharded it: under outcore.init(frozen=True), or by "
                "an earlier engine) and is now trainable; build what you train outside frozen "
                "init (LoRA adapters are), or set requires_grad=False on it")
        shard = self.compute_shard
        # read in place, it is cast as it lands (file_shard.py), unless the engine keeps the
        # parameter in another tier; a shard of ours must be in the compute dtype
        if (shard.tier is not rt.param_tier) if shard.read_only else (
                shard.dtype != rt.compute_dtype):
            self._own_values(load_now(shard, rt.device).to(rt.compute_dtype))
        self.adopt_dtype(rt.compute_dtype)

    def move_to(self, rt: Runtime) -> None:
        """Re-home the shards in ``rt``'s tiers (a new engine with another placement takes
        the model over): the values move, the training-dtype copy is rebuilt by
        ``prepare_for_training``. The layout is the same: one process, one world size."""
        assert self.state is ParamState.SHARDED, self.state
        self.release_grads()
        if self.master_shard is not None:
            if self.compute_shard is not None and self.compute_shard is not self.master_shard:
                self.compute_shard.free()
            self.compute_shard = None
            values = load_now(self.master_shard, rt.device)
            self.master_shard.free()
            self.master_shard = rt.store(values, rt.state_tier, Kind.MASTER)
        else:
            assert self.compute_shard is not None
            if isinstance(self.compute_shard, FileShard) and rt.param_tier is Tier.NVME:
                self.compute_shard = self.compute_shard.rehome(rt.reader)  # still in place
            else:
                values = load_now(self.compute_shard, rt.device)
                self.compute_shard.free()
                self.compute_shard = rt.store(values, rt.param_tier, Kind.PARAMS)
        self.rt = rt

    # -- gradients ------------------------------------------------------------------------------
    def add_grad(self, shard_grad: torch.Tensor, owned: bool = False) -> None:
        """Accumulate one backward's reduced gradient into this parameter's gradient shard.

        ``owned``: nothing else reads or writes ``shard_grad`` after this call (autograd's
        gradient once ``param.grad`` is dropped, or a slice of a reduce-scatter's output).

        [Note: gradient buffers]
        Where the optimizer state is in memory the step needs every gradient shard at once
        anyway, so the fp32 buffer is allocated by the first backward and kept: later steps
        overwrite it instead of page-faulting a fresh one in, every page zeroed anew. With
        the optimizer on NVMe the shard is allocated when the first gradient arrives and freed
        as soon as the update consumed it (``drop_grad``), which bounds host memory.

        [Note: gradients are held, not copied]
        With the optimizer on NVMe an owned gradient is not copied at all: the shard *is* that
        tensor until the update reads it. At one rank on the host that is autograd's own
        gradient, in backward's dtype, which the update casts slice by slice into a reused
        staging buffer (optimizer.py); copying it into a fresh fp32 tensor instead costs twice
        its bytes in new memory each step, every page of it a page fault (measured:
        bench/results/2026-11-22-intel-amx-bf16-training-held-gradients.md). The values the
        update sees are the same (a bf16 to fp32 cast is exact). At more ranks it is the
        parameter's slice of the reduce-scatter's fp32 output (where the state is in memory,
        that slice becomes the kept buffer of the note above). A second gradient (accumulation)
        first turns the shard into fp32, and where fp16 unscaling will scale gradients in place,
        a 16-bit gradient is cast on arrival as before (clipping scales a gradient in fp32 as
        its update reads it: staging.py's [Note: the gradient an update reads]).
        """
        # the first gradient is taken or copied (cast) rather than added to zeros
        if self.grad is None and self._grad_buffer is not None:
            self.grad = self._grad_buffer.copy_(_crossing(shard_grad, self._grad_buffer))
        elif self.grad is None:
            if owned and shard_grad.device == self.rt.grad_device and (
                    shard_grad.dtype == torch.float32 or self.rt.plan.holds_raw_grads):
                self.grad = shard_grad
            elif self.rt.plan.keeps_grad_buffers and self._pins_grads():
                # kept from step to step: page-locked once (context.py's [Note: training
                # copies in host memory are page-locked on an accelerator])
                assert self.rt.pinned is not None  # _pins_grads
                buf = self.rt.pinned.empty(shard_grad.shape, torch.float32)
                self.grad = buf.copy_(_crossing(shard_grad, buf))
            else:
                self.grad = shard_grad.to(self.rt.grad_device, torch.float32, copy=True)
            if self.rt.plan.keeps_grad_buffers:
                self._grad_buffer = self.grad
            self._count_grads()
        else:
            if self.grad.dtype != torch.float32:  # accumulation always runs in fp32
                held = self.grad
                self.grad = held.to(torch.float32)
                self._count_grads()
            self.grad.add_(shard_grad.to(self.grad.device))  # a device gradient, host shard
        self.has_grad = True

    def drop_grad(self) -> None:
        self.grad = None
        self.has_grad = False
        self._count_grads()

    def _pins_grads(self) -> bool:
        """Gradient shards on the host of a GPU: their kept buffers are page-locked, so a
        device gradient crosses at the link's speed."""
        return self.rt.pinned is not None and self.rt.grad_device.type == "cpu"

    def _count_grads(self) -> None:
        """Put the gradient bytes it holds now (the kept buffer, else the gradient) on the
        ledger (offload/ledger.py's [Note: a charge belongs to its owner])."""
        held = self._grad_buffer if self._grad_buffer is not None else self.grad
        nbytes = 0 if held is None else held.nbytes
        if self._grad_charge is None and nbytes:
            self._grad_charge = self.rt.ledger.charge(self.rt.plan.grad_tier, Kind.GRADS)
        if self._grad_charge is not None:
            self._grad_charge.set(nbytes)

    def stored_shards(self) -> list[StoredShard]:
        """Its stored shards, each once (the master is also the compute shard in fp32 runs)."""
        return list({id(s): s for s in (self.master_shard, self.compute_shard)
                     if s is not None}.values())

    def release_grads(self) -> None:
        """Drop the gradient and the kept gradient buffer (the engine lets go of the model)."""
        self._grad_buffer = None
        self.drop_grad()

    def free_storage(self) -> None:
        """Give back every shard's bytes (the parameter is gone, dropped or handed back)."""
        self.release_grads()
        for stored in self.stored_shards():
            stored.free()
        self.master_shard = self.compute_shard = None

    # -- values ---------------------------------------------------------------------------------
    def check_values(self) -> None:
        if self.state is ParamState.DROPPED:
            raise ParamAccessError(dropped_message(self))
        self.rt.await_updates()  # updates submitted during backward
        if self.group is not None:
            self.group.await_update()  # the step may have returned with updates running

    def values_shard(self) -> torch.Tensor:
        """This rank's shard of the parameter's exact values (fp32 master when there is one)."""
        self.check_values()
        src = self.master_shard if self.master_shard is not None else self.compute_shard
        assert src is not None
        # on the compute device (collectives and reads run there), whatever the shard's tier
        return load_now(src, self.rt.device).to(self.rt.device, torch.float32)

    def gather_values(self) -> torch.Tensor:
        """The full parameter in fp32, assembled by all-gather (a collective: all ranks call)."""
        shard = self.values_shard()
        out = torch.empty(self.layout.padded_numel, dtype=torch.float32, device=self.rt.device)
        self.rt.comm.all_gather(out, shard.contiguous()).wait()
        return out[: self.numel].view(self.shape)

    def read_value(self, exact: bool = False) -> torch.Tensor:
        """A new tensor with the full values (one rank): in its dtype, or fp32 with ``exact``."""
        assert self.rt.world_size == 1
        self.check_values()
        master = exact or self.rt.is_tentative(self)  # a tentative update: the master is as it was
        src = self.master_shard if master and self.master_shard is not None else (
            self.compute_shard if self.compute_shard is not None else self.master_shard)
        assert src is not None
        t = load_now(src, self.rt.device)
        if src.resident() is not None or t.dtype != (torch.float32 if exact else self.dtype):
            # a new tensor on the compute device: a host shard is copied there too
            t = t.to(self.rt.device, torch.float32 if exact else self.dtype, copy=True)
        return t[: self.numel].view(self.shape)

    def local_values(self) -> torch.Tensor:
        """A full-shape fp32 tensor whose slice of this rank holds its values, the rest zero:
        enough for a write that overwrites whatever it touches (no collective)."""
        full = torch.zeros(self.shape, dtype=torch.float32, device=self.rt.device)
        self.layout.paste(full, self.values_shard())
        return full

    def write_values(self, full: torch.Tensor) -> None:
        """Replace this rank's shard with its slice of ``full`` (master and compute shards)."""
        self.write_shard(self.layout.cut(full.to(self.rt.device), torch.float32))

    def write_shard(self, shard: torch.Tensor) -> None:
        """Replace this rank's shard (fp32, ``shard_numel`` long, zero padding) everywhere."""
        self.rt.before_write()
        if self.master_shard is not None:
            self.master_shard.save(shard).result()
        if self.compute_shard is not None and self.compute_shard.read_only:
            self._own_values(shard.to(self.rt.compute_dtype))
        elif (self.compute_shard is not None and self.compute_shard is not self.master_shard
              and not isinstance(self.compute_shard, CastShard)):  # a cast follows by itself
            self.compute_shard.save(shard.to(self.compute_shard.dtype)).result()

    def _own_values(self, shard: torch.Tensor) -> None:
        """A parameter read in place from the model's file gets a shard of its own holding
        ``shard`` (file_shard.py: outcore never writes the user's files)."""
        assert self.compute_shard is not None
        self.compute_shard.free()
        self.compute_shard = self.rt.store(shard, self.rt.param_tier, Kind.PARAMS)

    def overwrite(self, shard: torch.Tensor) -> None:
        """Write new values between steps (a user's write, a weight load): the old values' full
        tensors and prefetches are dropped first, a group kept gathered is fetched again."""
        self.rt.before_overwrite(f"a write to parameter {self.label()}")
        self.check_values()
        group = self.group
        if group is not None:
            group.reshard()  # waits for reads of the old shard still in flight
        self.write_shard(shard)
        if group is not None:
            group.refresh_after_step()


def _crossing(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``src`` ready to be copied into ``dst`` on another device: cast where it is first, so
    the copy moves ``dst``'s dtype straight into ``dst`` rather than through a temporary."""
    return src if src.device == dst.device else src.to(dst.dtype)
