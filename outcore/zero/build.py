"""What the engine builds over a model: its sharded parameters, their groups, its buffers.

Each step is a free function over the model and the runtime, so the engine's constructor
reads as the list of them (engine/core.py), and each one is tested by what it leaves behind.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import xxhash
from torch import nn

from outcore.config import Config
from outcore.device.compute_dtype import DTYPES
from outcore.errors import ConfigError, user_stacklevel
from outcore.offload.host_memory import MOSTLY_FROZEN
from outcore.offload.storage import digest
from outcore.offload.tier import Tier
from outcore.runtime import Runtime
from outcore.zero.group import GatherGroup
from outcore.zero.param import ShardedParam
from outcore.zero.registry import managed, register


def shard_params(module: nn.Module, rt: Runtime, prepare: bool = True) -> list[ShardedParam]:
    """Every parameter of ``module`` sharded (once: a model built under ``outcore.init``
    already is) and, with ``prepare``, given its training-dtype shard; tied parameters once.
    The engine prepares them itself once its groups say where each copy lives
    (``keep_resident``)."""
    fresh = [(n, p) for n, p in module.named_parameters() if managed(p) is None]
    check_alike_across_ranks(fresh, rt)
    wide = [n for n, p in module.named_parameters() if p.dtype == torch.float64]
    if wide:  # trained in fp32 with no word, and back at close() with fp32's precision
        warnings.warn(f"parameter{'s' * (len(wide) > 1)} {', '.join(wide[:3])}"
                      f"{' and more' * (len(wide) > 3)} {'are' if len(wide) > 1 else 'is'} "
                      "float64: outcore keeps fp32 masters, so training is in fp32, and "
                      "close() gives float64 back with fp32's precision",
                      stacklevel=user_stacklevel())
    sps = []
    for name, p in module.named_parameters():
        sp = managed(p)
        if sp is None:
            sp = ShardedParam(p, rt)
            register(p, sp)
        sp.name = name
        if prepare:
            sp.prepare_for_training()
        sps.append(sp)
    return sps


def check_alike_across_ranks(named: list[tuple[str, nn.Parameter]], rt: Runtime) -> None:
    """[Note: every rank hands initialize the same values]
    Each rank keeps its 1/W slice of the values *it* was given, so a model built with
    another seed on each rank (or another checkpoint loaded) became a mix of the ranks'
    models, slice by slice, equal to none of them, and trained on without a word: a user's
    probe at 2 ranks found the gathered weights 0.48 from either rank's. DDP hides this by
    broadcasting rank 0's values; ``outcore.init`` refuses ranks whose RNG states differ
    (zero/init.py). Here every rank hashes each parameter it is about to shard (xxh3 of its
    bytes: exact, with no floating-point sum whose order could differ) and one collective
    compares the digests, so all ranks refuse together, naming the parameters. It reads
    the model once, at initialize only; parameters already sharded (built under
    ``outcore.init``) are not read again."""
    if rt.world_size == 1:
        return
    # first the parameters themselves: a digest per parameter, compared in one collective
    # of as many values as parameters, aborted gloo (C++ ``EnforceNotMet``, no word of the
    # model) where one rank's model had a layer more
    layout = "\n".join(f"{name} {tuple(p.shape)} {p.dtype}" for name, p in named)
    if not all(rt.comm.alike([len(named), xxhash.xxh3_64_intdigest(layout.encode())])):
        raise ConfigError(
            f"the ranks passed different models: this rank's has {len(named)} parameters to "
            "shard, and another rank's differs in how many, their names, shapes or dtypes. "
            "Build the same model on every rank")
    if not named:
        return
    alike = rt.comm.alike([value_digest(p) for _, p in named])
    differ = [name for (name, _), same in zip(named, alike, strict=True) if not same]
    if differ:
        shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
        raise ConfigError(
            f"the ranks passed different values for {shown}: each rank would keep its slice "
            "of its own model, a mix equal to none of them. Build the model alike on every "
            "rank: seed each the same (torch.manual_seed) before building it, or build it "
            "under outcore.init (which checks the seed), or load the same weights on each")


def value_digest(p: torch.Tensor) -> int:
    """xxh3 of a tensor's values wherever it lives (0 for a meta tensor, which has none)."""
    t = p.detach()
    return 0 if t.device.type == "meta" else digest(t.contiguous().cpu())  # meta: no values


