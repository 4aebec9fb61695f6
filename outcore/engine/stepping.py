"""``engine.step()``: the update at an accumulation boundary, run as the optimizer's step.

[Note: engine.step() is the optimizer's step]
Code written for torch optimizers watches ``optimizer.step()``: an LR scheduler counts it
(and warns "``lr_scheduler.step()`` before ``optimizer.step()``" when it never ran), step
hooks run around it (an EMA of the weights, a step counter, logging). So ``engine.step()``
goes through the optimizer a user holds, the adopted one or ``engine.optimizer``, whose
``step()`` comes back to ``update`` with no optimizer and applies the update. It goes through
once per update: not on a micro-step that updates nothing, and not on a step skipped for an
fp16 overflow, where torch's GradScaler would not call ``optimizer.step()`` either (a
scheduler is still told that a step was made, so it does not warn). A wrapper
a user put on that ``step`` which calls ``engine.step()`` again applies the update at once;
one that does not call through still gets it, after the wrapper returns.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from outcore.errors import user_stacklevel
from outcore.optim.pipeline import UpdatePipeline
from outcore.profiling import STEP, record_function

if TYPE_CHECKING:
    from outcore.engine.core import Engine


@dataclass
class NoSync:
    """``no_sync``'s state: how deep inside it, and whether the last backward was inside."""

    depth: int = 0
    pending: bool = False  # backwards inside added up: the next one outside ends them


def is_boundary(engine: Engine) -> bool:
    """Whether the next ``engine.backward()`` ends an accumulation, by default: none inside
    ``no_sync``, the first one after backwards inside it, else every
    ``gradient_accumulation_steps``-th one."""
    state = engine.no_sync_state
    if state.depth:
        state.pending = True
        return False
    if state.pending:
        state.pending = False
        return True
    return (engine.micro_steps + 1) % engine.cfg.gradient_accumulation_steps == 0


@contextlib.contextmanager
def no_sync(engine: Engine) -> Iterator[None]:
    """DDP's idiom for gradient accumulation, kept for scripts moved from it: a backward
    inside adds to the gradients and ends no accumulation (``boundary=False``), and the first
    one after it ends them all, so that its ``engine.step()`` updates from all of them,
    whatever ``gradient_accumulation_steps`` says. Under outcore every backward reduces into
    the shards, so nothing is saved by it; the config's accumulation says the same without a
    context (and divides each loss by it)."""
    engine.no_sync_state.depth += 1
    try:
        yield
    finally:
        engine.no_sync_state.depth -= 1


def update(engine: Engine, via: torch.optim.Optimizer | None) -> bool:
    """Update at an accumulation boundary, through ``via.step()`` or now (see the note); True
    if parameters changed."""
    if not engine.is_accumulation_boundary:
        if engine.failed_backward:  # set by abandon_backward; said once
            engine.failed_backward = False
            warnings.warn("outcore: step() after a backward that raised, with none completed "
                          "since: nothing was stepped (a failed backward ends no "
                          "accumulation); run the batch again, then step()",
                          stacklevel=user_stacklevel())
        return False
    if engine._via is None and _overflowed(engine):
        for opt in {id(o): o for o in (via, engine.optimizer) if o is not None}.values():
            opt._opt_called = True  # a scheduler's check: the step was made, and skipped
        return False
    if via is None or engine._via is not None:
        engine._reached = True
        with record_function(STEP):
            _apply(engine)
        return True
    engine._via, engine._reached = via, False
    try:
        via.step()
    finally:
        engine._via = None
    # the optimizer's step came back here and updated, or it did not come back: update now
    return True if engine._reached else update(engine, None)


