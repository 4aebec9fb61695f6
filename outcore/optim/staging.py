"""Where a streamed update's bytes sit: slices of parameter shards, and the staging slots in
host memory that the update pipeline (pipeline.py) reads them into and writes them from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from outcore.offload.buffers import aligned_empty
from outcore.zero.param import ShardedParam

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