def keep_resident(groups: list[GatherGroup], rt: Runtime, budget: int) -> set[int]:
    """The groups whose training copies live in host memory: the indices of those chosen.

    [Note: training copies kept in memory across steps]
    With params and optimizer state on NVMe, every step writes each layer's 16-bit copy
    after its update and the next forward reads it back: on gpt-335m 0.67 GB each way, 14%
    of the 9.4 GB a step moves at 512 tokens, in a step bound by the disk. Yet the default
    prefetch budget (5% of the free memory, ~1.1 GiB on a 24 GiB host) already holds that
    whole model gathered from forward to backward, so the memory is spent either way. A
    group whose copies stay in host memory instead costs the same bytes and moves none:
    its update casts the new master into the copy in place (optim/optimizer.py's
    ``stage_out``), and the group is zero-copy, its copies the tensors the model shows, as
    with params in host memory. Per byte of budget this saves a write and a read a step,
    where keeping a group from forward to backward saves one read; so the budget goes to
    resident groups first, in the model's order, keeping room for the two largest groups
    still streamed, and the schedule gets what is left. Only where the plan allows it
    (``keeps_copies_resident``): one rank on the CPU. With the step's tail run into the next
    forward (``zero.overlap_step_with_forward``) a copy may still be written after
    ``step()``: the forward waits for that update before it reads the copy, at its group's
    fetch or at a direct read of the weight, as for a fetch from disk (group.py's
    ``refresh_after_step``). A tentative update (clipping, fp16: the
    speculative step) writes the copy in place too, so nothing reads the copy ahead of
    ``step()``: a read of the weight is served from its master, which keeps the old values
    until then (zero/access.py, ``ShardedParam.read_value``), and a forward, which reads the
    copy itself, takes the tentative updates back first, for the step to redo
    (engine/core.py's ``_before_forward``, also for a submodule called on its own). Never
    for frozen parameters, which have no update to feed them; nor where most of the model
    is frozen (a LoRA base), whose budget is the base's read-ahead. A user's
    ``zero.prefetch_bytes`` is the bound either way: at 64 MiB (the smallest footprint)
    only the small groups fit.
    """
    if not rt.plan.keeps_copies_resident or _mostly_frozen(groups):
        return set()
    streamed = {g.index: g.full_bytes for g in groups if not (g.zero_copy or g.persistent)}
    chosen: set[int] = set()
    for g in groups:
        if g.zero_copy or not g.params or not all(
                sp.trainable and sp.master_shard is not None for sp in g.params):
            continue
        left = sorted((n for i, n in streamed.items() if i != g.index), reverse=True)
        if g.full_bytes + sum(left[:2]) <= budget:  # room for the two largest still streamed
            budget -= g.full_bytes
            streamed.pop(g.index, None)
            chosen.add(g.index)
            g.zero_copy = g.persistent = True
    return chosen


def prepare_shards(params: list[ShardedParam], resident: set[int]) -> None:
    """Give every parameter its training-dtype shard: in host memory for a resident group
    (``keep_resident``), else in the parameter tier."""
    rounded = [sp for sp in params if not sp.trainable and sp.master_shard is None
               and sp.compute_shard is not None and not sp.compute_shard.read_only
               and sp.compute_shard.dtype not in (sp.rt.compute_dtype, torch.float32)]
    stored = rounded[0].compute_shard.dtype if rounded and rounded[0].compute_shard else None
    for sp in params:
        home = Tier.HOST if sp.group is not None and sp.group.index in resident else None
        sp.prepare_for_training(home)
    if rounded and stored is not None:  # their shards are the compute dtype's now
        warn_rounded_base(rounded, stored)