@torch.no_grad()
def _overflowed(engine: Engine) -> bool:
    """fp16: whether a gradient is not finite on some rank; the step is then skipped and the
    scale falls (optim/precision.py)."""
    if not engine.scaler.enabled:
        return False
    sharded = engine.sharded_optimizer
    if not engine.defers_updates:  # every gradient is looked at
        sharded.wait()
    grads = [sp.grad for sp in sharded.params if sp.grad is not None]
    bad = torch.tensor([0.0 if all(bool(g.isfinite().all()) for g in grads) else 1.0])
    if engine.rt.comm.all_reduce_max(bad).item() == 0:
        return False
    engine.micro_steps, engine._at_boundary = 0, False
    engine.scaler.update(overflow=True)
    sharded.skip()  # tentative updates too (speculation.py)
    # the skipped step's norm is not finite (it kept the last step's, which read as this one's)
    if engine.cfg.gradient_clipping > 0 or engine.cfg.track_grad_norm:
        engine.last_grad_norm = float("inf")
    return True


@torch.no_grad()
def _apply(engine: Engine) -> None:
    """The update: unscale, clip by the global norm, step the shards, start the next
    iteration."""
    sharded, cfg = engine.sharded_optimizer, engine.cfg
    defer = engine.defers_updates
    if not defer:  # the norm below looks at every gradient
        sharded.wait()
    engine.micro_steps, engine._at_boundary = 0, False
    grads = [sp.grad for sp in sharded.params if sp.grad is not None]
    clip = cfg.gradient_clipping
    moved = sharded.hyperparams_moved()  # optim/hyperparams.py's note
    if engine.scaler.enabled:
        engine.scaler.unscale(((sp.grad, sharded.state[sp].tentative) for sp in sharded.params
                               if sp.grad is not None),
                              every=clip > 0 or cfg.track_grad_norm or moved)
    # the norm reads every fp32 gradient once more (a full pass over them per step), so
    # only where it is used: clipping, or the user asked to see it
    norm = sharded.global_norm(grads) if clip > 0 or cfg.track_grad_norm else None
    engine.last_grad_norm = norm
    coef = clip / (norm + 1e-6) if norm is not None and clip > 0 else 1.0
    if engine.rt.plan.speculates:  # speculation.py's [Note: a speculative step]
        sharded.conclude(fits=coef >= 1.0 and not moved)
    pending = sharded.step(defer=defer, grad_scale=coef if coef < 1.0 else 1.0)
    engine.scaler.update(overflow=False)
    sharded.zero_grad(keep=pending)
    updates = UpdatePipeline.unfinished_by_group(pending)
    for g in engine.groups:
        g.refresh_after_step(updates.get(g.index))
    engine.schedule.start_next_iteration()
    engine.global_steps += 1


def abandon_backward(engine: Engine) -> None:
    """A boundary backward raised (a Ctrl-C, a bad batch): its tentative updates are taken
    back, and the updates the optimizer already applied during it stay.

    [Note: a failed backward's applied updates]
    With the optimizer state on NVMe the optimizer updates each layer during backward, as
    soon as its gradient is final, and writes it to disk: such an update cannot be taken
    back. After an interrupted backward those layers have been trained on this batch and the
    others have not, where PyTorch's interrupted backward changes no weight. Running the same
    batch again completes the step without updating a layer twice, but its forward already
    reads those layers' new values, so the others' gradients come out close to, not equal to,
    an uninterrupted step's; skipping the batch leaves those layers trained on it. That used to
    happen without a word, so it warns, naming them."""
    engine.failed_backward = True  # for update(): a step() right after says so
    sharded = engine.sharded_optimizer
    sharded.abandon_backward()
    applied = sharded.applied_this_round
    if applied and engine.rank == 0:
        names = ", ".join(sp.label() for sp in applied[:4]) + (", ..." if len(applied) > 4 else "")
        warnings.warn(
            f"outcore: this backward failed after the optimizer had already updated "
            f"{len(applied)} of {len(sharded.state)} parameters ({names}) with its gradients "
            "(with the optimizer state on NVMe, updates run during backward and are written "
            "as they finish). Running the same batch again completes this step without updating "
            "them twice (close to an uninterrupted step: its forward sees their new values); "
            "skipping it leaves them trained on this batch. To undo them, load the last "
            "checkpoint.", stacklevel=user_stacklevel())
