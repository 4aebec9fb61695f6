"""Adafactor over this rank's flat slices: transformers' ``Adafactor``, exactly, at any world size.

[Note: Adafactor over slices]
Adafactor keeps, for a weight of shape (..., R, C), the moving averages of the squared
gradient's row means and column means instead of one per element, and scales each update by
the root-mean-square of the whole update and (``scale_parameter``) of the whole parameter.
Every one of those is a sum over whole rows, columns or the whole tensor, while a rank holds a
flat slice that may start and end inside a row. So each rank adds its elements into per-row
and per-column partial sums (``index_add_`` by the element's row and column) and the sums of
squares it needs, one all-reduce adds the ranks' parts, and every rank then holds the same
full row and column statistics (R + C numbers per matrix: kept whole on every rank, in memory,
and saved once in a checkpoint) and applies the update to its own slice. A second all-reduce
gives the update's norm. The arithmetic is transformers' ``Adafactor.step`` term by term, so
the result equals it at one rank and at any number. It needs the master weights and moments
resident (``offload.optimizer`` none or cpu): its statistics need the whole slice before any
of it is updated, which the streamed NVMe pipeline (optimizer.py) does not give, and it
never runs during backward (its all-reduces would interleave with backward's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from outcore.errors import ConfigError

if TYPE_CHECKING:
    from outcore.offload.storage import StoredShard
    from outcore.optim.speculation import ParamState
    from outcore.runtime import Runtime
    from outcore.zero.param import ShardedParam

# the keys of transformers' Adafactor groups, with its defaults
DEFAULTS: dict[str, Any] = {"lr": None, "eps": (1e-30, 1e-3), "clip_threshold": 1.0,
                            "decay_rate": -0.8, "beta1": None, "weight_decay": 0.0,
                            "scale_parameter": True, "relative_step": True,
                            "warmup_init": False}


@dataclass(eq=False)
class Factors:
    """One parameter's Adafactor state besides its elementwise moments (those are StoredShard in
    the optimizer's ``moments``): the replicated row and column averages of a factored
    weight (None for a vector)."""

    row: torch.Tensor | None = None  # (B, R): every rank holds all of it
    col: torch.Tensor | None = None  # (B, C)


def check(group: dict[str, Any], optimizer_placement: str) -> None:
    """Refuse what cannot run (see the note)."""
    check_placement(optimizer_placement)
    if group["lr"] is None and not group.get("relative_step", True):
        raise ConfigError("Adafactor: lr=None needs relative_step=True (transformers refuses "
                          "it too)")


def check_placement(optimizer_placement: str) -> None:
    """Adafactor's state must be in memory: refused before anything is sharded."""
    if optimizer_placement == "nvme":
        raise ConfigError("Adafactor needs offload.optimizer cpu or none: its statistics need "
                          "each parameter's whole slice before any of it is updated, which "
                          "outcore's NVMe streaming does not give (adafactor.py's note)")


def shape3(shape: torch.Size) -> tuple[int, int, int]:
    """(B, R, C) of a weight of two or more dimensions."""
    rows, cols = shape[-2], shape[-1]
    return math.prod(shape[:-2]), rows, cols


def new_factors(sp: ShardedParam, device: torch.device) -> Factors:
    if len(sp.shape) < 2:
        return Factors()
    b, r, c = shape3(sp.shape)
    return Factors(row=torch.zeros(b, r, device=device), col=torch.zeros(b, c, device=device))