def warn_rounded_base(rounded: list[ShardedParam], stored: torch.dtype) -> None:
    """[Note: a frozen base narrower than the engine]
    A parameter born frozen (param.py's [Note: a parameter born frozen]) keeps only the
    values it was stored with, in the dtype of the ``outcore.init`` that built it; an engine
    that computes in another cannot restore the digits they lost: fp32 has more of them, fp16
    more mantissa bits than bf16 (and a narrower range), bf16 fewer than fp16. (A base stored
    in fp32 and computed in 16 bits is rounded once, as the engine's dtype asks: nothing said.)
    The two dtypes differ without anyone asking when ``outcore.init``'s config says
    ``dtype: auto`` (bf16 on a CPU that multiplies it natively) and ``OutcoreTrainer``, whose
    ``TrainingArguments`` lack ``bf16=True``, trains in fp32: a user's probe found the base's
    logits 1.7e-3 from the same model loaded by plain transformers. That is a legitimate
    setup (a 16-bit base under fp32 adapters), so it is said once, not refused. Read in place
    from a folder (NVMe), the values are cast from the file as they land and nothing is
    lost: no warning there."""
    if rounded[0].rt.rank != 0:
        return  # every rank's base is alike: one line, not one a rank
    names = {v: k for k, v in DTYPES.items()}
    compute = rounded[0].rt.compute_dtype
    have, want = names.get(stored, str(stored)), names.get(compute, str(compute))
    shown = ", ".join(sp.label() for sp in rounded[:3]) + (", ..." if len(rounded) > 3 else "")
    warnings.warn(
        f"{len(rounded)} frozen parameters ({shown}) hold only {have} values: they were frozen "
        f"when outcore sharded them (under outcore.init(frozen=True) with dtype {have}, or by an "
        f"earlier engine), and this engine computes in {want}, so they keep {have}'s rounding. "
        f"For exact {want} values give outcore.init the same dtype (\"dtype\": \"{want}\"), "
        f"or train in {have} (OutcoreTrainer: TrainingArguments {have}=True)",
        stacklevel=user_stacklevel())


def build_groups(module: nn.Module, rt: Runtime, persistence_threshold_bytes: int
                 ) -> tuple[list[GatherGroup], dict[nn.Module, list[GatherGroup]]]:
    """One group per module's own parameters; tied parameters join their first owner.
    Returns the groups and, per module, the groups it uses."""
    groups: list[GatherGroup] = []
    module_groups: dict[nn.Module, list[GatherGroup]] = {}
    for name, m in module.named_modules():
        own = list({id(sp): sp for p in m._parameters.values()
                    if p is not None and (sp := managed(p))}.values())
        new = [sp for sp in own if sp.group is None]
        if new:
            groups.append(GatherGroup(len(groups), name or "<root>", new, rt,
                                     persistence_threshold_bytes))
        uses: list[GatherGroup] = []
        for sp in own:
            assert sp.group is not None  # the group made above, or an earlier module's
            if sp.group not in uses:
                uses.append(sp.group)
        module_groups[m] = uses
    return groups, module_groups


def cast_buffers(module: nn.Module, rt: Runtime
                 ) -> list[tuple[nn.Module, str, torch.dtype, torch.device]]:
    """Floating buffers follow the compute dtype, as ``module.to(dtype)`` would do, but for
    wider ones in an fp32 run: a float64 buffer cast to fp32 and back at ``close()`` came
    back with its precision gone (a user's probe), so it stays float64 as in PyTorch; a
    16-bit one (a model loaded in bf16) is computed with in fp32 like its parameters. Every
    buffer moves to the device. Returns where each was, for ``close()`` to put it back
    (engine/lifetime.py)."""
    fp32 = rt.compute_dtype == torch.float32
    before = []
    for m in module.modules():
        for key, buf in m._buffers.items():
            if buf is not None:
                before.append((m, key, buf.dtype, buf.device))
                wide = fp32 and buf.is_floating_point() and buf.element_size() >= 4
                dtype = rt.compute_dtype if buf.is_floating_point() and not wide else buf.dtype
                m._buffers[key] = buf.to(device=rt.device, dtype=dtype)
    return before


