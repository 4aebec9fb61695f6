"""The optimizer step over this rank's fp32 shards, streamed in sub-groups from their tier.

[Note: streamed sub-groups]
With optimizer state in memory, a shard's master weights and moments are resident tensors
and the update runs on them in place. With optimizer state on NVMe they are read into host
memory a sub-group at a time, sized so three sub-groups fit ``offload.host_buffer_bytes``:
while sub-group k is updated, k+1 is being read and k-1 written back. Both cases run the
same loop; for memory tiers a "read" is simply handing over the resident tensor.

[Note: torch's own kernels]
The update itself is ``torch.optim.adamw.adamw`` / ``torch.optim.sgd.sgd`` (fused when the
device supports it) over lists of shard tensors, so the arithmetic is exactly PyTorch's and a
parameter group's hyper-parameters (e.g. no weight decay on biases) apply per parameter.
Parameters that received no gradient in this step are skipped, as torch optimizers skip
parameters whose ``.grad`` is None.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.optim.adamw import adamw
from torch.optim.sgd import sgd

from outcore.config import OptimizerConfig
from outcore.param import ShardedParam
from outcore.runtime import Runtime
from outcore.storage import Tier

_STATE_KINDS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


@dataclass
class _Work:
    """One sub-group in flight: its params and their master/state tensors in memory."""

    params: list[ShardedParam]
    master: list[torch.Tensor] = field(default_factory=list)
    states: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    pending: list = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)  # sources of writes in flight

    def wait(self) -> None:
        for f in self.pending:
            f.result()
        self.pending, self.keep = [], []


class ShardedOptimizer:
    """AdamW or SGD over ShardedParams; ``param_groups`` is editable like torch's (e.g. lr)."""

    def __init__(self, groups: list[tuple[dict, list[ShardedParam]]], cfg: OptimizerConfig,
                 rt: Runtime) -> None:
        self.kind = cfg.type
        self.rt = rt
        self.param_groups: list[dict] = []
        self._members: list[list[ShardedParam]] = []
        for hp, sps in groups:
            self.param_groups.append(hp)
            self._members.append(sps)
        kinds = _STATE_KINDS[cfg.type] if (cfg.type == "adamw" or cfg.momentum) else ()
        grad_tier = Tier.DEVICE if rt.state_tier is Tier.DEVICE else Tier.HOST
        for sps in self._members:
            for sp in sps:
                zeros = torch.zeros(sp.shard_numel, dtype=torch.float32, device=rt.device)
                sp.grad = zeros.clone()
                rt.ledger.add(grad_tier.value, "grads", sp.grad.nbytes)
                sp.optim = {k: rt.store(zeros.clone() if rt.state_tier is not Tier.NVME else zeros,
                                        rt.state_tier, "optimizer") for k in kinds}
                sp.step = 0
                sp.has_grad = False
        self.state_kinds = kinds
        per_elem = 4 * (1 + len(kinds))
        self._subgroup_bytes = max(rt.cfg.offload.host_buffer_bytes // 3, per_elem)
        self._fused = rt.device.type in ("cpu", "cuda")

    @property
    def params(self) -> Iterator[ShardedParam]:
        for sps in self._members:
            yield from sps

    def zero_grad(self) -> None:
        for sp in self.params:
            sp.grad.zero_()
            sp.has_grad = False

    def step(self) -> None:
        """Update every parameter that received a gradient, then refresh its compute shard."""
        for hp, sps in zip(self.param_groups, self._members, strict=True):
            live = [sp for sp in sps if sp.has_grad]
            chunks = list(self._subgroups(live))
            ahead = self._load(chunks[0]) if chunks else None
            behind: _Work | None = None
            for i in range(len(chunks)):
                work = ahead
                ahead = self._load(chunks[i + 1]) if i + 1 < len(chunks) else None
                work.wait()
                self._update(work, hp)
                if behind is not None:
                    behind.wait()
                self._store(work)
                behind = work
            if behind is not None:
                behind.wait()

    def _subgroups(self, sps: list[ShardedParam]) -> Iterator[list[ShardedParam]]:
        if self.rt.state_tier is not Tier.NVME:
            if sps:
                yield sps
            return
        per_elem = 4 * (1 + len(self.state_kinds))
        chunk: list[ShardedParam] = []
        size = 0
        for sp in sps:
            if chunk and size + sp.shard_numel * per_elem > self._subgroup_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(sp)
            size += sp.shard_numel * per_elem
        if chunk:
            yield chunk

    def _load(self, sps: list[ShardedParam]) -> _Work:
        work = _Work(sps, states={k: [] for k in self.state_kinds})
        for sp in sps:
            for dst, stored in [(work.master, sp.master)] + [
                (work.states[k], sp.optim[k]) for k in self.state_kinds
            ]:
                t = stored.resident()
                if t is None:
                    t = torch.empty(stored.numel, dtype=stored.dtype)
                    work.pending.append(stored.load(t))
                dst.append(t)
        return work

    def _update(self, work: _Work, hp: dict) -> None:
        grads = [sp.grad for sp in work.params]
        if self.kind == "adamw":
            steps = [torch.tensor(float(sp.step), dtype=torch.float32) for sp in work.params]
            adamw(
                work.master, grads, work.states["exp_avg"], work.states["exp_avg_sq"], [], steps,
                fused=self._fused, foreach=False if self._fused else None, amsgrad=False,
                beta1=hp["betas"][0], beta2=hp["betas"][1], lr=hp["lr"],
                weight_decay=hp["weight_decay"], eps=hp["eps"], maximize=False,
            )
        else:
            bufs = work.states.get("momentum_buffer") or [None] * len(grads)
            sgd(
                work.master, grads, bufs, weight_decay=hp["weight_decay"],
                momentum=hp["momentum"], lr=hp["lr"], dampening=0.0, nesterov=hp["nesterov"],
                maximize=False,
            )
        for sp in work.params:
            sp.step += 1

    def _store(self, work: _Work) -> None:
        """Write back what lives on disk and refresh each compute shard from its master."""
        for i, sp in enumerate(work.params):
            if sp.master.resident() is None:
                work.pending.append(sp.master.save(work.master[i]))
                for k in self.state_kinds:
                    work.pending.append(sp.optim[k].save(work.states[k][i]))
            if sp.compute is not sp.master:
                cast = work.master[i].to(sp.compute.dtype)
                work.keep.append(cast)
                work.pending.append(sp.compute.save(cast))
