"""The one process-wide map from parameters to their ``ShardedParam`` (zero/registry.py's
[Note: the one process-wide map]): ``managed`` finds a registered parameter by identity and
nothing else; ``owner`` also finds it from a view of its full tensor's storage; a parameter
that dies takes its entry with it and frees its shards; ``unregister`` forgets it. The call
sets name what ``__torch_function__`` really receives for metadata reads and whole
overwrites, and ``parameter_counts`` counts shapes only, so a sharded or meta model counts
as a materialized one."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn

import outcore
from outcore.runtime.context import Runtime
from outcore.zero import registry
from outcore.zero.param import ShardedParam
from outcore.zero.registry import (
    METADATA_CALLS,
    OVERWRITE_CALLS,
    managed,
    owner,
    parameter_counts,
    register,
    unregister,
)
from tests.common import Quirky

CFG = {"dtype": "fp32", "offload": {"params": "cpu", "optimizer": "cpu"}}


@pytest.fixture
def rt() -> Runtime:
    return Runtime(outcore.Config.from_dict(CFG))


def test_managed_finds_a_registered_parameter_and_nothing_else(rt: Runtime) -> None:
    param = nn.Parameter(torch.randn(3, 4))
    twin = nn.Parameter(param.detach().clone())  # equal values, another object
    assert managed(param) is None
    sp = ShardedParam(param, rt)
    register(param, sp)
    assert managed(param) is sp
    assert managed(twin) is None
    assert managed(sp.full) is None, "a plain tensor (even the full tensor) is not a parameter"
    assert managed(torch.zeros(2)) is None and managed("w") is None and managed(None) is None
    unregister(param)
    assert managed(param) is None
    unregister(param)  # again: a no-op


def test_owner_traces_a_view_of_the_full_storage_back_to_its_parameter(rt: Runtime) -> None:
    """What autograd saves for backward (``weight.t()``) leads back to the parameter, whether
    its storage is filled or freed at the time."""
    param = nn.Parameter(torch.randn(3, 4))
    sp = ShardedParam(param, rt)
    register(param, sp)
    assert owner(param) is sp
    sp.alloc_full()
    saved = sp.full.t()  # what linear() saves for backward
    assert owner(saved) is sp and owner(sp.full[1:]) is sp
    sp.release()
    assert saved.untyped_storage().nbytes() == 0
    # (results are compared in locals: pytest would print the freed view of a failing call)
    found = owner(saved)
    assert found is sp, "the key survives resize_"
    assert owner(torch.randn(3, 4)) is None
    assert owner(torch.randn(3, 4).t()) is None
    registry.forget_storage(registry.storage_key(sp.full))
    found, by_param = owner(saved), owner(param)
    assert found is None and by_param is sp, "the parameter itself is still managed"
    unregister(param)


def test_a_parameter_that_dies_leaves_the_map_and_frees_its_shards(rt: Runtime) -> None:
    param = nn.Parameter(torch.randn(5, 6))
    sp = ShardedParam(param, rt)
    register(param, sp)
    assert rt.ledger.snapshot()["host.master"] == 30 * 4
    key = id(param)
    del param
    gc.collect()
    assert not sp.alive
    assert key not in registry._MANAGED
    assert rt.ledger.snapshot()["host.master"] == 0
    assert sp.master_shard is None
    found = owner(sp.full)
    assert found is None, "its storage is forgotten too"


def test_an_unregistered_parameter_that_dies_leaves_its_shard_alone(rt: Runtime) -> None:
    """``unregister`` is for a parameter handed back, whose shards its ShardedParam freed
    already: its finalizer is detached, so nothing is freed twice or in someone else's name."""
    param = nn.Parameter(torch.randn(5, 6))
    sp = ShardedParam(param, rt)
    register(param, sp)
    unregister(param)
    del param
    gc.collect()
    assert rt.ledger.snapshot()["host.master"] == 30 * 4
    assert sp.master_shard is not None
    sp.free_storage()
    assert rt.ledger.snapshot()["host.master"] == 0


class _Recorder(torch.Tensor):
    """Records the functions ``__torch_function__`` receives, as surface.py's class does."""

    seen: list[Any] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def _received(call: Any) -> list[Any]:
    """The functions ``__torch_function__`` receives during ``call`` on a tensor."""
    t = torch.zeros(4, 3).as_subclass(_Recorder)
    _Recorder.seen = []
    call(t)
    return _Recorder.seen


@pytest.mark.parametrize("call", [
    lambda t: t.shape, lambda t: t.dtype, lambda t: t.device, lambda t: t.ndim,
    lambda t: t.requires_grad, lambda t: t.grad, lambda t: t.is_leaf, lambda t: t.size(),
    lambda t: t.numel(), lambda t: t.dim(), lambda t: t.element_size(),
    lambda t: t.is_floating_point(), lambda t: t.requires_grad_(False),
], ids=["shape", "dtype", "device", "ndim", "requires_grad", "grad", "is_leaf", "size",
        "numel", "dim", "element_size", "is_floating_point", "requires_grad_"])
def test_metadata_calls_are_what_torch_function_receives(call: Any) -> None:
    func = _received(call)[0]
    assert func in METADATA_CALLS
    assert func not in OVERWRITE_CALLS


@pytest.mark.parametrize("call", [
    lambda t: t.fill_(1.0), lambda t: t.zero_(), lambda t: t.copy_(torch.ones(4, 3)),
    lambda t: t.uniform_(), lambda t: t.normal_(), lambda t: nn.init.normal_(t),
    lambda t: nn.init.uniform_(t), lambda t: nn.init.constant_(t, 0.5),
    lambda t: nn.init.kaiming_uniform_(t), lambda t: nn.init.zeros_(t),
    lambda t: nn.init.ones_(t), lambda t: nn.init.xavier_uniform_(t),
    lambda t: nn.init.xavier_normal_(t), lambda t: nn.init.kaiming_normal_(t),
], ids=["fill_", "zero_", "copy_", "uniform_", "normal_", "init.normal_", "init.uniform_",
        "init.constant_", "init.kaiming_uniform_", "init.zeros_", "init.ones_",
        "init.xavier_uniform_", "init.xavier_normal_", "init.kaiming_normal_"])
def test_a_whole_overwrite_is_known_by_its_first_call_that_is_not_metadata(call: Any) -> None:
    """What ``outcore.init`` meets first (metadata aside) tells it the old values need not be
    gathered: the init function itself where it dispatches, else the fill it runs."""
    first = next(f for f in _received(call) if f not in METADATA_CALLS)
    assert first in OVERWRITE_CALLS


def _net() -> nn.Module:
    net = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    net[1].requires_grad_(False)
    return net


def test_parameter_counts_all_and_trainable_elements() -> None:
    assert parameter_counts(_net()) == (4 * 3 + 3 + 3 * 2 + 2, 4 * 3 + 3)
    assert parameter_counts(nn.ReLU()) == (0, 0)


def test_parameter_counts_a_tied_parameter_once() -> None:
    model = Quirky()
    unique = {id(p): p.numel() for m in model.modules() for p in m._parameters.values()
              if p is not None}
    assert parameter_counts(model)[0] == sum(unique.values())


def test_a_sharded_or_meta_model_counts_as_a_materialized_one() -> None:
    plain = parameter_counts(_net())
    with torch.device("meta"):
        meta = _net()
    assert parameter_counts(meta) == plain
    with outcore.init(CFG):
        sharded = _net()
    assert all(managed(p) is not None for p in sharded.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in sharded.parameters())
    assert parameter_counts(sharded) == plain
