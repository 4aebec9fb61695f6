"""``Config.auto``: choose tiers and byte budgets from the model size and this machine.

[Note: the fastest tier that fits wins]
Per parameter and rank, mixed-precision training keeps 2 bytes of training-dtype parameters
and 12 bytes of fp32 master weights and Adam moments, plus fp32 gradients (4 bytes) between
backward and step. Each tier is an order of magnitude faster than the next (device memory >
host memory > NVMe, as ``outcore probe`` measures), and moving a kind of state down a tier
only adds traffic, so throughput is highest when each kind sits in the fastest tier that still
holds it. The plan therefore tries, in order: everything on the device; optimizer state on the
host; parameters on the host too; optimizer state on NVMe (parameters on the host); both on
NVMe. Optimizer state moves first because its traffic per step (read and write once) is lower
per byte than the parameters' (read in forward and again in backward), which is the paper's
arithmetic-intensity argument: optimizer ait is tokens/4, parameters' is tokens.

A tier counts as holding a kind of state when that state uses at most its usable fraction of
what is free now: estimate.py's one model of the tiers, taken for model states alone
(``USABLE.states_only()``: 67.5% of device memory, 60% of host memory, 71% of the disk; the
reasons are in estimate.py's [Note: usable fraction of each tier]). On a CPU-only machine the
device *is* host memory, so device and host share one free-memory figure and host memory's
fraction, and the two tiers are never both counted. Budgets follow:
host I/O buffers get 2% of free host memory (64 MiB to 1 GiB), prefetch gets 5% of free device
memory (64 MiB to 2 GiB). Free host memory is what this process may still use, its cgroup's
limit included (guard/memory.py).

[Note: cannot fit means the states alone exceed what is free]
``check_fits`` prices the placement a run asks for with ``state_bytes``, the model ``plan``
prices its candidates with, against the same free figures, and ``outcore train`` calls it
before it reads the data or builds the model. It refuses only when the model states alone
exceed what is free in a memory tier: then no batch, sequence length or allocator makes the
run fit, and the kernel would kill it once the states were built. Between ``USABLE``'s
fraction (80% of host memory, 90% of device memory) and all of it the run starts with a
one-line caution, because whether it fits then depends on what model states do not count
(activations, the optimizer's temporaries, the allocator), and a refusal must never reject a
run that trains. Measured under cgroup limits with gpt-335m in fp32, everything in host
memory, batch 1 x 32 tokens: states at 86% of the free memory trained; at 89% the kernel
killed the run. A refusal at 80% would have rejected the first. ``Config.auto`` plans with
60%, which leaves room for a real batch. NVMe is not checked here: the swap fills only as
shards are written, and a full disk ends the run with a ``StorageError`` naming the path.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from outcore.config import Config, answer_auto_with
from outcore.device.compute_dtype import planned
from outcore.errors import ConfigError
from outcore.guard.memory import Available, available_memory
from outcore.offload.storage import Tier
from outcore.runtime.plan import ExecutionPlan, optimizer_state_kinds
from outcore.sizing.estimate import USABLE, Overheads
from outcore.units import format_bytes, format_count
from outcore.zero.registry import parameter_counts

if TYPE_CHECKING:
    from outcore.runtime import Runtime

_MiB = 1 << 20
GRAD_BYTES = 4  # an fp32 gradient


def _state_bytes(settings: Config) -> int:
    """fp32 bytes per parameter of the master and the optimizer's state (12 for AdamW)."""
    opt = settings.optimizer
    return 4 * (1 + len(optimizer_state_kinds(opt.type, opt.momentum)))
_ORDER = [("none", "none"), ("none", "cpu"), ("cpu", "cpu"), ("cpu", "nvme"), ("nvme", "nvme")]


