"""What this machine is: CPU model and the ISA features that decide speed, cores, GPU, torch.

[Note: a number without its machine means nothing]
One machine of this project's kind may be an Intel CPU with AMX (native bf16 matrix
products) and the next an AMD EPYC with AVX2 only, where torch emulates bf16 and the same
product runs tens of times slower than fp32 (measured: bench/RESULTS.md, 'Machines'). A step
time, a probe result or a choice of dtype is only meaningful beside the features that
produced it, so the probe, the training banner and every benchmark record take their
machine description from ``describe()``.
"""

from __future__ import annotations

import datetime
import os
import platform
from functools import cache
from typing import Any

import torch


@cache
def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo``'s ``model name``), or the platform's."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


@cache
def cpu_features() -> dict[str, bool]:
    """The CPU features torch's kernels dispatch on, as torch itself detects them.

    ``avx512_bf16`` and ``amx`` (tiles) are what make bf16 matrix products native; without
    either, torch converts bf16 to fp32 element by element inside the product.
    """
    cpu = torch.cpu
    checks = {"avx2": "_is_avx2_supported", "avx512": "_is_avx512_supported",
              "avx512_bf16": "_is_avx512_bf16_supported", "amx": "_is_amx_tile_supported",
              "amx_fp16": "_is_amx_fp16_supported"}
    return {name: bool(getattr(cpu, fn, lambda: False)()) for name, fn in checks.items()}


def gpu_description(device: torch.device | None = None) -> dict[str, Any] | None:
    """Name, compute capability and memory of the CUDA device, or None without one."""
    if not torch.cuda.is_available():
        return None
    dev = device if device is not None and device.type == "cuda" else torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    return {"name": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_bytes": int(props.total_memory), "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda}


def describe(dtype: str | None = None) -> dict[str, Any]:
    """The machine-readable header every benchmark record and probe result carries.

    ``dtype`` is the compute dtype the numbers were measured in (resolved, never ``auto``).
    """
    out: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu": cpu_model(), "cpu_features": cpu_features(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "gpu": gpu_description(),
    }
    if dtype is not None:
        out["dtype"] = dtype
    return out