def to_compute(obj: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """Tensors in ``obj`` (nested lists, tuples, dicts) on ``device``, the floating ones in
    ``dtype`` (None: kept): a model's inputs, moved and cast where it computes, as FSDP2's
    root does."""
    if isinstance(obj, torch.Tensor):
        cast = dtype is not None and obj.is_floating_point()
        return obj.to(device, dtype) if cast else obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple takes positions
        return type(obj)(*(to_compute(o, device, dtype) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_compute(o, device, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: to_compute(v, device, dtype) for k, v in obj.items()}
    return obj


def prefetch_budget(cfg: Config, groups: list[GatherGroup], nvme_share: int = 0) -> int:
    """The schedule's budget for groups fetched ahead: ``zero.prefetch_bytes``, and where it
    is at its default value, at least the two largest groups that are fetched, and at least
    ``nvme_share``: for parameters on NVMe, what the free memory affords (the engine passes
    ``placement.nvme_fetch_share``; 0 otherwise).

    [Note: a default budget that fits the model's layers]
    A group larger than the budget is never prefetched, and the schedule's read-ahead stops
    in front of it (overlap/schedule.py), so every large layer is read on demand while
    compute waits. The default of 128 MiB fits every layer of models up to a few billion
    parameters, but a 13B Llama's MLP projections are 141 MB each in bf16 (238 MB at ~30B),
    and its embedding and head more: with the default, such a run reads a third of its bytes
    on demand (measured: bench/results, 'LoRA at 13B and 30B', 1.2x the disk's floor
    instead of 1.05x). So a budget at the default value grows to the two largest groups
    that are fetched (the one computing and the next one), which costs host memory of the
    same order as the layers the run moves anyway; any other budget is what the user gets,
    with the schedule's warning when a group does not fit. The value decides, not whether
    the key was written: configs pass through dumps and merges (``Config.auto``, a
    DeepSpeed file, the Trainer's arguments) that write every key.

    [Note: a budget for parameters on NVMe follows the free memory]
    With the parameters on NVMe the budget decides how often each layer is fetched: a group
    kept gathered from forward into backward is fetched once per step, one released in
    between is fetched again for backward. Where the training copies are cast from masters
    in memory (``plan.derives_compute_copy``) a fetch is a cast: on gpt-335m (Intel AMX,
    bf16, 512 tokens) the 128 MiB default ran at 0.80-0.86x no offload, and a budget holding
    the 16-bit model at 0.95-1.02x, for its 0.5-0.7 GiB of memory
    (bench/results/2026-11-26-intel-amx-bf16-derived-params.md). With the optimizer state on
    NVMe too a fetch is a disk read, in a step bound by the disk: a budget of ~1 GiB read
    4.71 GB a step instead of 5.31, and in four alternating pairs the step took 4.75, 5.99,
    5.22 and 5.13 s against 5.93, 7.31, 5.14 and 5.43 s at 128 MiB (the disk's speed moves
    that much), for 0.35-0.5 GiB more peak RSS
    (bench/results/2026-11-26-intel-amx-bf16-clip-and-reuse.md). So at the default value
    this budget grows to what ``Config.auto`` gives prefetching, 5% of the device's free
    memory (64 MiB to 2 GiB, ``placement.prefetch_share``): a share that shrinks with the
    headroom. Not where most of the model is frozen (a LoRA base on NVMe): there the host
    was left short on purpose (host_memory.py's [Note: a frozen base does not size the
    host]).
    """
    budget = cfg.zero.prefetch_bytes
    if budget != type(cfg.zero).model_fields["prefetch_bytes"].default:
        return budget
    fetched = sorted((g.full_bytes for g in groups if not (g.persistent or g.zero_copy)),
                     reverse=True)
    if _mostly_frozen(groups):
        nvme_share = 0
    return max(budget, sum(fetched[:2]), nvme_share)


def _mostly_frozen(groups: list[GatherGroup]) -> bool:
    """Whether most of the parameters are frozen (host_memory.py's [Note: a frozen base does
    not size the host])."""
    params = [sp for g in groups for sp in g.params]
    total = sum(sp.numel for sp in params)
    return bool(total) and sum(sp.numel for sp in params if sp.trainable) < MOSTLY_FROZEN * total
