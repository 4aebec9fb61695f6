"""The partition math of one parameter (zero/sharding.py's [Note: pad each parameter, not each
group]): a ``numel``-element parameter is padded to a multiple of W and cut into W equal
shards, rank r's being elements ``[r*s, (r+1)*s)``; the last shards may be part or all
padding, which is always zero. Cutting every rank's shard and gathering them (the blocks in
rank order, the padding dropped) gives the parameter back, and a parameter cut at one world
size is re-cut for another by gathering and cutting again."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from outcore.zero.sharding import ShardLayout

# (numel, world size): divisible, uneven, fewer elements than ranks, empty
SIZES = [(12, 1), (12, 2), (12, 4), (10, 4), (7, 3), (5, 2), (1, 3), (3, 8), (0, 2), (13, 3)]


def _layouts(numel: int, world: int) -> list[ShardLayout]:
    return [ShardLayout(numel, world, r) for r in range(world)]


def _gather(shards: list[torch.Tensor], numel: int, shape: torch.Size) -> torch.Tensor:
    """What an all-gather and copy-out rebuild: the blocks in rank order, padding dropped."""
    return torch.cat(shards)[:numel].view(shape)


@pytest.mark.parametrize(("numel", "world"), SIZES)
def test_every_rank_gets_an_equal_padded_shard(numel: int, world: int) -> None:
    expected = -(-numel // world)  # ceil
    for layout in _layouts(numel, world):
        assert layout.shard_numel == expected
        assert layout.padded_numel == expected * world
        assert layout.padded_numel % world == 0
        assert numel <= layout.padded_numel < numel + world or numel == 0
        assert layout.start == layout.rank * expected


@pytest.mark.parametrize(("numel", "world"), SIZES)
def test_valid_numel_counts_the_real_elements_of_each_shard(numel: int, world: int) -> None:
    layout = ShardLayout(numel, world, 0)
    valid = [layout.valid_numel_of(r) for r in range(world)]
    assert sum(valid) == numel
    assert all(0 <= n <= layout.shard_numel for n in valid)
    # full shards first, then at most one partial one, then padding only
    full = [n == layout.shard_numel for n in valid]
    assert full == sorted(full, reverse=True)
    assert sum(0 < n < layout.shard_numel for n in valid) <= 1
    for r, lay in enumerate(_layouts(numel, world)):
        assert lay.valid_numel == valid[r]


def test_valid_numel_by_hand() -> None:
    """7 elements over 3 ranks: shards of 3, the last holds one real element and two of
    padding; 3 elements over 8 ranks: five ranks hold only padding."""
    assert [ShardLayout(7, 3, 0).valid_numel_of(r) for r in range(3)] == [3, 3, 1]
    assert [ShardLayout(3, 8, 0).valid_numel_of(r) for r in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert [ShardLayout(10, 4, 0).valid_numel_of(r) for r in range(4)] == [3, 3, 3, 1]


def test_cut_by_hand() -> None:
    full = torch.arange(1.0, 8.0)  # 7 elements, 3 ranks
    assert [ShardLayout(7, 3, r).cut(full).tolist() for r in range(3)] == [
        [1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 0.0, 0.0]]


@pytest.mark.parametrize(("numel", "world"), SIZES)
def test_cut_then_gather_gives_the_parameter_back(numel: int, world: int) -> None:
    full = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) + 10.0
    shards = [layout.cut(full) for layout in _layouts(numel, world)]
    for layout, shard in zip(_layouts(numel, world), shards, strict=True):
        assert shard.shape == (layout.shard_numel,)
        assert shard.dtype == full.dtype
        assert torch.equal(shard[: layout.valid_numel],
                           full[layout.start : layout.start + layout.valid_numel])
        assert not shard[layout.valid_numel :].any(), "padding is zero"
    assert torch.equal(_gather(shards, numel, full.shape), full)


def test_a_matrix_is_cut_in_row_major_order_and_rebuilt() -> None:
    full = torch.arange(35.0).view(5, 7)
    shards = [layout.cut(full) for layout in _layouts(35, 4)]
    assert shards[0].tolist() == list(range(9))
    assert shards[3].tolist() == [27.0, 28, 29, 30, 31, 32, 33, 34, 0]
    assert torch.equal(_gather(shards, 35, full.shape), full)
    # a non-contiguous view is cut as it reads, not as its storage lies
    t = full.t()
    assert torch.equal(_gather([lay.cut(t) for lay in _layouts(35, 4)], 35, t.shape), t)


def test_cut_is_a_new_tensor_detached_in_the_dtype_asked_for() -> None:
    param = torch.nn.Parameter(torch.tensor([1.5, -2.25, 3.0, 4.0, 5.0]))
    shard = ShardLayout(5, 2, 0).cut(param, dtype=torch.float64)
    assert shard.dtype == torch.float64 and not shard.requires_grad
    assert shard.tolist() == [1.5, -2.25, 3.0]
    shard.fill_(0.0)
    assert param.detach()[0] == 1.5, "the shard does not alias the parameter"
    bf16 = ShardLayout(5, 2, 1).cut(param, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.tolist() == [4.0, 5.0, 0.0]


@pytest.mark.parametrize(("numel", "world"), SIZES)
def test_paste_is_the_inverse_of_cut_and_never_writes_padding(numel: int, world: int) -> None:
    full = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    rebuilt = torch.full((numel,), float("nan"))
    for layout in _layouts(numel, world):
        shard = layout.cut(full)
        shard[layout.valid_numel :] = 99.0  # junk in the padding must not land anywhere
        layout.paste(rebuilt, shard)
    assert torch.equal(rebuilt, full)


def test_paste_writes_only_its_own_slice() -> None:
    full = torch.zeros(3, 3)
    ShardLayout(9, 2, 1).paste(full, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert full.reshape(-1).tolist() == [0, 0, 0, 0, 0, 1, 2, 3, 4]


@pytest.mark.parametrize(("old", "new"), [(3, 2), (2, 3), (4, 1), (1, 5)])
def test_shards_of_one_world_size_are_re_cut_for_another(old: int, new: int) -> None:
    """A checkpoint's shards saved at ``old`` ranks, gathered and cut at ``new`` ranks, are
    what cutting the parameter at ``new`` ranks gives."""
    full = torch.randn(4, 5, generator=torch.Generator().manual_seed(7))
    saved = [layout.cut(full) for layout in _layouts(20, old)]
    restored = _gather(saved, 20, full.shape)
    for layout in _layouts(20, new):
        assert torch.equal(layout.cut(restored), layout.cut(full))


def test_the_layout_is_a_frozen_value() -> None:
    layout = ShardLayout(10, 4, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.rank = 2  # type: ignore[misc]
    assert layout == ShardLayout(10, 4, 1) and hash(layout) == hash(ShardLayout(10, 4, 1))
