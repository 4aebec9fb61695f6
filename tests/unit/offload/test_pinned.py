"""PinnedArena: shards cut from large blocks (pinned.py's note), checked with ordinary memory."""

from __future__ import annotations

import itertools

import torch

from outcore.offload.pinned import ALIGN_BYTES, PinnedArena


def test_shards_are_disjoint_aligned_views_of_few_blocks() -> None:
    arena = PinnedArena(pin=False, block_bytes=1 << 20)
    shapes = [(100,), (3, 7), (4096,), (1000, 50), (17,)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.float16]
    out = [arena.empty(s, d) for s, d in zip(shapes, dtypes, strict=True)]
    for t, s, d in zip(out, shapes, dtypes, strict=True):
        assert t.shape == s and t.dtype == d and t.is_contiguous()
        assert (t.data_ptr() - t.untyped_storage().data_ptr()) % ALIGN_BYTES == 0
    # 200 KB of shards in a 1 MiB block: one block holds them all
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1
    assert arena.reserved_bytes == 1 << 20
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in out)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))  # no overlap
    for i, t in enumerate(out):
        t.fill_(i)
    assert all(bool((t == i).all()) for i, t in enumerate(out))  # writes stay in their shard


def test_a_full_block_starts_another_and_a_large_shard_gets_its_own() -> None:
    arena = PinnedArena(pin=False, block_bytes=1 << 16)
    a = arena.empty((3000,), torch.float32)  # 12 KB
    b = arena.empty((6000,), torch.float32)  # 24 KB: fits after a
    c = arena.empty((8000,), torch.float32)  # 32 KB more would pass 64 KB: a new block
    big = arena.empty((20000,), torch.float32)  # 80 KB > half a block: a block of its own
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert c.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert big.untyped_storage().nbytes() == big.nbytes
    assert arena.reserved_bytes == 2 * (1 << 16) + big.nbytes


def test_copy_holds_the_values() -> None:
    arena = PinnedArena(pin=False)
    src = torch.randn(5, 9)
    assert torch.equal(arena.copy(src), src)
    assert arena.empty((0,), torch.float32).numel() == 0