def update(sp: ShardedParam, master: torch.Tensor, grad: torch.Tensor, f: Factors,
           moments: dict[str, torch.Tensor], group: dict[str, Any], rt: Runtime,
           step_no: int) -> None:
    """Step ``step_no`` (from 1) of Adafactor on ``sp``'s slice, in place on ``master`` and
    the moments; a collective (every rank calls it for the same parameters, in order)."""
    if sp.numel == 0:  # nothing to update, nor an RMS to divide by: on every rank alike
        return
    n = sp.layout.valid_numel
    p, g = master[:n], grad[:n].float()
    squares = (g * g) + group["eps"][0]
    sums = [p.double().pow(2).sum().float().reshape(1)]  # for the parameter's RMS
    if f.row is not None:
        b, r, c = shape3(sp.shape)
        index = torch.arange(sp.layout.start, sp.layout.start + n, device=p.device)
        rows, cols = index // c, (index // (r * c)) * c + index % c
        sums += [torch.zeros(b * r, device=p.device).index_add_(0, rows, squares),
                 torch.zeros(b * c, device=p.device).index_add_(0, cols, squares)]
    total = rt.comm.all_reduce_sum(torch.cat(sums))
    rms = math.sqrt(float(total[0]) / sp.numel)
    lr = _lr(group, step_no, rms)
    beta2t = 1.0 - math.pow(step_no, group["decay_rate"])
    if f.row is not None:
        assert f.col is not None  # new_factors sets both or neither
        f.row.mul_(beta2t).add_(total[1:1 + b * r].view(b, r) / c, alpha=1.0 - beta2t)
        f.col.mul_(beta2t).add_(total[1 + b * r:].view(b, c) / r, alpha=1.0 - beta2t)
        r_factor = (f.row / f.row.mean(dim=-1, keepdim=True)).rsqrt().reshape(-1)
        c_factor = f.col.rsqrt().reshape(-1)
        step = r_factor[rows] * c_factor[cols] * g
    else:
        sq = moments["exp_avg_sq"][:n]
        sq.mul_(beta2t).add_(squares, alpha=1.0 - beta2t)
        step = sq.rsqrt() * g
    norm = rt.comm.all_reduce_sum(step.double().pow(2).sum().float().reshape(1))
    step.div_(max(1.0, math.sqrt(float(norm[0]) / sp.numel) / group["clip_threshold"]))
    step.mul_(lr)
    if group["beta1"] is not None:
        avg = moments["exp_avg"][:n]
        avg.mul_(group["beta1"]).add_(step, alpha=1 - group["beta1"])
        step = avg
    if group["weight_decay"] != 0:
        p.add_(p, alpha=-group["weight_decay"] * lr)
    p.add_(-step)


def _lr(group: dict[str, Any], step: int, rms: float) -> float:
    """transformers' ``Adafactor._get_lr``."""
    rel: float | None = group["lr"]
    if group["relative_step"]:
        low = 1e-6 * step if group["warmup_init"] else 1e-2
        rel = min(low, 1.0 / math.sqrt(step))
    assert rel is not None  # check() refused lr=None without relative_step
    scale: float = max(group["eps"][1], rms) if group["scale_parameter"] else 1.0
    return scale * rel


def moment_kinds(sp: ShardedParam, group: dict[str, Any]) -> tuple[str, ...]:
    """The elementwise moments ``sp`` keeps (names as transformers' Adafactor's state)."""
    kinds = () if len(sp.shape) >= 2 else ("exp_avg_sq",)
    return (*kinds, "exp_avg") if group.get("beta1") is not None else kinds


FACTOR_KINDS = ("exp_avg_sq_row", "exp_avg_sq_col")


def _resident(stored: StoredShard | None) -> torch.Tensor:
    """The live tensor of ``stored``: Adafactor's master weights and moments are in memory
    (``check_placement`` refused NVMe), and a trainable parameter keeps its master."""
    assert stored is not None, "Adafactor updates only parameters with an fp32 master"
    tensor = stored.resident()
    assert tensor is not None, "Adafactor's state is in memory (check_placement)"
    return tensor


