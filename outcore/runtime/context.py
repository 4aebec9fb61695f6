"""Per-process services shared by ``outcore.init`` and the engine.

[Note: explicit context, one per model]
The runtime holds what every shard needs to move its bytes: the rank and collectives, the
compute device seam, the byte ledger, and (only when some tier is NVMe) this rank's swap
store with its I/O threads and host buffer pool. It is created by ``outcore.init`` (so a model
can be sharded while it is built) or by ``outcore.initialize`` for a model built in plain
PyTorch, and every ``ShardedParam`` points at it; there are no module-level globals.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import psutil
import torch

from outcore.config import Config
from outcore.device.accel import Accelerator
from outcore.device.compute_dtype import DtypeChoice, resolve
from outcore.device.torch_version import check_torch
from outcore.offload.aio import AioEngine
from outcore.offload.buffers import AlignedRegions, BufferPool
from outcore.offload.host_memory import (
    MOSTLY_FROZEN,
    REUSE_ROOM,
    bound_reused_top,
    keep_freed_memory_for_reuse,
    return_large_frees_to_os,
    reuse_fits,
    reuse_freed_memory_on_small_host,
)
from outcore.offload.ledger import Kind
from outcore.offload.nvme import NvmeStore
from outcore.offload.pinned import PinnedArena
from outcore.offload.source_file import SourceReader
from outcore.offload.stale import remove_stale_swap
from outcore.offload.storage import Ledger, MemoryShard, NvmeShard, StoredShard, Tier
from outcore.runtime.bootstrap import join_world, ranks_on_this_host
from outcore.runtime.phase import Phase
from outcore.runtime.plan import ExecutionPlan
from outcore.runtime.same_config import check_same_config
from outcore.units import format_bytes

log = logging.getLogger("outcore")


class Runtime:
    """Services for one sharded model on one rank; see the note above."""

    def __init__(self, cfg: Config, *, trainable_fraction: float = 1.0) -> None:
        """``trainable_fraction``: the share of the model to be built that trains, where the
        builder knows it (0 under ``outcore.init(frozen=True)``): host_memory.py's [Note: a
        frozen base does not size the host]."""
        check_torch()
        self.accel = Accelerator.detect()
        self.dtype_choice: DtypeChoice = resolve(cfg.dtype, self.accel.device)
        self.cfg = cfg = cfg.with_dtype(self.dtype_choice.name)  # compute_dtype.py's note
        self.comm = join_world(self.accel.backend, cfg.comm.timeout_s)
        check_same_config(cfg, self.comm)  # same_config.py's [Note: every rank runs one config]
        self.ledger = Ledger()
        self.compute_dtype = self.dtype_choice.torch_dtype
        self.plan = self._derive_plan(cfg)
        # host_memory.py's notes
        reuse = cfg.offload.reuse_freed_memory
        self.frozen_base = self._frozen_base_on_disk(trainable_fraction)
        if self.state_tier is Tier.NVME or reuse is False or (reuse is None and self.frozen_base):
            return_large_frees_to_os()  # reuse, if asked, starts in begin_training
        elif self.plan.state_in_host_memory:
            keep_freed_memory_for_reuse(force=reuse is True)
        self.reusing = False  # freed memory is kept for reuse (host_memory.py's notes)
        self.prefetch_budget: int | None = None  # the engine's, once it adopts one
        self.full_regions = self._full_regions()
        # page-locked blocks for host shards that cross to the device every step
        self.pinned = PinnedArena() if self.accel.pin_host_buffers else None
        self._nvme = None
        self._aio: AioEngine | None = None
        self._reader: SourceReader | None = None
        self.closed = False
        self.phase = Phase.IDLE  # moved only by the engine's hooks (state.py's note)
        # the engine's hooks put theirs (zero/forward_writes.py's WriteWatch); None: no engine
        self.write_watch: Any = None
        # closes a forward left by a KeyboardInterrupt (overlap/abandoned.py): the hooks'
        self.drop_abandoned: Callable[[], bool] = lambda: False
        self.shown = 0  # parameters gathered_parameters shows now (ShardedParam keeps it)
        # while the model's state_dict() runs: each parameter's first read, by id of its
        # ShardedParam (zero/shared_reads.py's note)
        self.shared_reads: dict[int, Any] | None = None
        # waits for optimizer updates still running on shards (the engine sets it): a user's
        # read or write of values between a backward and step() must not meet one midway
        self.await_updates: Callable[[], None] = lambda: None
        # runs before any write of values: tentative updates computed from the values it
        # replaces are taken back (the engine sets it: optim/speculation.py's note)
        self.before_write: Callable[[], None] = lambda: None
        # runs before a user's write of values (named by the argument): refused between a
        # backward that already applied its updates and step() (engine/core.py's
        # _reopen_boundary), since step() could not apply them on top of the write
        self.before_overwrite: Callable[[str], None] = lambda what: None
        # whether a boundary backward has applied updates step() has not yet closed (the
        # engine sets it): full tensors gathered before them, as a carried head's, are stale
        self.updated_in_backward: Callable[[], bool] = lambda: False
        # runs where a forward begins outside the engine's entry (a submodule called directly):
        # what the engine's own forward does first (engine/core.py's _before_forward)
        self.before_forward: Callable[[], None] = lambda: None
        # whether a tentative update of the parameter is outstanding (optim/speculation.py)
        self.is_tentative: Callable[[Any], bool] = lambda sp: False
        self.engine = None  # weakref to the Engine training this model, if any
        # a model load's trial run at more ranks: writes to shards are checked, not made
        # (zero/load_agreement.py)
        self.trial_load = False
        # whether a backward ran since the last step() or zero_grad() (the engine sets it):
        # torch would show p.grad there (zero/surface.py's [Note: p.grad stays None, and says so])
        self.gradients_held: Callable[[], bool] = lambda: False
        self.grad_read_warned = False  # that read was named once for the engine (surface.py)
        # the most RSS seen in the first step, while reuse of freed memory waits for it
        self.working_set: int | None = None
        if Tier.NVME in (self.param_tier, self.state_tier):
            # a bad nvme_path fails the build, even where nothing may be written for a while
            # (trainable parameters cast from masters in memory store nothing: CastShard)
            self.nvme  # noqa: B018 - creates the store

    def _derive_plan(self, cfg: Config) -> ExecutionPlan:
        return ExecutionPlan.for_config(cfg, self.world_size, self.device.type,
                                        aligned_regions=AlignedRegions.supported())

    @property
    def param_tier(self) -> Tier:
        return self.plan.inputs.params

    @property
    def state_tier(self) -> Tier:
        return self.plan.inputs.optimizer

    @property
    def grad_device(self) -> torch.device:
        """Where gradient shards live (the plan's ``grad_tier``) as a torch device."""
        return self.device if self.plan.grad_tier is Tier.DEVICE else torch.device("cpu")

    @property
    def device(self) -> torch.device:
        return self.accel.device

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def nvme(self):
        """This rank's swap store: made with the runtime where a placement names NVMe (only
        those need it), else on first use."""
        if self._nvme is None:
            off = self.cfg.offload
            assert off.nvme_path is not None  # guaranteed by Config validation
            remove_stale_swap(off.nvme_path)
            engine = self.aio
            pool_bytes = off.host_buffer_bytes - self.staging_bytes
            buffer_bytes = min(off.io_block_bytes, pool_bytes)
            pool = BufferPool(pool_bytes, buffer_bytes, pin=self.accel.pin_host_buffers)
            self._nvme = NvmeStore(off.nvme_path, rank=self.rank, engine=engine, pool=pool)
            self._pool_charge = self.ledger.charge(Tier.HOST, Kind.IO_BUFFERS, pool.capacity_bytes)
        return self._nvme

    @property
    def aio(self) -> AioEngine:
        """The I/O threads, shared by the swap store and the base files' reader."""
        if self._aio is None:
            off = self.cfg.offload
            self._aio = AioEngine(threads=off.io_threads, block_bytes=off.io_block_bytes)
        return self._aio

    @property
    def reader(self) -> SourceReader:
        """Reads a frozen base from the model's own files (source_file.py's [Note: the base
        stays where it is]), created on first use."""
        if self._reader is None:
            self._reader = SourceReader(self.aio, pin=self.accel.pin_host_buffers)
            self._reader_charge = self.ledger.charge(Tier.HOST, Kind.IO_BUFFERS,
                                                     self._reader.capacity_bytes)
        return self._reader

    def _full_regions(self) -> AlignedRegions | None:
        """Aligned memory for full tensors where disk reads land in them: one rank, params
        on NVMe (buffers.py's [Note: aligned memory under a storage ...])."""
        if not self.plan.aligned_full:
            return None
        return AlignedRegions(self._region_cap(),
                              self.ledger.charge(Tier.HOST, Kind.PARAM_CACHE))

    def adopt_prefetch_budget(self, budget: int) -> None:
        """The engine's prefetch budget, which may have grown past ``zero.prefetch_bytes``
        (zero/build.py's notes): the memory kept for full tensors follows it."""
        self.prefetch_budget = budget
        self._resize_regions()

    def _resize_regions(self) -> None:
        if self.full_regions is not None:
            self.full_regions.set_cap(self._region_cap())

    def _region_cap(self) -> int:
        """[Note: kept full-tensor memory follows the budget]
        A released full tensor's memory is kept for the next one of its size, up to this
        cap; beyond it, it is unmapped and the next fill maps fresh memory, which the O_DIRECT
        read into it then faults in page by page. The cap is a share of the prefetch budget
        the engine runs with (which grows past the configured value with params on NVMe),
        not of the configured value: twice the budget where the host has room (the optimizer
        state in host memory, sized for 8x the parameters, unless a frozen base on disk is the
        bulk of the model; or freed memory kept for reuse, host_memory.py's notes), half of
        it on a small host; at least a few layers' worth either way. A cap of half or one
        budget still maps fresh memory for many fills (everything on NVMe, a 256 MiB budget
        forced: 34 and 7 a step, 2 budgets none). Capped at the configured 128 MiB's half
        while the budget had grown to ~1.1 GiB, gpt-335m with everything on NVMe mapped 610
        MiB afresh every step, and its I/O threads spent 0.73-1.20 CPU-s a step in the
        kernel, most of it faulting them in; kept, 0.21-0.26
        (bench/results/2026-11-26-intel-amx-bf16-fault-free-steps.md)."""
        budget = (self.cfg.zero.prefetch_bytes if self.prefetch_budget is None
                  else self.prefetch_budget)
        roomy = self.reusing or (self.state_tier is not Tier.NVME and not self.frozen_base)
        return max(2 * budget if roomy else budget // 2, 32 << 20)

    @property
    def staging_bytes(self) -> int:
        """The optimizer's share of ``offload.host_buffer_bytes``; the I/O pool gets the rest.

        [Note: one host budget, two users]
        Two things stage NVMe bytes in host memory: the I/O pool (transfers of memory that is
        not page-aligned: ragged tails, shards built or checkpointed outside the hot path) and
        the optimizer's sub-group buffers (master weights, moments and the cast
        training-dtype copy of a slice). Both are allocated once and reused, so every step
        runs without page faults, and together they never exceed the one budget the user set:
        the optimizer takes half when it streams anything from NVMe, nothing otherwise. (One
        exception: the optimizer's three buffers hold at least 2048 elements each, a few
        hundred KB, so a budget below that is exceeded by the difference.)
        """
        return self.cfg.offload.host_buffer_bytes // 2 // 4096 * 4096 if self.plan.streams else 0

    def store(self, tensor: torch.Tensor, tier: Tier, kind: Kind) -> StoredShard:
        """Give ``tensor``'s bytes a home in ``tier`` (memory tiers keep the tensor itself when
        it is already there; host and disk tiers take a copy of a device tensor in host
        memory)."""
        # what the device reads every step: the training copies (the masters themselves in
        # fp32), page-locked: see _page_locked's note
        crosses = kind is Kind.PARAMS or (kind is Kind.MASTER and self.plan.compute_is_master)
        if tier is Tier.HOST and crosses and self.pinned is not None:
            tensor = _page_locked(tensor, self.pinned)
        elif tier is not Tier.DEVICE and tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        if tier is Tier.NVME:
            stored = NvmeShard(self.nvme, tensor.numel(), tensor.dtype, kind, self.ledger,
                                verify=self.cfg.offload.verify_swap)
            stored.save(tensor).result()
            return stored
        if tier is Tier.DEVICE and tensor.device != self.device:
            tensor = tensor.to(self.device)
        return MemoryShard(tensor, tier, kind, self.ledger)

    def begin_training(self, trainable_fraction: float = 1.0) -> None:
        """Once the model is built: give back the I/O pool's pages (buffers.py's [Note: a
        pool idle in training keeps no pages]), and apply ``offload.reuse_freed_memory: true``
        where the host is not sized for the optimizer state (on NVMe or in device memory):
        building the model under that policy would leave the heap holding what the build
        allocated and freed (host_memory.py's [Note: reuse on a small host, when asked]).
        Where reuse is asked for or left to decide, the first step is awaited: it decides an
        unset key, and sizes the heap's kept top either way (host_memory.py's notes)."""
        self.release_idle_io_buffers()
        reuse = self.cfg.offload.reuse_freed_memory
        self.frozen_base = self._frozen_base_on_disk(trainable_fraction)
        if not self.plan.state_in_host_memory and reuse:
            self._start_reuse()
            self.working_set = 0
        elif reuse is None and self.frozen_base:
            return_large_frees_to_os()
        elif reuse is None and not self.plan.state_in_host_memory:
            self.working_set = 0  # host_memory.py's [Note: reuse decided by the first step]
        self._resize_regions()

    def sample_working_set(self) -> None:
        """Note this process's RSS while the first step holds the most (the start of its
        backward and of its step), until ``settle_reuse`` decides."""
        if self.working_set is not None:
            self.working_set = max(self.working_set, psutil.Process().memory_info().rss)

    def settle_reuse(self, available: int) -> None:
        """After the first step: keep freed memory for reuse if ``available`` bytes (this
        host's, shared by its ranks) leave room for it (host_memory.py's [Note: reuse decided
        by the first step]), and bound the heap's kept top by that room, also where the
        config asked for reuse (the note before it); decided once."""
        if self.working_set is None:
            return
        held, self.working_set = self.working_set, None
        room = available // ranks_on_this_host()
        if not self.cfg.offload.reuse_freed_memory:  # asked for, the room only bounds the top
            if not reuse_fits(held, room):
                log.info("outcore: the first step held %s with %s available: freed memory "
                         "goes back to the system", format_bytes(held), format_bytes(room))
                return
            self._start_reuse()
            log.info("outcore: the first step held %s with %s available: freed memory is kept "
                     "for reuse (offload.reuse_freed_memory: false keeps giving it back)",
                     format_bytes(held), format_bytes(room))
        bound_reused_top(room // REUSE_ROOM)

    def _start_reuse(self) -> None:
        """Keep freed memory for reuse: the heap's (glibc only) and the full tensors' (the
        note at ``_region_cap``)."""
        reuse_freed_memory_on_small_host()
        self.reusing = True
        self._resize_regions()

    def _frozen_base_on_disk(self, trainable_fraction: float) -> bool:
        """A mostly frozen model with its parameters on NVMe: the host is not sized for it
        (host_memory.py's [Note: a frozen base does not size the host])."""
        return trainable_fraction < MOSTLY_FROZEN and self.param_tier is Tier.NVME

    def release_idle_io_buffers(self) -> None:
        """Give back the pages of I/O pool buffers nobody holds, after work that staged much
        through the pool (building the model, checkpoints): buffers.py's [Note: a pool idle
        in training keeps no pages]."""
        if self._nvme is not None:
            self._nvme.pool.release_idle()

    def reconfigure(self, cfg: Config) -> Config:
        """Adopt the engine's config (same placement, possibly another dtype or optimizer);
        returns it with its dtype resolved for this device."""
        if cfg.dtype != self.dtype_choice.requested:
            self.dtype_choice = resolve(cfg.dtype, self.accel.device)
        self.cfg = cfg = cfg.with_dtype(self.dtype_choice.name)
        self.compute_dtype = self.dtype_choice.torch_dtype
        self.plan = self._derive_plan(cfg)
        self._resize_regions()
        return cfg

    def close(self) -> None:
        """Release the swap store (its files are deleted) and stop its I/O threads; safe to
        call twice. The threads end here, not when the last shard that points at the store is
        collected: a run that failed on its disk leaves no thread behind."""
        if self._nvme is not None:
            self._nvme.close()
            self._pool_charge.release()
            self._nvme = None
        if self._reader is not None:
            self._reader.close()
            self._reader_charge.release()
            self._reader = None
        if self._aio is not None:
            self._aio.close()
            self._aio = None
        self.closed = True


def _page_locked(tensor: torch.Tensor, arena: PinnedArena) -> torch.Tensor:
    """[Note: training copies in host memory are page-locked on an accelerator]
    A parameter's training copy in host memory crosses to the device at every fetch, twice a
    step. From pageable memory that copy is synchronous and runs at a fraction of the link's
    speed: measured on an H200 (bench/gpu/2026-11-26-h200-b), gpt-1.3b with params and optimizer
    in host memory spent 0.38 s in forward against 0.036 s without offload, 2.56 GB crossing
    at ~7 GB/s against the link's 55 GB/s page-locked. So these shards are page-locked (in
    fp32 the masters are the training copies: those), and at one rank the group's fetch
    issues their copies on the copy stream (group.py, ``_pinned``), where they overlap
    compute; at more ranks they fill the all-gather's send buffer. The gradient buffers kept
    in host memory from step to step (state in memory) cross the other way every step and are
    page-locked when first made (``ShardedParam.add_grad``). Masters in 16-bit runs and the
    optimizer state are read by the host's optimizer only: locking them would take the host's
    pages from everything else for nothing. The
    page-locked tensors are cut from large blocks (pinned.py's [Note: one page-locked block
    holds many shards])."""
    if tensor.device.type == "cpu" and tensor.is_pinned():
        return tensor
    return arena.copy(tensor)
