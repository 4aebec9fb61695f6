"""The Engine: forward, backward and step of a ZeRO-3 sharded model.

[Note: what the engine owns]
The engine wires the parts together and owns nothing they can own themselves: parameters
and their shards (param.py), groups that move together (group.py), hooks (hooks.py), when
groups move (schedule.py), the optimizer over shards (optimizer.py) and loss scaling
(precision.py). Its own state is the step counters.

[Note: loss and gradient conventions]
``engine.backward(loss)`` divides the loss by ``gradient_accumulation_steps`` (and multiplies
by the fp16 loss scale), and gradients are averaged over ranks. So with each rank's loss the
mean over its micro-batch, one optimizer step sees the gradient of the mean loss over the
whole global batch: what one process training on all of it would see.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from outcore.config import Config, merge_mappings
from outcore.device.compute_dtype import DtypeChoice
from outcore.engine import deepspeed_names, lifetime, stepping
from outcore.engine.torch_optimizer import TorchOptimizer, adopt
from outcore.errors import (
    ConfigError,
    EngineClosedError,
    OutcoreError,
    ParamAccessError,
    StorageError,
)
from outcore.guard.lock import HeldFolders
from outcore.io import checkpoint, restore
from outcore.offload.storage import Tier
from outcore.optim import adafactor
from outcore.optim import param_groups as pgroups
from outcore.optim.optimizer import ShardedOptimizer
from outcore.optim.param_groups import check_param_groups, from_torch_optimizer, hp_keys
from outcore.optim.precision import LossScaler
from outcore.overlap.entry import EntryHooks, drop_grads, entry_modules
from outcore.overlap.hooks import Hooks
from outcore.overlap.schedule import Schedule
from outcore.runtime.plan import ExecutionPlan
from outcore.sizing import placement
from outcore.zero import build, shardable
from outcore.zero.gathered import gathered_parameters
from outcore.zero.param import ShardedParam
from outcore.zero.registry import managed, parameter_counts
from outcore.zero.wrappers import refuse_wrapper_call


def initialize(model: nn.Module, cfg: Config | dict | str | None = None,
               param_groups: Iterable[dict] | None = None,
               optimizer: torch.optim.Optimizer | None = None) -> Engine:
    """Shard ``model`` (if ``outcore.init`` did not already) and return its Engine.

    ``param_groups`` follows torch's optimizer convention: dicts with ``"params"`` and any of
    ``lr, betas, eps, weight_decay, momentum, nesterov`` overriding the config's optimizer.
    ``optimizer``: a ``torch.optim.AdamW``, ``Adam`` or ``SGD`` over the model's parameters,
    whose type, hyper-parameters and groups the engine adopts instead (param_groups.py's
    [Note: adopting a torch optimizer]); schedulers bound to it keep working.
    """
    return Engine(model, cfg, param_groups, optimizer)


class Engine(deepspeed_names.DeepSpeedNames):
    """A sharded model with its optimizer; call it like the module."""

    def __init__(self, module: nn.Module, cfg: Config | dict | str | None = None,
                 param_groups: Iterable[dict] | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        shardable.check_model(module)  # a module, of parameters outcore can shard
        cfg = Config.load(cfg)
        self.module = module
        self._closed: str | None = None  # why the engine cannot be used, once it cannot
        self._via: torch.optim.Optimizer | None = None  # the optimizer step() runs through now
        self._reached = False  # whether its step() came back to update (stepping.py)
        self.failed_backward = False  # the last backward raised (stepping.py's update)
        if optimizer is not None:
            if param_groups is not None:
                raise ConfigError("pass param_groups or a torch optimizer to adopt, not both")
            keys, param_groups = from_torch_optimizer(optimizer)
            cfg = Config.from_dict(merge_mappings(cfg.model_dump(), {"optimizer": keys}))
        if cfg.optimizer.type == "adafactor":
            adafactor.check_placement(cfg.offload.optimizer)
        # what groups are completed with, and the facade's ``defaults``: an adopted
        # optimizer's own (its groups get no keys of another optimizer's), else the config's
        self.optimizer_defaults = (dict(optimizer.defaults) if optimizer is not None else {
            k: getattr(cfg.optimizer, k) for k in hp_keys(cfg.optimizer.type)})
        groups = check_param_groups(module, param_groups, cfg.optimizer)
        total, trainable = parameter_counts(module)
        fraction = trainable / total if total else 1.0  # host_memory.py: a frozen base
        self.rt, own_runtime = lifetime.runtime_for(module, cfg, fraction)
        self.cfg = self.rt.cfg  # dtype resolved for the device (compute_dtype.py's note)
        self.adopted_optimizer = optimizer
        try:
            if own_runtime:  # (a model built under outcore.init has its shards already)
                lifetime.check_swap_space(self.rt, total, trainable)
            self._build(module, self.cfg, groups)
            self.rt.begin_training(fraction)
            if optimizer is not None:  # its state goes to the shards, and its methods call
                adopt(optimizer, self.optimizer)  # the facade (torch_optimizer.py's 2nd note)
        except BaseException as err:
            # Swap files this engine cannot use any more are deleted now, not at exit: always
            # when the engine made the runtime, and on storage errors (a full disk) in any case.
            # A model built under outcore.init keeps its shards after, say, a param-group typo;
            # one this engine sharded gets its values back, plain, as it came.
            if own_runtime or isinstance(err, StorageError):
                if own_runtime:
                    for part in ("entries", "hooks"):
                        if hasattr(self, part):
                            getattr(self, part).remove()
                    lifetime.restore_buffers(getattr(self, "buffer_places", []))
                    lifetime.abandon(module, self.rt)
                self.rt.close()
            raise
        self.rt.engine = weakref.ref(self)

    def _build(self, module: nn.Module, cfg: Config,
               param_groups: list[tuple[dict, list[nn.Parameter]]] | None) -> None:
        self.params = build.shard_params(module, self.rt, prepare=False)
        self.groups, module_groups = build.build_groups(
            module, self.rt, cfg.zero.persistence_threshold_bytes)
        budget = build.prefetch_budget(cfg, self.groups, placement.nvme_fetch_share(self.rt))
        resident = build.keep_resident(self.groups, self.rt, budget)
        build.prepare_shards(self.params, resident)
        kept = sum(g.full_bytes for g in self.groups if g.index in resident)
        budget -= kept
        for g in self.groups:
            if g.zero_copy:  # its shards are the full tensors: show them once, for good
                g.wait_unshard()
        self.buffer_places = build.cast_buffers(module, self.rt)
        self.rt.adopt_prefetch_budget(budget)
        # a tentative update writes a copy the model shows in place: taken back before any
        # forward, not only one to be backpropagated (speculation.py's note)
        self._shows_tentative = self.rt.plan.speculates and any(g.zero_copy for g in self.groups)
        self.schedule = Schedule(budget, self.groups, carry=self.rt.plan.carries_head,
                                 resident_bytes=kept)
        self.sharded_optimizer = ShardedOptimizer(self._optimizer_groups(param_groups),
                                                  cfg.optimizer, self.rt)
        self.optimizer = TorchOptimizer(self)  # torch's contract: torch_optimizer.py's note
        # weakly: the registry (registry.py) reaches the runtime, and a strong path to the
        # optimizer would keep the model and its swap files alive after the user dropped both
        wait = weakref.WeakMethod(self.sharded_optimizer.wait)
        self.rt.await_updates = lambda: (w := wait()) is not None and w()
        take = weakref.WeakMethod(self.sharded_optimizer.take_back_tentative)
        self.rt.before_write = lambda: (t := take()) is not None and t()
        me = weakref.ref(self)
        self.rt.before_forward = lambda: (e := me()) is not None and e._before_forward()
        self.rt.before_overwrite = lambda what: (e := me()) is not None and e._reopen_boundary(what)
        self.rt.updated_in_backward = lambda: (e := me()) is not None and \
            e.is_accumulation_boundary and e.sharded_optimizer.updated_this_round
        opt = weakref.ref(self.sharded_optimizer)
        self.rt.is_tentative = lambda sp: (o := opt()) is not None and (
            (st := o.state.get(sp)) is not None and st.tentative)
        # zero/surface.py's [Note: p.grad stays None, and says so]
        self.rt.gradients_held = lambda: (e := me()) is not None and e.micro_steps > 0
        self.scaler = LossScaler(cfg.loss_scale, enabled=self.rt.plan.loss_scaling)
        self.hooks = Hooks(module_groups, self.groups, self.schedule, self.rt)
        cast = None
        if self.rt.compute_dtype != torch.float32 or self.rt.device.type != "cpu":
            device = self.rt.device
            dtype = None if self.rt.compute_dtype == torch.float32 else self.rt.compute_dtype
            cast = lambda inputs: build.to_compute(inputs, device, dtype)  # noqa: E731
        # model(...) and generate() called directly: entry.py's notes
        self.entries = EntryHooks(entry_modules(module), self.hooks.inside,
                                  self._forward_context,
                                  synced_generate=self.rt.world_size > 1, cast=cast,
                                  on_zero_grad=self.zero_grad, rt=self.rt)
        self.micro_steps, self.no_sync_state = 0, stepping.NoSync()
        self._at_boundary = False  # whether the last backward ended an accumulation
        self.global_steps = 0
        self.last_grad_norm: float | None = None
        self._folders = HeldFolders()  # checkpoint roots: guard/lock.py's notes

    # -- construction ------------------------------------------------------------------------
    def _optimizer_groups(self, groups: list[tuple[dict, list[nn.Parameter]]] | None
                          ) -> list[tuple[dict, list[ShardedParam]]]:
        """torch-style group dicts with their shards. A dict the user passed is the group's
        own (completed with the defaults, as torch's do): an edit of it reaches the update."""
        if groups is None:
            groups = [({"params": [sp.param for sp in self.params if sp.trainable]},
                       [sp.param for sp in self.params])]
        out = []
        for spec, params in groups:
            for key, value in self.optimizer_defaults.items():
                spec.setdefault(key, value)
            out.append((spec, [managed(p) for p in params if p.requires_grad]))
        return pgroups.check_same_groups(out, self.rt.comm)  # runtime/same_config.py's note

    # -- training ----------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward: ``engine(x)`` is ``model(x)`` (entry.py's notes)."""
        self._check_open()
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, *, scale_for_accumulation: bool = True,
                 boundary: bool | None = None, retain_graph: bool = False) -> None:
        """Backpropagate ``loss`` (see the note on loss conventions) and reduce gradients.

        ``scale_for_accumulation=False``: the caller already divided the loss for gradient
        accumulation (Hugging Face Trainer normalises by the tokens of the whole accumulated
        batch), so the engine does not divide it again. ``boundary``: whether this backward
        ends the accumulation, for a loop whose last accumulation is shorter (the end of an
        epoch); by default every ``gradient_accumulation_steps``-th backward does.
        ``retain_graph``: as torch's, for a second backward through the same graph (two losses
        of one forward: the first takes ``boundary=False``, so their gradients add up; each
        call counts as a micro-batch, so with accumulation pass ``boundary`` to the second).
        """
        self._check_open()
        self._check_nothing_shown("engine.backward()")
        self._reopen_boundary("backward()")  # its gradients add to the boundary's
        accumulation = self.cfg.gradient_accumulation_steps if scale_for_accumulation else 1
        factor = self.scaler.scale / accumulation
        scaled = loss.float() * factor if factor != 1.0 else loss
        boundary = stepping.is_boundary(self) if boundary is None else boundary
        on_reduced = (lambda g: self.sharded_optimizer.submit(
            g.trainable, unseen=self.hooks.unseen_grad_bytes,
            grad_scale=1.0 / self.scaler.scale)) if (
            boundary and self.rt.plan.overlaps_optimizer
            and self.sharded_optimizer.submits) else None
        # [Note: a failed boundary backward] Updates already started on the worker are allowed
        # to finish (they used final gradients) and stay applied, unless they are tentative
        # (speculation.py's note): those are taken back with their gradients; everything else
        # of this backward is dropped, so a retry of the step sees a consistent engine; a
        # warning names the updates that stay (stepping.py's abandon_backward).
        with self.hooks.backward(on_reduced, before_abort=lambda: stepping.abandon_backward(self)):
            scaled.backward(retain_graph=retain_graph)
        self.failed_backward = False  # (stepping.py's update)
        self.micro_steps, self._at_boundary = self.micro_steps + 1, boundary
        if boundary and self.rt.plan.overlaps_optimizer:  # optim/hyperparams.py's note
            self.sharded_optimizer.hyperparams.backward_ended(self.param_groups)

    @property
    def plan(self) -> ExecutionPlan:
        """Which code paths this run takes, and why (runtime/plan.py's [Note: one place
        decides the path]); ``print(engine.plan)`` shows every decision with its reason."""
        return self.rt.plan

    @property
    def overlaps_optimizer(self) -> bool:
        """Whether updates start during the boundary backward (optimizer.py's [Note: updating
        during backward]); the plan decides it."""
        return self.rt.plan.overlaps_optimizer

    @property
    def defers_updates(self) -> bool:
        """Whether ``step()`` may return before the last updates finish: off unless
        ``zero.overlap_step_with_forward`` asks (pipeline.py's [Note: the step's tail runs
        into the next forward])."""
        return self.rt.plan.defers_updates

    @property
    def is_accumulation_boundary(self) -> bool:
        """Whether the last backward ended an accumulation, so ``step()`` will update."""
        return self.micro_steps > 0 and self._at_boundary

    def step(self) -> bool:
        """Apply the optimizer at an accumulation boundary; True if parameters changed (the
        last updates may still be running: pipeline.py's [Note: the step's tail runs into the next
        forward]). Run as ``engine.optimizer.step()`` (or the adopted optimizer's), so torch's
        step hooks run and a scheduler bound to it counts the step, once per update; a step
        skipped for an fp16 overflow runs none, as with torch's GradScaler."""
        changed = self._update(self.adopted_optimizer or self.optimizer)
        self.optimizer.skipped = not changed  # as when engine.optimizer.step() is called
        return changed

    def _update(self, via: torch.optim.Optimizer | None = None) -> bool:
        """The update at an accumulation boundary, through ``via``'s ``step()`` or now
        (stepping.py; torch_optimizer.py's ``step()`` calls this)."""
        self._check_open()
        self._check_nothing_shown("engine.step()")
        return stepping.update(self, via)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backwards inside accumulate, as under DDP's ``no_sync`` (stepping.py's)."""
        return stepping.no_sync(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated since the last step, and any ``p.grad`` (torch's
        ``optimizer.zero_grad()``); the accumulation starts over. ``set_to_none=False``: as
        torch's, a parameter that got a gradient before and gets none in a step is still
        updated, with a zero one (optim/zero_filled.py's note). Refused after a boundary
        backward that already applied updates (optimizer.py's [Note: updating during
        backward]); tentative ones are taken back (speculation.py's [Note: a speculative step])."""
        self._check_open()
        self._reopen_boundary("zero_grad()")
        self.sharded_optimizer.zero_grad(keep=self.sharded_optimizer.pending_jobs)
        self.sharded_optimizer.zero_filled.zero_grad(set_to_none)
        self.micro_steps, self._at_boundary = 0, False
        drop_grads(self.module)  # e.g. a backward's before initialize
        self.hooks.forget_partial()  # hooks.py's [Note: another engine's backward reaches ...]

    def synchronize(self) -> None:
        """Wait for the updates the last ``step()`` or backward left running (pipeline.py's
        [Note: the step's tail runs into the next forward]): only a timer around it needs it."""
        self._check_open()
        self.sharded_optimizer.wait()

    # -- modes and inspection ----------------------------------------------------------------
    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    @property
    def rank(self) -> int:
        return self.rt.rank

    @property
    def world_size(self) -> int:
        return self.rt.world_size

    @property
    def device(self) -> torch.device:
        """The compute device: inputs go here (CUDA under torchrun on GPUs, else the CPU)."""
        return self.rt.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype in force (``dtype: auto`` resolved for this device)."""
        return self.rt.compute_dtype

    @property
    def dtype_choice(self) -> DtypeChoice:
        """The compute dtype's name, what the config asked for, and why (compute_dtype.py)."""
        return self.rt.dtype_choice

    @property
    def param_groups(self) -> list[dict]:
        """Hyper-parameters per group; edit ``lr`` here for a schedule, as with torch optimizers."""
        return self.sharded_optimizer.param_groups

    def gathered_parameters(self, params: Iterable[nn.Parameter] | nn.Module | None = None,
                            modify: bool = False, modifier_rank: int | None = None
                            ) -> contextlib.AbstractContextManager:
        """Full fp32 values in ``.data`` for the given parameters (default: all); a collective."""
        return gathered_parameters(self.module if params is None else params, modify,
                                   modifier_rank)

    def memory_report(self) -> dict[str, Any]:
        """Bytes per tier from outcore's own accounting, plus process RSS for reference."""
        led = self.rt.ledger
        return {**{t.value: led.tier_bytes(t.value) for t in Tier}, "by_kind": led.snapshot(),
                "rss": psutil.Process().memory_info().rss, "rank": self.rank,
                "world_size": self.world_size, "dtype": self.dtype_choice.to_json(),
                "schedule": self.schedule_stats(), "plan": self.plan.to_json()}

    def schedule_stats(self) -> dict[str, int]:
        """What the schedule and optimizer did: fetches, prefetch hits, divergences, re-traces,
        and how many parameter updates ran during backward versus at the step."""
        return {**self.schedule.stats(), **self.sharded_optimizer.stats}

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike[str],
                        client_state: dict[str, Any] | None = None, *,
                        replace_folder: bool = False,
                        files: Mapping[str, str | bytes | os.PathLike] | None = None) -> Path:
        """Write a complete checkpoint folder atomically (a collective: every rank calls).
        ``replace_folder``: an existing folder at ``path`` goes whole, not only the files of a
        checkpoint (io/publish.py's [Note: replacing a folder]). ``files``: name -> file to
        copy into the checkpoint beside its own (a model's ``config.json``, which
        ``outcore.consolidate`` puts beside the full weights); they are the checkpoint's, so
        a later save into ``path`` replaces them.

        From the first save into a folder's parent (the checkpoint root) until ``close()``,
        another process's engine saving into or loading from that root is refused with
        ``FolderInUseError`` (guard/lock.py's [Note: two runs, one folder])."""
        self._check_open()
        self._check_nothing_shown("save_checkpoint()")
        self._reopen_boundary("save_checkpoint()")  # half this step's updates would be saved
        path, client_state = Path(path).expanduser(), client_state or {}  # ~ as a shell reads
        copied = checkpoint.check_save_arguments(self.rt.comm, client_state, files)
        self._folders.hold(path.parent, self.rt.comm, self.rt.accel, create=True)
        try:
            return checkpoint.save(self, path, client_state, replace_folder=replace_folder,
                                   files=copied)
        finally:  # saving read every shard through the I/O pool
            self.rt.release_idle_io_buffers()

    def release_folders(self) -> None:
        """Let go of the checkpoint roots this engine holds (guard/lock.py's [Note: two
        runs, one folder]) before ``close()``: the next save takes them again. A Trainer does
        this when training ends, so the output folder holds no lock file afterwards."""
        self._folders.release_all()

    def load_checkpoint(self, path: str | os.PathLike[str],
                        keep_settings: bool = False) -> dict[str, Any]:
        """Restore weights, optimizer state, step, scaler and RNG; return the client state.

        The groups' settings (lr, betas, eps, weight decay...) come from the checkpoint, as
        with torch's ``load_state_dict``, warning of those that differ from this engine's;
        ``keep_settings=True`` keeps this engine's. The root (``path``'s parent) is held."""
        self._check_open()
        self._check_nothing_shown("load_checkpoint()")
        self._reopen_boundary("load_checkpoint()")  # step() would drop the next update
        deepspeed_names.check_keep_settings(keep_settings)  # not DeepSpeed's tag
        path = Path(path).expanduser()
        self._folders.hold(path.parent, self.rt.comm, self.rt.accel, create=False)
        try:
            return restore.load(self, path, keep_settings)
        finally:  # loading wrote every shard through the I/O pool
            self.rt.release_idle_io_buffers()

    # -- lifetime ----------------------------------------------------------------------------
    def close(self, keep_values: bool | None = None) -> None:
        """Remove the hooks, hand the model back and delete this rank's swap files; the engine
        cannot be used after (engine/lifetime.py's [Note: handing the model back]).

        ``keep_values``: True gives every parameter its trained values (a collective at more
        ranks: every rank closes); False drops them; None (default) keeps them where the model
        fits in half the memory this process may still use. An update that the last
        ``step()`` left running and that failed is raised here, after the clean-up, so a run
        ending right after its step still hears of it."""
        lifetime.close(self, keep_values)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def __repr__(self) -> str:
        """What a notebook shows for ``engine``: the model, where its states are, and whether
        the engine can still be used (and if not, why)."""
        off = self.cfg.offload
        state = "open" if self._closed is None else self._closed.removeprefix(
            "this outcore Engine ").split(" (")[0]  # "was closed", "handed its model to ..."
        return (f"<outcore Engine of {type(self.module).__name__}: {len(self.params)} "
                f"parameter tensors, rank {self.rank} of {self.world_size}, "
                f"{self.dtype_choice.name}, offload params={off.params} optimizer={off.optimizer}, "
                f"{self.global_steps} steps; {state}>")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            return self.close()
        with contextlib.suppress(Exception):  # the exception in flight is the one to see
            self.close(keep_values=False)

    def _forward_context(self) -> contextlib.AbstractContextManager[None]:
        """Opens a forward (``_before_forward``, then the hooks' phase)."""
        refuse_wrapper_call(self.module)  # zero/wrappers.py's note
        self._before_forward()
        return self.hooks.forward_context()

    def _before_forward(self) -> None:
        """After a boundary backward a forward waits for that backward's updates (they may
        write the copies it reads); one to be backpropagated takes tentative ones back, for
        ``step()`` to redo from the summed gradients (speculation.py's note), and so does any
        forward where a tentative update writes a copy the model shows. The engine's entry
        runs this, and so does a submodule called directly (hooks.py's ``_pre_forward``)."""
        if self.is_accumulation_boundary:
            if torch.is_grad_enabled() or self._shows_tentative:
                self.sharded_optimizer.take_back_tentative()
            self.sharded_optimizer.wait()

    def _reopen_boundary(self, what: str) -> None:
        """Before ``what`` between a boundary backward and ``step()``: its tentative updates
        are taken back, for ``step()`` to redo (speculation.py's note); updates applied for
        good cannot be, so ``what`` is refused (optimizer.py's [Note: updating during backward])."""
        if not self.is_accumulation_boundary:
            return
        self.sharded_optimizer.take_back_tentative()
        if self.sharded_optimizer.updated_this_round:
            raise OutcoreError(
                f"{what} between a backward and step(): this backward already applied the "
                "updates (the optimizer runs during backward with its state on NVMe, without "
                "clipping or fp16); call step() first (a backward that more micro-batches follow "
                "takes boundary=False), or set zero.overlap_optimizer: false")

    def _check_nothing_shown(self, what: str) -> None:
        """Training, saving and loading work on the shards, which a gathered context's
        copies do not follow until it exits (and then replace, with ``modify=True``)."""
        if self.rt.shown:
            raise ParamAccessError(
                f"{what} inside gathered_parameters: the context shows {self.rt.shown} "
                "parameters as copies that the shards do not follow until it exits (and that "
                "then replace them, with modify=True); call it outside the context")

    def _check_open(self) -> None:
        if self._closed is not None:
            raise EngineClosedError(self._closed)
        self.rt.drop_abandoned()  # a forward a KeyboardInterrupt left (overlap/abandoned.py)