class Runner:
    """The optimizer's Adafactor part: group defaults, the factors, the step, their state."""

    def __init__(self, groups: list[dict[str, Any]], members: list[list[ShardedParam]],
                 rt: Runtime) -> None:
        self.rt = rt
        for group in groups:
            # a group of an outcore config: an adopted Adafactor's holds every key of its own
            # (a group's eps pair had been taken for one, and the lr given became relative)
            if "relative_step" not in group:
                group["relative_step"] = False  # the lr given is the lr, as with
                group.setdefault("scale_parameter", False)  # Trainer's optim="adafactor"
            if not isinstance(group.get("eps"), (tuple, list)):  # the config's Adam eps
                group["eps"] = DEFAULTS["eps"]
            for key, value in DEFAULTS.items():
                group.setdefault(key, value)
            check(group, rt.state_tier.value)
        self.group_of = {id(sp): group for group, sps in zip(groups, members, strict=True)
                         for sp in sps}
        # beside the masters and gradients they are combined with (the state's tier)
        self.factors = {id(sp): new_factors(sp, rt.grad_device) for sps in members for sp in sps}

    def kinds_of(self, sp: ShardedParam) -> tuple[str, ...]:
        return moment_kinds(sp, self.group_of[id(sp)])

    def step(self, sps: list[ShardedParam], states: dict[ShardedParam, ParamState]) -> None:
        """Update ``sps`` (with gradients), in the same order on every rank."""
        for sp in sps:
            state = states[sp]
            state.step += 1
            moments = {k: _resident(stored) for k, stored in state.moments.items()}
            master = _resident(sp.master_shard)
            assert sp.grad is not None  # the optimizer passes only parameters that got one
            update(sp, master, sp.grad, self.factors[id(sp)], moments,
                   self.group_of[id(sp)], self.rt, state.step)
            sp.write_shard(master)  # updated in place: only the training copy follows

    def factors_of(self, sp: ShardedParam) -> dict[str, torch.Tensor]:
        f = self.factors[id(sp)]
        if f.row is None:
            return {}
        assert f.col is not None  # new_factors sets both or neither
        return {"exp_avg_sq_row": f.row.view(sp.shape[:-1]).clone(),
                "exp_avg_sq_col": f.col.view((*sp.shape[:-2], sp.shape[-1])).clone()}

    def factors_of_live(self, sp: ShardedParam) -> list[torch.Tensor]:
        """``sp``'s factors themselves (none for a parameter that keeps none), to reset."""
        f = self.factors[id(sp)]
        return [] if f.row is None or f.col is None else [f.row, f.col]

    def load_factors(self, sp: ShardedParam, entry: dict[str, Any]) -> None:
        for target, value in self.checked_factors(sp, entry):
            target.copy_(value)

    def checked_factors(self, sp: ShardedParam, entry: dict[str, Any]
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``sp``'s factors and the values ``entry`` holds for them, each checked (a refused
        load writes nothing); empty for a parameter that keeps no factors."""
        f = self.factors[id(sp)]
        if f.row is None:
            return []
        assert f.col is not None  # new_factors sets both or neither
        pairs = []
        for kind, target in zip(FACTOR_KINDS, (f.row, f.col), strict=True):
            if kind not in entry:
                raise ConfigError(f"Adafactor state for {sp.label()} has no {kind!r}")
            try:  # on the factor's device now: a load that fails here has written nothing
                value = torch.as_tensor(entry[kind]).to(target.device, target.dtype)
            except (TypeError, ValueError, RuntimeError, NotImplementedError) as e:
                raise ConfigError(f"Adafactor state {kind!r} for {sp.label()} is not a tensor "
                                  f"of numbers ({e})") from None
            if value.numel() != target.numel():
                raise ConfigError(f"Adafactor state {kind!r} for {sp.label()} has shape "
                                  f"{list(value.shape)}; it holds {target.numel()} values")
            pairs.append((target, value.reshape(target.shape)))
        return pairs

    def replicated(self, name_of: dict[int, str]) -> dict[str, torch.Tensor]:
        """The factors by checkpoint key (the same on every rank: rank 0 saves them)."""
        out: dict[str, torch.Tensor] = {}
        for key, f in self.factors.items():
            if f.row is not None:
                assert f.col is not None  # new_factors sets both or neither
                out[f"{name_of[key]}::exp_avg_sq_row"] = f.row
                out[f"{name_of[key]}::exp_avg_sq_col"] = f.col
        return out
