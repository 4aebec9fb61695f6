"""Which ``nn.Parameter`` objects outcore manages, and the metadata calls that need no values.

[Note: the one process-wide map]
``outcore.initialize(model, cfg)`` receives only the model, yet a model built under
``outcore.init`` already has sharded parameters that must be found again. So managed
parameters are looked up in one map keyed by the ``nn.Parameter``'s identity: nothing is
stored on the tensors themselves, the ShardedParam holds its parameter weakly, and a finalizer
drops the entry when the parameter dies. (A ``WeakKeyDictionary`` cannot be used: it compares
keys with ``==``, which for tensors is elementwise.)
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from outcore.zero.param import ShardedParam

_MANAGED: dict[int, ShardedParam] = {}
_FINALIZERS: dict[int, weakref.finalize[[int], nn.Parameter]] = {}


def managed(t: object) -> ShardedParam | None:
    """The ShardedParam behind ``t`` if ``t`` is a parameter outcore shards, else None."""
    if isinstance(t, nn.Parameter):
        return _MANAGED.get(id(t))
    return None


def register(param: nn.Parameter, sp: ShardedParam) -> None:
    key = id(param)
    _MANAGED[key] = sp
    _FINALIZERS[key] = weakref.finalize(param, _forget, key)


def unregister(param: nn.Parameter) -> None:
    """Forget ``param`` (handed back as a plain parameter): its shards are already freed."""
    key = id(param)
    _MANAGED.pop(key, None)
    fin = _FINALIZERS.pop(key, None)
    if fin is not None:
        fin.detach()


def _forget(key: int) -> None:
    _FINALIZERS.pop(key, None)
    sp = _MANAGED.pop(key, None)
    if sp is not None:
        forget_storage(storage_key(sp.full))
        sp.free_storage()


# Storage of each parameter's full tensor -> its ShardedParam, so a view autograd saved for
# backward (``weight.t()``) can be traced back to the parameter whose group must be fetched.
_STORAGES: dict[int, ShardedParam] = {}


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage (stable across resize_, shared by every view of it)."""
    return t.untyped_storage()._cdata  # type: ignore[no-any-return]  # private, typed Any


def register_storage(key: int, sp: ShardedParam) -> None:
    _STORAGES[key] = sp


def forget_storage(key: int) -> None:
    _STORAGES.pop(key, None)


def owner(t: torch.Tensor) -> ShardedParam | None:
    """The parameter whose full storage ``t`` lives in (``t`` itself or a view), if any."""
    sp = managed(t)
    if sp is None and _STORAGES:
        sp = _STORAGES.get(storage_key(t))
    return sp


def _getter(name: str) -> object:
    """The C getter behind tensor property ``name`` (what ``__torch_function__`` receives)."""
    return getattr(torch.Tensor, name).__get__


# Calls that read only shape/type metadata: a placeholder answers them truthfully, so they
# must not trigger a fetch.
METADATA_CALLS = frozenset(
    [_getter(n) for n in ("shape", "dtype", "device", "ndim", "requires_grad", "is_leaf",
                          "grad", "grad_fn", "layout", "is_cuda", "is_sparse", "is_meta",
                          "is_quantized")]
    + [getattr(torch.Tensor, n) for n in ("size", "dim", "numel", "nelement", "element_size",
                                           "is_floating_point", "is_complex", "requires_grad_",
                                           "register_hook", "register_post_accumulate_grad_hook",
                                           "get_device", "__hash__")]
    # torch's stubs declare these properties plain attributes; at runtime they are descriptors
    + [torch.Tensor.requires_grad.__set__,  # type: ignore[attr-defined]
       torch.Tensor.grad.__set__]  # type: ignore[union-attr]
)

# Calls that overwrite every element: the previous values need not be gathered.
OVERWRITE_CALLS = frozenset(
    [getattr(torch.Tensor, n) for n in ("uniform_", "normal_", "fill_", "zero_", "copy_",
                                        "random_", "exponential_", "log_normal_", "geometric_",
                                        "cauchy_")]
    + [getattr(nn.init, n) for n in ("uniform_", "normal_", "trunc_normal_", "constant_",
                                     "ones_", "zeros_", "xavier_uniform_", "xavier_normal_",
                                     "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                                     "eye_", "dirac_", "sparse_")]
)


def parameter_counts(module: nn.Module) -> tuple[int, int]:
    """(all, trainable) parameter elements of ``module``: shapes only, so a sharded or
    meta-device model counts the same as a materialized one."""
    total = trainable = 0
    for p in module.parameters():
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable
