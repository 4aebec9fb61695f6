"""One user parameter under sharding: its shard in its home tier and what ``param.data`` shows.

[Note: the placeholder keeps the shape]
A sharded parameter's ``.data`` is a single NaN element expanded to the full shape (stride 0,
one element of storage). So ``p.shape``, ``p.numel()`` and ``p.dtype`` stay true for user
code and init functions that compute fan-in, parameter counts stay right, and the full storage
is really gone. Writing into a placeholder fails loudly in PyTorch (overlapping memory), and
computing with one by mistake gives NaN rather than plausible numbers. Within outcore's
forward, the access mode and saved-tensor hooks (hooks.py) fetch the real values before any
use, so the placeholder is only ever seen by code running outside the engine.

The user's ``nn.Parameter`` object is never replaced: only its ``.data`` changes, so optimizers,
tied references and ``named_parameters`` all keep pointing at the same object.
"""

from __future__ import annotations

import weakref
from enum import Enum

import torch
from torch import nn

from outcore.errors import ConfigError
from outcore.runtime import Runtime
from outcore.sharding import ShardLayout
from outcore.storage import Stored, load_now


class ParamState(str, Enum):
    SHARDED = "sharded"
    UNSHARDED = "unsharded"


def _placeholder(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((), float("nan"), dtype=dtype).expand(shape)


class ShardedParam:
    """Rank-local state of one parameter: master/compute shards, gradient, optimizer state."""

    def __init__(self, param: nn.Parameter, rt: Runtime) -> None:
        if not param.is_floating_point():
            raise ConfigError(f"cannot shard a {param.dtype} parameter of shape {tuple(param.shape)}")
        self._param = weakref.ref(param)
        self.rt = rt
        self.name = ""
        self.shape = param.shape
        self.numel = param.numel()
        self.dtype = param.dtype
        self.layout = ShardLayout(self.numel, rt.world_size, rt.rank)
        self.master: Stored | None = rt.store(
            self.layout.cut(param.detach(), torch.float32).to(rt.device), rt.state_tier, "master"
        )
        self.compute: Stored | None = None
        self.grad: torch.Tensor | None = None
        self.optim: dict[str, Stored] = {}
        self.group = None  # the ParamGroup that gathers this parameter (set by the engine)
        self.state = ParamState.SHARDED
        self.show_placeholder()

    @property
    def param(self) -> nn.Parameter:
        """The user's parameter (held weakly, so a dropped model frees its shards)."""
        p = self._param()
        assert p is not None, "parameter was garbage-collected while its shard was in use"
        return p

    @property
    def alive(self) -> bool:
        """False once the parameter object is gone (e.g. replaced by a tied one)."""
        return self._param() is not None

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad

    # -- what param.data shows ---------------------------------------------------------------
    def show_full(self, full: torch.Tensor) -> None:
        self.param.data = full
        self.state = ParamState.UNSHARDED

    def show_placeholder(self) -> None:
        self.param.data = _placeholder(self.shape, self.dtype)
        self.state = ParamState.SHARDED

    # -- shards ---------------------------------------------------------------------------------
    def prepare_for_training(self) -> None:
        """Create the training-dtype shard in the parameter tier; drop fp32 state if frozen.

        [Note: fp32 shards are shared, not copied]
        With fp32 compute and parameters in the same tier as the optimizer state, the compute
        shard *is* the master shard: the optimizer's update is what the next forward sees.
        """
        rt = self.rt
        assert self.master is not None
        if rt.compute_dtype == torch.float32 and rt.param_tier == rt.state_tier:
            self.compute = self.master
        else:
            values = load_now(self.master, rt.device).to(rt.compute_dtype)
            self.compute = rt.store(values, rt.param_tier, "params")
            if not self.trainable:
                self.master.free()
                self.master = None
        self.dtype = rt.compute_dtype
        if self.state is ParamState.SHARDED:
            self.show_placeholder()

    def free_storage(self) -> None:
        """Give back every shard's bytes (the parameter is gone)."""
        for stored in {id(s): s for s in (self.master, self.compute, *self.optim.values())
                       if s is not None}.values():
            stored.free()
        self.master = self.compute = None
        self.optim = {}

    def values_shard(self) -> torch.Tensor:
        """This rank's shard of the parameter's exact values (fp32 master when there is one)."""
        src = self.master if self.master is not None else self.compute
        assert src is not None
        return load_now(src, self.rt.device).to(torch.float32)

    def gather_values(self) -> torch.Tensor:
        """The full parameter in fp32, assembled by all-gather (a collective: all ranks call)."""
        shard = self.values_shard()
        out = torch.empty(self.layout.padded_numel, dtype=torch.float32, device=self.rt.device)
        self.rt.comm.all_gather(out, shard.contiguous()).wait()
        return out[: self.numel].view(self.shape)

    def write_values(self, full: torch.Tensor) -> None:
        """Replace this rank's shard with its slice of ``full`` (master and compute shards)."""
        shard = self.layout.cut(full.to(self.rt.device), torch.float32)
        if self.master is not None:
            self.master.save(shard).result()
        if self.compute is not None and self.compute is not self.master:
            self.compute.save(shard.to(self.compute.dtype)).result()
