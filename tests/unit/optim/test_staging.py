"""Staging for streamed updates: ``ShardSlice.of`` cuts elements ``[lo, hi)`` of a shard as a
view, and a ``StagingSlot`` holds one zeroed fp32 buffer per staged kind (plus a buffer in the
cast dtype, if any) whose every ``ALIGN_ELEMS``-element place starts on a 4 KiB boundary
(staging.py's [Note: staging without copies])."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest
import torch

from outcore.optim.staging import ALIGN_ELEMS, ShardSlice, StagingSlot
from outcore.zero.param import ShardedParam

PAGE = 4096


def _slice(lo: int, hi: int) -> ShardSlice:
    return ShardSlice(cast(ShardedParam, SimpleNamespace(name="w")), lo, hi)


def test_shard_slice_of_is_a_view_of_lo_to_hi() -> None:
    t = torch.arange(10, dtype=torch.float32)
    part = _slice(3, 7).of(t)
    assert part.tolist() == [3.0, 4.0, 5.0, 6.0]
    part.fill_(-1)  # a view: writes reach the shard
    assert t.tolist() == [0, 1, 2, -1, -1, -1, -1, 7, 8, 9]


@pytest.mark.parametrize(("lo", "hi"), [(0, 0), (0, 10), (9, 10), (5, 5)])
def test_shard_slice_of_has_hi_minus_lo_elements(lo: int, hi: int) -> None:
    t = torch.zeros(10)
    assert _slice(lo, hi).of(t).numel() == hi - lo


def test_align_elems_puts_slices_on_4_kib_boundaries_in_every_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert (ALIGN_ELEMS * dtype.itemsize) % PAGE == 0, dtype


@pytest.mark.parametrize("elems", [ALIGN_ELEMS, 3 * ALIGN_ELEMS, 1 << 19])  # 1 << 19: 2 MiB
def test_slot_has_one_zeroed_aligned_fp32_buffer_per_kind(elems: int) -> None:
    kinds = ("master", "exp_avg", "exp_avg_sq", "grad")
    slot = StagingSlot(elems, kinds, None)
    assert tuple(slot.buffers) == kinds
    ptrs = set()
    for kind, buf in slot.buffers.items():
        assert buf.dtype == torch.float32 and buf.dim() == 1 and buf.numel() == elems, kind
        assert buf.device.type == "cpu"
        assert buf.data_ptr() % PAGE == 0, kind
        assert int(torch.count_nonzero(buf)) == 0, kind
        ptrs.add(buf.data_ptr())
    assert len(ptrs) == len(kinds)  # each kind its own memory
    assert slot.cast is None


def test_slot_buffers_do_not_overlap() -> None:
    slot = StagingSlot(ALIGN_ELEMS, ("master", "grad"), torch.bfloat16)
    slot.buffers["master"].fill_(1.0)
    assert int(torch.count_nonzero(slot.buffers["grad"])) == 0
    assert slot.cast is not None
    assert int(torch.count_nonzero(slot.cast)) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_slot_cast_buffer_has_the_cast_dtype_aligned_and_zeroed(dtype: torch.dtype) -> None:
    elems = 2 * ALIGN_ELEMS
    slot = StagingSlot(elems, ("master",), dtype)
    assert slot.cast is not None
    assert slot.cast.dtype == dtype and slot.cast.numel() == elems
    assert slot.cast.data_ptr() % PAGE == 0
    assert int(torch.count_nonzero(slot.cast)) == 0


def test_every_align_elems_place_starts_on_a_page() -> None:
    elems = 4 * ALIGN_ELEMS
    slot = StagingSlot(elems, ("master",), torch.bfloat16)
    assert slot.cast is not None
    for place in range(0, elems, ALIGN_ELEMS):
        assert _slice(place, place + 1).of(slot.buffers["master"]).data_ptr() % PAGE == 0
        assert _slice(place, place + 1).of(slot.cast).data_ptr() % PAGE == 0


def test_slot_without_kinds_has_no_buffers() -> None:
    slot = StagingSlot(ALIGN_ELEMS, (), None)
    assert slot.buffers == {}
    assert slot.cast is None
