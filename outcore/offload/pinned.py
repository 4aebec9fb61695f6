"""Page-locked host memory for shards that cross to the device every step.

[Note: one page-locked block holds many shards]
torch's page-locked allocator (``pin_memory=True``) rounds every request up to a power of
two, so pinning each shard by itself can take up to twice its bytes: a 4096 x 11008 bf16
weight of 86 MiB takes 128 MiB, and over a model the waste is a third or more of the pinned
bytes. The shards that are page-locked (runtime/context.py's [Note: training copies in host
memory are page-locked on an accelerator]) are made when the model is built and live until
the engine closes, so they are cut one after another from blocks of ``BLOCK_BYTES``, a
power of two the rounding leaves whole; a shard larger than half a block gets a block of its
own (rounded, as before). What is lost is the unused tail of each block. A block lives as
long as any shard cut from it (the shards are views of it), so the bytes of a shard dropped
early (a dtype change, a second engine with another placement) are not reused until all
its neighbours are gone too.
"""

from __future__ import annotations

import math

import torch

BLOCK_BYTES = 256 << 20
ALIGN_BYTES = 512  # any dtype's alignment, and the copy engine's preferred one


class PinnedArena:
    """Hands out host tensors cut from large page-locked blocks (see the note)."""

    def __init__(self, pin: bool = True, block_bytes: int = BLOCK_BYTES) -> None:
        """``pin=False`` gives ordinary memory with the same layout (tests on a CPU)."""
        self._pin, self._block_bytes = pin, block_bytes
        self._block: torch.Tensor | None = None
        self._used = 0
        self.reserved_bytes = 0  # every block's size: what the arena holds from the system

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous tensor in page-locked host memory."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0 or nbytes > self._block_bytes // 2:
            own = self._new_block(nbytes)
            return own.view(dtype).view(shape)
        start = -(-self._used // ALIGN_BYTES) * ALIGN_BYTES
        if self._block is None or start + nbytes > self._block.numel():
            self._block, start = self._new_block(self._block_bytes), 0
        self._used = start + nbytes
        return self._block[start : start + nbytes].view(dtype).view(shape)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked copy of ``tensor`` (from any device)."""
        out = self.empty(tensor.shape, tensor.dtype)
        out.copy_(tensor)
        return out

    def _new_block(self, nbytes: int) -> torch.Tensor:
        self.reserved_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
