"""The execution plan: which code paths a run takes, decided once, each with its reason.

[Note: one place decides the path]
What outcore does for a step depends on a handful of facts: the world size, the tier of the
parameter shards and of the optimizer state, the compute device, the compute dtype, clipping
and a few switches of the config. Every path decision that follows from them (is a shard the
full tensor? is the fp32 master also the training shard? does the optimizer run during
backward?) is made here, once, when the runtime meets its device, and frozen. The runtime,
groups, parameters, optimizer, engine and ``Config.auto``'s placement read the plan instead
of re-deriving a decision from the config, so a decision cannot drift between two copies and
a user can read the whole path from ``engine.plan`` (or ``memory_report()["plan"]``) before a
step runs. ``tests/test_plan.py`` pins the plan for the configurations that matter.

Each decision is a property of the inputs only; the reason says why it comes out as it does
for *these* inputs, so ``explain()`` reads as an answer, not as documentation.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from outcore.offload.storage import Tier

STAGING_SLOTS = 3
"""Optimizer sub-groups in host memory at once when state streams from NVMe: one being read,
one updated, one written back (optim/optimizer.py's [Note: streamed sub-groups])."""

_STATE_KINDS = {"adamw": ("exp_avg", "exp_avg_sq"), "adam": ("exp_avg", "exp_avg_sq"),
                "sgd": ("momentum_buffer",), "adafactor": ("exp_avg_sq", "exp_avg")}


def optimizer_state_kinds(optimizer: str, momentum: float = 0.0) -> tuple[str, ...]:
    """The per-parameter state tensors ``optimizer`` keeps besides the fp32 master, in the
    names torch's optimizers give them (Adam's and AdamW's two moments; SGD's buffer only with
    momentum)."""
    if optimizer != "sgd" or momentum:
        return _STATE_KINDS[optimizer]
    return ()


@dataclass(frozen=True)
class Inputs:
    """The facts the plan is derived from (everything else in the config is a budget)."""

    world_size: int
    device: str  # "cpu" or "cuda"
    dtype: str  # the resolved compute dtype: "bf16" | "fp16" | "fp32"
    params: Tier
    optimizer: Tier
    optimizer_type: str = "adamw"
    momentum: float = 0.0
    gradient_clipping: float = 0.0
    track_grad_norm: bool = False
    overlap_optimizer: bool = True
    speculative_step: bool = True
    overlap_step_with_forward: bool = False
    resident_copies: bool = True
    aligned_regions: bool = True  # the OS can map aligned memory under a tensor's storage


@dataclass(frozen=True)
class ExecutionPlan:
    """Every path decision of a run; ``explain()`` gives each with its one-line reason."""

    inputs: Inputs
    grad_tier: Tier
    """Where fp32 gradient shards live between backward and their update."""
    compute_is_master: bool
    """The training-dtype shard is the fp32 master shard itself (zero/param.py)."""
    derives_compute_copy: bool
    """A trainable parameter's training-dtype shard is cast from its master on each read and
    stored nowhere (offload/storage.py's ``CastShard``)."""
    zero_copy: bool
    """A shard is the full tensor: groups show it and never reshard (zero/group.py)."""
    aligned_gather: bool
    """Shards are read from disk into page-aligned places of the all-gather buffer."""
    aligned_full: bool
    """Full tensors get page-aligned memory so disk reads land in them directly."""
    keeps_grad_buffers: bool
    """Each fp32 gradient buffer is kept from step to step instead of freed after its update."""
    holds_raw_grads: bool
    """A gradient stays in backward's dtype until its update reads it (no fp32 copy)."""
    carries_head: bool
    """Groups the next forward needs first stay gathered through the step (overlap/schedule.py)."""
    state_in_host_memory: bool
    """The optimizer state occupies host memory, so the host is sized for it."""
    streams: bool
    """Something streams from NVMe, so the optimizer takes half the host buffer budget."""
    loss_scaling: bool
    """fp16's dynamic loss scaling is on."""
    speculates: bool
    """With clipping or fp16, updates during backward are tentative until ``step()`` has the
    norm and the overflow check."""
    overlaps_optimizer: bool
    """Parameter updates start during the boundary backward, group by group."""
    defers_updates: bool
    """``step()`` may return before the last updates finish."""
    keeps_copies_resident: bool
    """Training copies on NVMe whose groups fit the prefetch budget live in host memory
    instead, refreshed in place by their updates (zero/build.py's ``keep_resident``)."""
    state_kinds: tuple[str, ...]
    """Optimizer state tensors per parameter besides the master."""
    staged_kinds: tuple[str, ...]
    """fp32 tensors a streamed optimizer sub-group stages in host memory per element."""
    staged_cast: bool
    """A streamed sub-group also stages the training-dtype copy it writes back."""
    grad_slot: bool
    """A streamed sub-group stages its gradients in fp32: a cast of 16-bit ones, or fp16's
    unscaled copy for a tentative update."""
    staging_slots: int
    """Sub-groups in host memory at once (read, update, write back)."""
    reasons: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def derive(cls, inputs: Inputs) -> ExecutionPlan:
        """Decide every path for ``inputs``; see the note above."""
        decisions = dict(_decide(inputs))
        values = {name: value for name, (value, _) in decisions.items()}
        reasons = {name: reason for name, (_, reason) in decisions.items()}
        return cls(inputs=inputs, **values, reasons=reasons)

    @classmethod
    def for_config(cls, cfg: Any, world_size: int, device: str, aligned_regions: bool = True,
                   *, dtype: str | None = None, params: str | None = None,
                   optimizer: str | None = None) -> ExecutionPlan:
        """The plan for ``cfg`` on ``device``; ``dtype`` (default ``cfg.dtype``) must be
        resolved, not ``auto``. ``params``/``optimizer`` price another placement of the same
        settings (``Config.auto`` tries several)."""
        dtype = dtype or cfg.dtype
        if dtype == "auto":
            raise ValueError("the execution plan needs the resolved dtype, not 'auto'")
        opt = cfg.optimizer
        return cls.derive(Inputs(
            world_size=world_size, device=device, dtype=dtype,
            params=Tier.for_placement(params or cfg.offload.params),
            optimizer=Tier.for_placement(optimizer or cfg.offload.optimizer),
            optimizer_type=opt.type, momentum=opt.momentum,
            gradient_clipping=cfg.gradient_clipping, track_grad_norm=cfg.track_grad_norm,
            overlap_optimizer=cfg.zero.overlap_optimizer,
            speculative_step=cfg.zero.speculative_step,
            overlap_step_with_forward=cfg.zero.overlap_step_with_forward,
            resident_copies=cfg.zero.resident_copies,
            aligned_regions=aligned_regions))

    def explain(self) -> Iterator[tuple[str, Any, str]]:
        """``(decision, value, reason)`` for every decision, in declaration order."""
        for name in self.reasons:
            value = getattr(self, name)
            yield name, value.value if isinstance(value, Tier) else value, self.reasons[name]

    def to_json(self) -> dict[str, Any]:
        """The inputs and every decision with its reason, for reports and manifests."""
        inputs = {k: v.value if isinstance(v, Tier) else v for k, v in asdict(self.inputs).items()}
        return {"inputs": inputs,
                "decisions": {name: {"value": list(v) if isinstance(v, tuple) else v,
                                     "reason": why} for name, v, why in self.explain()}}

    def __str__(self) -> str:
        rows = [(name, _show(value), why) for name, value, why in self.explain()]
        names, values = (max(len(r[i]) for r in rows) for i in (0, 1))
        return "\n".join(f"{n:<{names}}  {v:<{values}}  {why}" for n, v, why in rows)


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value) or "-"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _decide(i: Inputs) -> Iterator[tuple[str, tuple[Any, str]]]:
    """Every decision in dependency order, as ``(name, (value, reason))``."""
    one, on_cpu, cuda = i.world_size == 1, i.device == "cpu", i.device == "cuda"
    p, s = i.params, i.optimizer
    where = f"params in {p.value}, optimizer state in {s.value}"
    ranks = "one rank" if one else f"{i.world_size} ranks"

    grad_tier = Tier.DEVICE if s is Tier.DEVICE else Tier.HOST
    yield "grad_tier", (grad_tier, "beside the optimizer state that reads them, but never on "
                        "disk: the update reads them right after backward")

    compute_is_master = i.dtype == "fp32" and p is s
    yield "compute_is_master", (compute_is_master, (
        "fp32 compute with params and masters in one tier: one shard serves both"
        if compute_is_master else f"{i.dtype} compute" if i.dtype != "fp32"
        else f"params ({p.value}) and masters ({s.value}) live in different tiers"))

    derive = p is Tier.NVME and s is not Tier.NVME and not compute_is_master
    yield "derives_compute_copy", (derive, (
        "params on NVMe, masters in memory: a trainable parameter's copy is cast from its "
        "master at each fetch, never written (frozen ones stay on NVMe)" if derive else
        "the masters are the training shards" if compute_is_master else
        f"params in {p.value}, masters in {s.value}: the training copy is stored"))

    zero_copy = one and (p is Tier.DEVICE or (p is Tier.HOST and not cuda))
    yield "zero_copy", (zero_copy, (
        f"{ranks}, params resident on the compute device: the shard is the full tensor"
        if zero_copy else f"{ranks}, params in {p.value}: full tensors are gathered per use"))

    aligned_gather = not one and p is Tier.NVME
    yield "aligned_gather", (aligned_gather, (
        "shards read from NVMe land page-aligned in the all-gather buffer (O_DIRECT)"
        if aligned_gather else "no all-gather buffer is filled from disk"))

    aligned_full = one and p is Tier.NVME and on_cpu and i.aligned_regions
    yield "aligned_full", (aligned_full, (
        "one rank on the CPU reads NVMe shards straight into page-aligned full tensors"
        if aligned_full else "needs one rank, params on NVMe, a CPU device and aligned memory "
        "under a tensor (torch 2.12 or newer, on an OS that maps it)"))

    keeps = s is not Tier.NVME
    yield "keeps_grad_buffers", (keeps, (
        "state in memory: the step needs every gradient at once, so buffers are reused"
        if keeps else "state on NVMe: each gradient is freed once its update consumed it"))

    raw = one and on_cpu and not keeps and i.dtype != "fp16"
    yield "holds_raw_grads", (raw, (
        "one rank on the CPU with state on NVMe and no loss scaling (clipping scales a "
        "gradient as its update reads it)"
        if raw else "needs one rank, a CPU device, state on NVMe and no fp16"))

    carry = one and s is not Tier.NVME
    yield "carries_head", (carry, (
        "one rank with masters in memory: the step refreshes kept full tensors in place"
        if carry else "kept full tensors could only be refreshed from disk: released"))

    in_host = s is Tier.HOST or (s is Tier.DEVICE and on_cpu)
    yield "state_in_host_memory", (in_host, where)

    streams = s is Tier.NVME or p is Tier.NVME
    yield "streams", (streams, (
        "NVMe traffic: the optimizer stages sub-groups in half the host buffer budget"
        if streams else "nothing on NVMe: the host buffer budget is unused"))

    loss_scaling = i.dtype == "fp16"
    yield "loss_scaling", (loss_scaling, f"{i.dtype} compute")

    checks = [what for what, on in (("the norm needs no clipping", i.gradient_clipping > 0),
                                    ("no gradient overflowed", loss_scaling)) if on]
    speculates = (i.overlap_optimizer and i.speculative_step and bool(checks)
                  and s is Tier.NVME and i.optimizer_type != "adafactor")
    yield "speculates", (speculates, (
        "updates during backward are written aside and kept if "
        + " and ".join(checks) + ", else redone or, on an overflow, dropped "
        "(optim/speculation.py)" if speculates
        else "needs gradient clipping or fp16, zero.overlap_optimizer and "
        "zero.speculative_step, the state on NVMe and no Adafactor"))

    hides = s is Tier.NVME or cuda
    overlap = (i.overlap_optimizer and (i.gradient_clipping == 0 or speculates)
               and (not loss_scaling or speculates) and hides
               and i.optimizer_type != "adafactor")
    yield "overlaps_optimizer", (overlap, _overlap_reason(i, loss_scaling, hides, speculates))

    # the tail is worth running into the next forward where its updates are long beside that
    # forward: with the state on NVMe, or in host memory beside a GPU, whose forward takes
    # none of the host's cores (bench/gpu/2026-11-27-h100: a 0.26-0.57 s tail after a 0.4 s
    # backward)
    defer = (overlap and i.overlap_step_with_forward
             and (s is Tier.NVME or (cuda and s is Tier.HOST)) and not speculates
             and not i.track_grad_norm and not zero_copy)
    yield "defers_updates", (defer, (
        "zero.overlap_step_with_forward: the next forward runs behind the last updates"
        if defer else "off unless zero.overlap_step_with_forward, with the optimizer "
        "overlapped, state on NVMe or in a CUDA device's host memory, no speculation "
        "(clipping or fp16), no gradient norm tracked and no zero-copy shards"))

    resident = (i.resident_copies and one and on_cpu and p is Tier.NVME and s is Tier.NVME
                and not compute_is_master)
    yield "keeps_copies_resident", (resident, (
        "one rank on the CPU, everything on NVMe: groups that fit the prefetch budget keep "
        "their training copies in host memory, updated in place, never written or read back"
        if resident else "needs zero.resident_copies, one rank, a CPU device, params and "
        "state on NVMe in separate shards"))

    kinds = optimizer_state_kinds(i.optimizer_type, i.momentum)
    yield "state_kinds", (kinds, f"{i.optimizer_type}"
                          + (f", momentum {i.momentum}" if i.optimizer_type == "sgd" else ""))

    staged = ("master", *kinds) if s is Tier.NVME else ()
    yield "staged_kinds", (staged, "state on NVMe is read into host memory per sub-group"
                           if staged else "state in memory is updated in place")

    cast = p is Tier.NVME and not compute_is_master
    yield "staged_cast", (cast, "params on NVMe in another shard than the master: the update "
                          "writes the cast copy" if cast else "no separate shard on NVMe")

    unscales = speculates and loss_scaling
    slot = bool(staged) and ((raw and i.dtype != "fp32") or unscales)
    yield "grad_slot", (slot, (
        "a tentative update unscales each fp16-scaled gradient into a reused buffer (it keeps "
        "the gradient itself for step())" if unscales else
        "16-bit raw gradients are cast per slice into a reused buffer" if slot
        else "gradients reach the update in fp32"))

    yield "staging_slots", (STAGING_SLOTS, "one sub-group read, one updated, one written back")


def _overlap_reason(i: Inputs, loss_scaling: bool, hides: bool, speculates: bool) -> str:
    if not i.overlap_optimizer:
        return "zero.overlap_optimizer is off"
    if i.optimizer_type == "adafactor":
        return "Adafactor all-reduces whole-parameter statistics (adafactor.py's note)"
    if speculates:
        return "tentative updates run while backward goes on (see speculates)"
    if i.gradient_clipping:
        return ("clipping needs the global norm of every gradient before any update "
                "(unless the updates are tentative: see speculates)")
    if loss_scaling:
        return ("an fp16 overflow anywhere must cancel the whole step (unless the updates "
                "are tentative: see speculates)")
    if not hides:
        return ("state in memory on a CPU device: nothing to hide, and the update would "
                "compete with backward for the same cores")
    return "updates (and their NVMe traffic) run while backward goes on"
