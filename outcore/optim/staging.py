"""Where a streamed update's bytes sit: slices of parameter shards, and the staging slots in
host memory that the update pipeline (pipeline.py) reads them into and writes them from."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from outcore.device.accel import Accelerator
from outcore.offload.buffers import aligned_empty
from outcore.zero.param import ShardedParam

if TYPE_CHECKING:
    from outcore.runtime.comm import Comm

ALIGN_ELEMS = 2048  # 8 KiB of fp32, 4 KiB of bf16/fp16: slices start on 4 KiB boundaries


@dataclass
class ShardSlice:
    """Elements ``[lo, hi)`` of one parameter's shard: the update is elementwise, so a large
    shard is streamed in pieces (optimizer.py's [Note: streamed sub-groups])."""

    sp: ShardedParam
    lo: int
    hi: int

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.lo : self.hi]


class StagingSlot:
    """Page-aligned host buffers for one sub-group in flight, allocated once and reused.

    [Note: staging without copies]
    A staged slice is placed at a multiple of ``ALIGN_ELEMS`` elements in every buffer, so
    its bytes start on a 4 KiB boundary in memory as they do in the swap file, and O_DIRECT
    moves them straight between disk and buffer: no bounce through the I/O pool and no fresh
    allocation (each of which page-faults on first touch, and the kernel zeroes every page). Three
    slots serve the pipeline: one being read, one being updated, one being written.
    """

    def __init__(self, elems: int, kinds: tuple[str, ...], cast: torch.dtype | None) -> None:
        # zero_() touches every page now, not in the first step; "grad" is where a gradient
        # held in the training dtype is cast for the update (param.py's [Note: gradients are
        # held, not copied]), not read from disk
        self.buffers = {k: aligned_empty(elems * 4).zero_().view(torch.float32) for k in kinds}
        self.cast = (aligned_empty(elems * cast.itemsize).zero_().view(cast)
                     if cast is not None else None)


def fp32_grad(grad: torch.Tensor, buffer: torch.Tensor | None, scale: float,
              keep: bool) -> torch.Tensor:
    """A slice's gradient as its update reads it: in fp32, times ``scale``.

    [Note: the gradient an update reads]
    A gradient held in fp32 is used as it is, scaled in place when ``scale`` is not 1 (its
    update frees it after). One held in the training dtype is cast into ``buffer``, the
    slot's reused "grad" buffer, so a scale applies in fp32, never in 16 bits. With ``keep``
    the gradient must stay as it was: a tentative update (speculation.py) leaves it for
    ``step()``, which may need it again for the norm, the overflow check or a redo; a scaled
    fp32 gradient then goes to ``buffer`` too. Every path multiplies in fp32 by the same
    scalar, so a tentative update that is kept equals the one the step would have made.
    """
    if grad.dtype == torch.float32 and (scale == 1.0 or not keep):
        return grad if scale == 1.0 else grad.mul_(scale)
    if grad.dtype == torch.float32 and buffer is not None:
        return torch.mul(grad, scale, out=buffer)
    fp32 = buffer.copy_(grad) if buffer is not None else grad.to(torch.float32, copy=True)
    return fp32 if scale == 1.0 else fp32.mul_(scale)


def step_counts(steps: list[int], at: torch.device, accel: Accelerator) -> list[torch.Tensor]:
    """One fp32 step count per slice (its parameter's ``steps``), on ``at``, for the Adam
    kernel to increment.

    [Note: step counts cross in one copy]
    A count made on the device one by one (``torch.tensor(step, device=cuda)``) is a copy
    from pageable memory that blocks the host until done: one stream synchronization per
    parameter and step. On an H100 (gpt-1.3b, bench/gpu/2026-11-26-h100-b) the update
    thread, overlapping backward, waited behind backward's queued kernels 293 times a step.
    Here the counts cross in one page-locked copy that does not block (torch's host cache
    keeps the block until the copy has read it); each slice increments a view of its own
    element, so a parameter cut in several slices still advances once."""
    counts = torch.tensor([float(step) for step in steps], dtype=torch.float32)
    if at.type != "cpu":  # masters in host memory keep their counts there
        counts = accel.to_device_inline(counts)
    return list(counts.unbind())


def global_norm(grads: list[torch.Tensor], dropped_sq: float, comm: Comm) -> float:
    """L2 norm over every rank's gradient shards: ``grads``, plus ``dropped_sq``, the squared
    norm of those background updates consumed and freed (padding is zero, so it adds
    nothing)."""
    local = torch.tensor([dropped_sq], dtype=torch.float64)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:  # shards on the device and in host memory are summed apart
        by_device.setdefault(g.device, []).append(g)
    for same in by_device.values():
        norms = torch._foreach_norm(same, 2, dtype=torch.float32)  # some may be bf16
        local += torch.stack(norms).double().pow(2).sum().cpu()
    return math.sqrt(float(comm.all_reduce_sum(local)))


def cut_subgroups(sps: list[ShardedParam], limit: int) -> Iterator[list[ShardSlice]]:
    """``sps``' shards cut, in order, into sub-groups of at most ``limit`` elements (a
    staging slot's), a large shard over several; each slice starts ``ALIGN_ELEMS``-aligned
    in its slot, so a sub-group ends once less than that is left."""
    chunk: list[ShardSlice] = []
    room = limit
    for sp in sps:
        lo = 0
        while lo < sp.shard_numel:
            hi = min(sp.shard_numel, lo + room)
            chunk.append(ShardSlice(sp, lo, hi))
            room -= hi - lo
            lo = hi
            if room < ALIGN_ELEMS:
                yield chunk
                chunk, room = [], limit
            else:  # keep the next slice of any parameter aligned
                room -= room % ALIGN_ELEMS
    if chunk:
        yield chunk