@dataclass(frozen=True)
class Plan:
    """The chosen placement and the numbers behind it."""

    params: str
    optimizer: str
    host_buffer_bytes: int
    prefetch_bytes: int
    reasons: list[str]

    def explain(self) -> str:
        head = (f"placement: params={self.params}, optimizer={self.optimizer}, "
                f"host_buffer_bytes={self.host_buffer_bytes >> 20} MiB, "
                f"prefetch_bytes={self.prefetch_bytes >> 20} MiB")
        return "\n".join([head, *("  " + r for r in self.reasons)])


def free_memory() -> tuple[int, int]:
    """Free (device, host) bytes now; on a CPU-only machine both are host memory. Host memory
    is what this process may still use: the machine's available memory capped by its cgroup's
    limit (guard/memory.py)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device_free(device), available_memory().bytes


def nvme_fetch_share(rt: Runtime) -> int:
    """The prefetch budget's floor where parameters are fetched from NVMe, cast from masters
    in memory or read from disk (zero/build.py's [Note: a budget for parameters on NVMe
    follows the free memory]); 0 elsewhere."""
    on_nvme = rt.plan.inputs.params is Tier.NVME
    return prefetch_share(device_free(rt.device)) if on_nvme else 0


def device_free(device: torch.device) -> int:
    """Free memory where ``device`` computes: the GPU's, or on the CPU the host memory this
    process may still use."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_memory().bytes


def prefetch_share(free_bytes: int) -> int:
    """The prefetch budget the device's ``free_bytes`` afford: 5% of them, 64 MiB to 2 GiB
    (the note above)."""
    return int(min(max(0.05 * free_bytes, 64 * _MiB), 2048 * _MiB))


