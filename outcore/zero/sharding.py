"""Partition math for one flattened parameter: padding, shard bounds, views.

[Note: pad each parameter, not each group]
Each parameter is flattened and padded to a multiple of the world size on its own, so rank
r's shard of parameter p is always elements ``[r*s, (r+1)*s)`` of p. Shards of a parameter
therefore mean the same thing whatever module group it is gathered with, optimizer param
groups can differ per parameter (no decay on biases), and a checkpoint saved at one world
size is re-cut for another by concatenating and re-slicing each parameter alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardLayout:
    """Where rank ``rank``'s shard of a ``numel``-element parameter sits in the full tensor."""

    numel: int
    world_size: int
    rank: int

    @property
    def shard_numel(self) -> int:
        """Elements per shard, padding included (the same on every rank)."""
        return -(-self.numel // self.world_size) if self.numel else 0

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def start(self) -> int:
        return self.rank * self.shard_numel

    @property
    def valid_numel(self) -> int:
        """Real (unpadded) elements in this rank's shard; padding is always zero."""
        return self.valid_numel_of(self.rank)

    def valid_numel_of(self, rank: int) -> int:
        """Real elements in ``rank``'s shard (the last shards may be part or all padding)."""
        return max(0, min(self.numel - rank * self.shard_numel, self.shard_numel))

    def cut(self, full: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new, zero-padded shard tensor holding this rank's slice of ``full``."""
        flat = full.detach().reshape(-1)
        out = torch.zeros(self.shard_numel, dtype=dtype or flat.dtype, device=flat.device)
        n = self.valid_numel
        if n:
            out[:n].copy_(flat[self.start : self.start + n])
        return out

    def paste(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Write this rank's shard back into its slice of ``full`` (the inverse of ``cut``)."""
        n = self.valid_numel
        if n:
            full.reshape(-1)[self.start : self.start + n].copy_(shard[:n])
