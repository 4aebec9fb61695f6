"""A group's collectives and their packing (zero/collectives.py's [Note: packed collectives,
copy-in and copy-out]): rank r's block of the packed buffer holds, at each parameter's
offset, rank r's shard of that parameter, its padding zero; ``copy_in_grads`` lays full
gradients out so, in fp32; ``copy_out_full`` cuts the blocks back into full tensors,
skipping the padding; ``all_gather_blocks`` gives every rank's block and
``reduce_scatter_blocks`` the sum over ranks of this rank's block. The references are
written out by hand, for world sizes 2 and 3, in one process with a world-size-1 ``Comm``
and on two gloo ranks."""

from __future__ import annotations

import pytest
import torch

from outcore.runtime.comm import Comm
from outcore.zero.collectives import (
    all_gather_blocks,
    copy_in_grads,
    copy_out_full,
    reduce_scatter_blocks,
)
from outcore.zero.sharding import ShardLayout
from tests.distributed import run_world

CPU = torch.device("cpu")
A = torch.arange(1.0, 6.0)  # 5 elements
B7 = torch.arange(11.0, 18.0)  # 7 elements
B4 = torch.arange(11.0, 15.0)  # 4 elements

# W=3: A in shards of 2 at offset 0, B7 in shards of 3 at offset 2, one spare element
# (alignment) at the end of each block; the last rank's shards are mostly padding
PACKED_W3 = [[1, 2, 11, 12, 13, 0],
             [3, 4, 14, 15, 16, 0],
             [5, 0, 17, 0, 0, 0]]
# W=2: A in shards of 3 at offset 0, B4 in shards of 2 at offset 3
PACKED_W2 = [[1, 2, 3, 11, 12],
             [4, 5, 0, 13, 14]]


def _w3() -> list[tuple[torch.Tensor, int, int, ShardLayout]]:
    return [(A, 0, 2, ShardLayout(5, 3, 0)), (B7, 2, 3, ShardLayout(7, 3, 0))]


def _w2() -> list[tuple[torch.Tensor, int, int, ShardLayout]]:
    return [(A, 0, 3, ShardLayout(5, 2, 0)), (B4, 3, 2, ShardLayout(4, 2, 0))]


@pytest.mark.parametrize(("params", "world", "packed", "expected"), [
    (_w3(), 3, 6, PACKED_W3), (_w2(), 2, 5, PACKED_W2)], ids=["W=3", "W=2"])
def test_copy_in_lays_gradients_out_rank_major_with_zero_padding(
        params: list, world: int, packed: int, expected: list[list[int]]) -> None:
    send = copy_in_grads(params, world, packed, CPU)
    assert send.dtype == torch.float32 and send.shape == (world, packed)
    assert send.tolist() == expected


def test_copy_in_casts_16_bit_gradients_to_fp32() -> None:
    grads = [(g.to(torch.bfloat16), off, s, lay) for g, off, s, lay in _w3()]
    send = copy_in_grads(grads, 3, 6, CPU)
    assert send.dtype == torch.float32 and send.tolist() == PACKED_W3


def test_copy_in_of_no_gradients_is_all_zero() -> None:
    assert torch.equal(copy_in_grads([], 2, 4, CPU), torch.zeros(2, 4))


@pytest.mark.parametrize(("params", "packed"), [(_w3(), PACKED_W3), (_w2(), PACKED_W2)],
                         ids=["W=3", "W=2"])
def test_copy_out_rebuilds_each_full_tensor_and_skips_the_padding(
        params: list, packed: list[list[int]]) -> None:
    blocks = torch.tensor(packed, dtype=torch.float32)
    blocks[blocks == 0] = 99.0  # whatever the padding holds must not land in a parameter
    for ref, offset, shard_numel, layout in params:
        full = torch.full_like(ref, -1.0)  # exactly numel long: padding would overrun it
        copy_out_full(blocks, full, offset, shard_numel, layout)
        assert torch.equal(full, ref)


def test_copy_out_is_the_inverse_of_copy_in() -> None:
    gen = torch.Generator().manual_seed(0)
    sizes = [9, 1, 4, 13]
    for world in (2, 3, 4):
        refs = [torch.randn(n, generator=gen) for n in sizes]
        layouts = [ShardLayout(n, world, 0) for n in sizes]
        offsets, total = [], 0
        for lay in layouts:
            offsets.append(total)
            total += lay.shard_numel
        packed = copy_in_grads(zip(refs, offsets, [lay.shard_numel for lay in layouts],
                                   layouts, strict=True), world, total, CPU)
        for ref, off, lay in zip(refs, offsets, layouts, strict=True):
            full = torch.empty_like(ref)
            copy_out_full(packed, full, off, lay.shard_numel, lay)
            assert torch.equal(full, ref), (world, ref.numel())


def test_all_gather_at_world_size_one_is_a_copy_of_the_send_buffer() -> None:
    send = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    blocks = all_gather_blocks(Comm(), send, 3)
    assert blocks.shape == (1, 3) and blocks.dtype == torch.bfloat16
    assert blocks.tolist() == [[1.0, 2.0, 3.0]]
    send.fill_(0.0)
    assert blocks.tolist() == [[1.0, 2.0, 3.0]], "a new buffer, not a view of send"


def test_reduce_scatter_at_world_size_one_returns_the_block_and_a_finished_handle() -> None:
    send = torch.tensor([[1.0, -2.0, 3.5]])
    out, handle = reduce_scatter_blocks(Comm(), send)
    assert handle.wait() is True
    assert out.tolist() == [1.0, -2.0, 3.5]
    send.fill_(0.0)
    assert out.tolist() == [1.0, -2.0, 3.5]


def _two_ranks() -> dict[str, torch.Tensor]:
    """On each of two gloo ranks: pack this rank's shards, all-gather, copy out; then copy in
    this rank's gradients ((rank + 1) times A and B4) and reduce-scatter them."""
    from outcore.runtime.bootstrap import join_world

    comm = join_world("gloo", 60.0)
    r = comm.rank
    la, lb = ShardLayout(5, 2, r), ShardLayout(4, 2, r)
    send = torch.cat([la.cut(A), lb.cut(B4)])
    blocks = all_gather_blocks(comm, send, 5)
    full_a, full_b = torch.full((5,), -1.0), torch.full((4,), -1.0)
    copy_out_full(blocks, full_a, 0, 3, la)
    copy_out_full(blocks, full_b, 3, 2, lb)
    grads = copy_in_grads([((r + 1) * A, 0, 3, la), ((r + 1) * B4, 3, 2, lb)], 2, 5, CPU)
    reduced, handle = reduce_scatter_blocks(comm, grads)
    handle.wait()
    return {"send": send, "blocks": blocks, "a": full_a, "b": full_b, "grads": grads,
            "reduced": reduced}


def test_all_gather_and_reduce_scatter_on_two_ranks() -> None:
    ranks = run_world(_two_ranks, 2)
    for r, got in enumerate(ranks):
        assert got["send"].tolist() == PACKED_W2[r], "each rank packs its own shards"
        assert got["blocks"].tolist() == PACKED_W2, "every rank gets every rank's block"
        assert got["a"].tolist() == A.tolist() and got["b"].tolist() == B4.tolist()
        assert got["grads"].tolist() == [[(r + 1) * v for v in row] for row in PACKED_W2]
    # rank r's slice summed over ranks: (1 + 2) times its block of PACKED_W2
    assert ranks[0]["reduced"].tolist() == [3, 6, 9, 33, 36]
    assert ranks[1]["reduced"].tolist() == [12, 15, 0, 39, 42]
