"""A group's collectives as free functions, with the copy-in and copy-out spelled out.

[Note: packed collectives, copy-in and copy-out]
A group moves its parameters in one collective each way (group.py's [Note: one collective
per group]). The packing is the same in both directions: every rank's block of the packed
buffer holds, at the parameter's offset, that rank's shard of each parameter, padded to
``shard_numel`` (``ShardLayout.valid_numel_of`` says how much of rank r's slice is real).

* all-gather: this rank's shards are already packed by their reads (copy-in happens where
  the bytes land, so no extra pass); ``all_gather_blocks`` fills a ``(W, shard_numel)``
  buffer and ``copy_out_full`` cuts each rank's block into the parameters' full tensors.
* reduce-scatter: ``copy_in_grads`` lays each full gradient out rank-major into a
  ``(W, shard_numel)`` fp32 buffer; ``reduce_scatter_blocks`` sums it into this rank's
  ``shard_numel`` slice, asynchronously; the caller's copy-out adds each parameter's piece of
  that slice to its gradient shard once it has arrived.

These functions know nothing of parameters' states or tiers; the group decides what to
pack and where the results go. FSDP2 keeps the same split in ``_fsdp_collectives.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from outcore.runtime.comm import Comm, Handle


class Layout(Protocol):
    """What the packing needs of a parameter's layout (zero/sharding.py's ``ShardLayout``)."""

    def valid_numel_of(self, rank: int) -> int: ...


def all_gather_blocks(comm: Comm, send: torch.Tensor, shard_numel: int) -> torch.Tensor:
    """Every rank's packed shards, as a ``(W, shard_numel)`` view; waits for the collective."""
    out = torch.empty(comm.world_size * shard_numel, dtype=send.dtype, device=send.device)
    comm.all_gather(out, send).wait()
    return out.view(comm.world_size, shard_numel)


def copy_out_full(blocks: torch.Tensor, full: torch.Tensor, offset: int, shard_numel: int,
                  layout: Layout) -> None:
    """Copy-out of an all-gather: fill one parameter's flat ``full`` tensor from each rank's
    block at ``offset``, skipping the padding of the last ranks."""
    for r in range(blocks.shape[0]):
        n = layout.valid_numel_of(r)
        if n:
            full[r * shard_numel : r * shard_numel + n].copy_(blocks[r, offset : offset + n])


def copy_in_grads(grads: Iterable[tuple[torch.Tensor, int, int, Layout]], world_size: int,
                  packed_numel: int, device: torch.device) -> torch.Tensor:
    """Copy-in of a reduce-scatter: each ``(flat_grad, offset, shard_numel, layout)`` laid out
    rank-major into a zeroed ``(W, packed_numel)`` fp32 buffer (the padding stays zero)."""
    send = torch.zeros(world_size, packed_numel, dtype=torch.float32, device=device)
    for flat, offset, shard_numel, layout in grads:
        for r in range(world_size):
            n = layout.valid_numel_of(r)
            if n:
                send[r, offset : offset + n].copy_(flat[r * shard_numel : r * shard_numel + n])
    return send


def reduce_scatter_blocks(comm: Comm, send: torch.Tensor) -> tuple[torch.Tensor, Handle]:
    """Start summing ``send`` (``(W, n)``) over ranks into this rank's ``n`` elements; the
    returned tensor holds the sum once the handle's ``wait()`` returns."""
    out = torch.empty(send.shape[1], dtype=send.dtype, device=send.device)
    return out, comm.reduce_scatter_sum(out, send.view(-1), async_op=True)