def state_bytes(num_params: int, world_size: int, settings: Config, device: str,
                params: str, optimizer: str, trainable: int | None = None) -> dict[str, int]:
    """Bytes of model states per rank in each tier (``Tier`` values) when ``settings`` run
    with this placement on ``device``, priced by the execution plan they would run with (see
    ``plan``): the one memory model of ``Config.auto`` and ``check_fits``.

    ``trainable``: how many of the parameters train (default: all). A frozen one (a LoRA
    base) costs its training-dtype shard only: no master, gradient or optimizer state."""
    dtype = planned(settings.dtype)
    per_rank = -(-num_params // world_size)
    per_train = per_rank if trainable is None else min(per_rank, -(-trainable // world_size))
    ex = ExecutionPlan.for_config(settings, world_size, device, dtype=dtype.name,
                                  params=params, optimizer=optimizer)
    use = {t.value: 0 for t in Tier}
    if not ex.compute_is_master:  # else the parameter shards are the masters
        # a trainable one's copy may be cast from its master, stored nowhere (CastShard)
        stored = per_rank - per_train if ex.derives_compute_copy else per_rank
        use[ex.inputs.params.value] += stored * dtype.torch_dtype.itemsize
    else:  # a frozen parameter's shard is its fp32 values, beside the trainable masters
        use[ex.inputs.optimizer.value] += (per_rank - per_train) * 4
    use[ex.inputs.optimizer.value] += per_train * _state_bytes(settings)
    # every gradient is held until the step, or kept from step to step with the state in
    # memory (zero/param.py's [Note: gradient buffers]); only updates during backward with
    # the state on NVMe free each one, unless they are tentative
    if ex.keeps_grad_buffers or not ex.overlaps_optimizer or ex.speculates:
        use[ex.grad_tier.value] += per_train * GRAD_BYTES
    return use


def plan(num_params: int, world_size: int = 1, *, nvme_path: str | None = None,
         device_free: int | None = None, host_free: int | None = None,
         disk_free: int | None = None, usable: Overheads | None = None,
         settings: Config | None = None, device: str | None = None,
         trainable: int | None = None) -> Plan:
    """Pick the fastest placement that fits (see the note above).

    Each candidate is priced by the execution plan it would run with (runtime/plan.py), for
    ``settings`` (dtype, optimizer, clipping, overlap; default ``Config()``) on ``device``
    (``"cuda"`` where torch sees a GPU, else ``"cpu"``): parameter shards cost the resolved
    dtype's bytes unless they are the fp32 masters (``compute_is_master``), and a whole
    step's fp32 gradients need room beside the optimizer state unless the optimizer runs
    during backward (``overlaps_optimizer``) with its state on NVMe: then each group's
    gradient is freed after its update and needs no room beyond the host buffer budget (not
    when the updates are tentative, ``speculates``: those keep their gradients for
    ``step()``). With the state in memory the buffers are kept (``keeps_grad_buffers``). The
    room a speculative step takes on disk is not priced: it is reserved only where the disk
    has it to spare (optim/speculation.py). ``trainable``: how many parameters train
    (default: all; see ``state_bytes``).
    ``usable``: the fraction of each tier's free bytes model states may take (default
    ``USABLE.states_only()``, see the note above).
    """
    if num_params <= 0:
        raise ConfigError(f"auto placement needs a positive parameter count, got {num_params}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dev, host, shared = _memory(device_free, host_free, device)
    frac = usable or USABLE.states_only()
    dev_frac = frac.host if shared else frac.device  # the device's memory is host memory
    if disk_free is None:
        disk_free = shutil.disk_usage(_existing(nvme_path)).free if nvme_path else 0
    per_rank = -(-num_params // world_size)
    settings = settings or Config()
    dtype = planned(settings.dtype)
    reasons = [f"{num_params:,} parameters over {world_size} rank(s), {dtype.name}: "
               f"{per_rank * dtype.torch_dtype.itemsize / 2**30:.2f} GiB of parameter shards "
               f"and {per_rank * _state_bytes(settings) / 2**30:.2f} GiB of fp32 optimizer state "
               "per rank, "
               f"{per_rank * GRAD_BYTES / 2**30:.2f} GiB of fp32 gradients where they are all "
               "held at once"]
    if trainable is not None and trainable < num_params:
        reasons.append(f"{trainable:,} of them train: optimizer state and gradients for those "
                       "only; the frozen rest costs its parameter shards")
    for params, optimizer in _ORDER:
        use = state_bytes(num_params, world_size, settings, device, params, optimizer,
                          trainable)
        mem_used = use["device"] + use["host"] if shared else max(use["device"], 0)
        fits = (mem_used <= dev_frac * dev and (shared or use["host"] <= frac.host * host)
                and use["nvme"] <= frac.nvme * disk_free)
        label = f"params={params}, optimizer={optimizer}"
        if fits:
            reasons.append(f"{label}: fits ({_gib(use)})")
            break
        reasons.append(f"{label}: does not fit ({_gib(use)}; free device {dev / 2**30:.1f} GiB "
                       f"({dev_frac:.0%} usable), host {host / 2**30:.1f} GiB "
                       f"({frac.host:.0%} usable), disk {disk_free / 2**30:.1f} GiB "
                       f"({frac.nvme:.0%} usable))")
    else:  # the last reason says which tier was short, and what each has free
        where = f"at {nvme_path}" if nvme_path else "(no nvme_path given)"
        raise ConfigError(f"the model does not fit this machine even with everything on NVMe "
                          f"{where}: {reasons[-1]}")
    host_buffers = int(min(max(0.02 * host, 64 * _MiB), 1024 * _MiB)) // 4096 * 4096
    return Plan(params, optimizer, host_buffers, prefetch_share(dev), reasons)


def check_fits(cfg: Config, num_params: int, world_size: int = 1, *,
               device_free: int | None = None, host_free: int | None = None,
               device: str | None = None, trainable: int | None = None) -> str | None:
    """Refuse ``cfg``'s placement when its model states cannot fit in memory, before anything
    is built (see [Note: cannot fit means the states alone exceed what is free]).

    Raises ``ConfigError`` naming the bytes needed, the bytes free and the placement ``plan``
    picks for the same settings; returns a one-line caution when the states fit but leave less
    than ``USABLE``'s margin; else None. ``device_free``/``host_free`` replace the measured
    figures, as in ``plan``.
    """
    room = available_memory() if host_free is None else Available(host_free, None)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dev, host, shared = _memory(device_free, room.bytes, device)
    placed = (cfg.offload.params, cfg.offload.optimizer)
    use = state_bytes(num_params, world_size, cfg, device, *placed, trainable=trainable)
    if shared:  # the device's memory is host memory: one figure for both
        tiers = [("memory", use["device"] + use["host"], room.bytes, USABLE.host, str(room))]
    else:
        tiers = [("device memory", use["device"], dev, USABLE.device,
                  f"{format_bytes(dev)} is free on the device"),
                 ("host memory", use["host"], host, USABLE.host, str(room))]
    over = [t for t in tiers if t[1] > t[2]]
    tight = [t for t in tiers if t[1] > t[3] * t[2]]
    if not tight:
        return None
    what, need, free, frac, free_text = (over or tight)[0]
    head = (f"offload params={placed[0]}, optimizer={placed[1]}: "
            f"{format_count(num_params)} parameters in {planned(cfg.dtype).name} need "
            f"{format_bytes(need)} of model states in {what}"
            + (f" per rank ({world_size} ranks)" if world_size > 1 else ""))
    try:
        fit = plan(num_params, world_size, nvme_path=cfg.offload.nvme_path,
                   device_free=device_free, host_free=room.bytes, settings=cfg, device=device,
                   trainable=trainable)
        advice = (f"a placement that fits: params={fit.params}, optimizer={fit.optimizer} "
                  "(what offload 'auto' picks)")
    except ConfigError as e:
        advice = f"no placement fits: {e}"
    if over:
        raise ConfigError(f"{head}, but only {free_text}; {advice}")
    return (f"{head}, {need / free:.0%} of the {format_bytes(free)} free: more than the "
            f"{frac:.0%} training can count on, so activations may not fit and the kernel may "
            f"kill the run; {advice}")


def auto_config(num_params: int | torch.nn.Module, base: dict[str, Any] | None = None, *,
                world_size: int = 1, nvme_path: str | None = None, **measured: Any):
    """An ``outcore.Config`` with the planned placement merged into ``base``; prints the plan
    on stderr, beside the other progress, so that a script's own output on stdout stays its
    own (``outcore train --offload auto > log`` included)."""
    if isinstance(num_params, torch.nn.Module):
        num_params, trainable = parameter_counts(num_params)
        measured.setdefault("trainable", trainable)
    elif isinstance(num_params, bool) or not isinstance(num_params, int | float) \
            or num_params <= 0:
        raise ConfigError(f"Config.auto: expected a model (torch.nn.Module) or a parameter "
                          f"count, got {type(num_params).__name__} {num_params!r}")
    cfg = Config.load(base)
    chosen = plan(int(num_params), world_size, nvme_path=nvme_path, settings=cfg, **measured)
    print(chosen.explain(), file=sys.stderr, flush=True)
    offload = {"params": chosen.params, "optimizer": chosen.optimizer,
               "host_buffer_bytes": chosen.host_buffer_bytes}
    if nvme_path:
        offload["nvme_path"] = nvme_path
    return cfg.with_overrides({"offload": offload,
                               "zero": {"prefetch_bytes": chosen.prefetch_bytes}})


def _memory(device_free: int | None, host_free: int | None, device: str
            ) -> tuple[int, int, bool]:
    """Free (device, host) bytes, measured where not given, and whether they are one pool
    (computing on the CPU, where the device's memory is host memory: a CPU-only machine, or
    ``device="cpu"`` on a GPU host)."""
    measured_dev, measured_host = free_memory()
    host = measured_host if host_free is None else host_free
    shared = device == "cpu" and device_free is None
    dev = (host if shared else measured_dev) if device_free is None else device_free
    return dev, host, shared


def _existing(path: str) -> str:
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return str(p)


def _gib(use: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in use.items() if v)


answer_auto_with(auto_config)  # config/schema.py's [Note: Config.auto is answered from above]
