"""Where shard bytes live outside device memory: aligned host buffers and the NVMe swap.

``buffers`` holds the fixed pool of aligned (pinned on CUDA) host buffers, ``aio`` the
thread-pool engine that moves bytes between those buffers and files and returns futures,
``nvme`` the per-rank swap file cut into extents.
"""

from outcore.tiers.aio import AioEngine, AioError, IOFuture
from outcore.tiers.buffers import ALIGN, BufferPool, PooledBuffer, aligned_empty
from outcore.tiers.nvme import Extent, NvmeStore, check_space

__all__ = [
    "ALIGN",
    "AioEngine",
    "AioError",
    "BufferPool",
    "Extent",
    "IOFuture",
    "NvmeStore",
    "PooledBuffer",
    "aligned_empty",
    "check_space",
]
