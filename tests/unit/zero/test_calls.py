"""Which kind of call a torch function is, for a parameter it touches (calls.py's [Note:
telling reads from writes]): metadata (incl. ``*_like``/``new_*`` allocations), a read, a
write (a name ending in one underscore, an in-place operator, ``__setitem__``, ``nn.init``'s
fills), ``.data`` get and set, ``repr``, or refused (a call changing storage or shape in
place); and whether a write may run on each rank's slice alone (``local_write``): overwrites
and ATen ops tagged pointwise or seeded-random may, reductions and matmuls may not. The
functions classified are those ``__torch_function__`` really receives, recorded here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from outcore.zero import calls
from outcore.zero.calls import DATA_GET, DATA_SET, SETITEM, Kind, kind_of, local_write


class _Recorder(torch.Tensor):
    """A tensor that records the functions ``__torch_function__`` is handed."""

    seen: list[Any] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        cls.seen.append(func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _first_call(use: Callable[[torch.Tensor], object]) -> Any:
    """The first torch function ``use`` calls on a 4x4 tensor."""
    t = torch.zeros(4, 4).as_subclass(_Recorder)
    _Recorder.seen = []
    use(t)
    assert _Recorder.seen, "no torch function was called"
    return _Recorder.seen[0]


def _set_data(t: torch.Tensor) -> None:
    t.data = torch.ones(4, 4)


def _iadd(t: torch.Tensor) -> None:
    t += 1


def _setitem(t: torch.Tensor) -> None:
    t[0] = 1.0


CASES: list[tuple[str, Callable[[torch.Tensor], object], Kind]] = [
    ("shape", lambda t: t.shape, Kind.META),
    ("dtype", lambda t: t.dtype, Kind.META),
    ("size", lambda t: t.size(), Kind.META),
    ("numel", lambda t: t.numel(), Kind.META),
    ("stride", lambda t: t.stride(), Kind.META),
    ("nbytes", lambda t: t.nbytes, Kind.META),
    ("zeros_like", torch.zeros_like, Kind.META),
    ("new_zeros", lambda t: t.new_zeros(2), Kind.META),
    ("requires_grad_", lambda t: t.requires_grad_(False), Kind.META),
    ("sum", lambda t: t.sum(), Kind.READ),
    ("matmul", lambda t: t @ t, Kind.READ),
    ("clone", lambda t: t.clone(), Kind.READ),
    ("torch.add", lambda t: torch.add(t, 1), Kind.READ),
    ("__eq__", lambda t: t == 0, Kind.READ),
    ("add_", lambda t: t.add_(1), Kind.WRITE),
    ("+=", _iadd, Kind.WRITE),
    ("[]=", _setitem, Kind.WRITE),
    ("copy_", lambda t: t.copy_(torch.ones(4, 4)), Kind.WRITE),
    ("nn.init.normal_", nn.init.normal_, Kind.WRITE),
    ("addmm_", lambda t: t.addmm_(t, t), Kind.WRITE),
    (".data", lambda t: t.data, Kind.DATA_GET),
    (".data =", _set_data, Kind.DATA_SET),
    ("repr", repr, Kind.REPR),
    ("format", lambda t: f"{t}", Kind.REPR),
    ("resize_", lambda t: t.resize_(16), Kind.REFUSED),
    ("t_", lambda t: t.t_(), Kind.REFUSED),
    ("unsqueeze_", lambda t: t.unsqueeze_(0), Kind.REFUSED),
]


@pytest.mark.parametrize(("use", "kind"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_call_is_sorted_into_its_kind(use: Callable[[torch.Tensor], object],
                                           kind: Kind) -> None:
    assert kind_of(_first_call(use)) is kind


@pytest.mark.parametrize("name", ["set_", "resize_", "resize_as_", "detach_", "share_memory_",
                                  "as_strided_", "transpose_", "squeeze_", "swapdims_"])
def test_calls_changing_storage_or_shape_in_place_are_refused(name: str) -> None:
    assert kind_of(getattr(torch.Tensor, name)) is Kind.REFUSED


def test_data_get_and_set_are_told_apart_though_their_wrappers_are_new_each_time() -> None:
    first, second = _first_call(lambda t: t.data), _first_call(lambda t: t.data)
    assert first is not second  # method-wrappers are made anew: compared with ==
    assert kind_of(first) is kind_of(second) is Kind.DATA_GET
    assert kind_of(DATA_GET) is Kind.DATA_GET and kind_of(DATA_SET) is Kind.DATA_SET


def test_names_decide_writes_for_unknown_functions() -> None:
    def scale_(t: torch.Tensor) -> None: ...

    def __ior__(t: torch.Tensor) -> None: ...

    def __len__(t: torch.Tensor) -> None: ...  # a dunder, not in-place

    def gather(t: torch.Tensor) -> None: ...

    assert kind_of(scale_) is Kind.WRITE
    assert kind_of(__ior__) is Kind.WRITE
    assert kind_of(__len__) is Kind.READ
    assert kind_of(gather) is Kind.READ


def test_an_unhashable_callable_is_classified_without_the_cache() -> None:
    class Unhashable:
        __name__ = "mine_"
        __hash__ = None  # type: ignore[assignment]

        def __call__(self) -> None: ...

    assert kind_of(Unhashable()) is Kind.WRITE


def test_kinds_are_cached_per_function() -> None:
    kind_of(torch.Tensor.sum)
    assert calls._KINDS[torch.Tensor.sum] is Kind.READ


@pytest.mark.parametrize("func", [torch.Tensor.copy_, torch.Tensor.fill_, torch.Tensor.zero_,
                                  torch.Tensor.normal_, nn.init.xavier_uniform_,
                                  nn.init.orthogonal_, SETITEM, DATA_SET],
                         ids=lambda f: getattr(f, "__name__", str(f)))
def test_overwrites_are_local_writes(func: Any) -> None:
    assert local_write(func)


@pytest.mark.parametrize("name", ["add_", "mul_", "clamp_", "sigmoid_", "bernoulli_",
                                  "lerp_"])
def test_pointwise_and_seeded_random_ops_are_local_writes(name: str) -> None:
    assert local_write(getattr(torch.Tensor, name))


@pytest.mark.parametrize("name", ["addmm_", "cumsum_", "renorm_", "index_add_"])
def test_writes_reading_other_elements_are_not_local(name: str) -> None:
    assert not local_write(getattr(torch.Tensor, name))


def test_a_write_with_no_aten_op_is_not_local() -> None:
    def my_update_(t: torch.Tensor) -> None: ...

    assert not local_write(my_update_)
