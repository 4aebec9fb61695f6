"""The compute dtype a device trains in: ``dtype: auto`` resolved once, with its reason.

[Note: auto is the fastest dtype the device multiplies natively]
The master weights and optimizer states are fp32 whatever the compute dtype, so the compute
dtype only decides how fast forward and backward run and how many bytes a parameter shard
moves. A 16-bit dtype halves the bytes, but it only runs fast where the hardware multiplies
it: torch emulates bf16 on a CPU without AVX512-BF16 or AMX (each element widened to fp32
inside the product, tens of times slower than fp32 there), and a GPU below compute
capability 8.0 has no bf16 tensor cores. ``auto`` therefore resolves, per device:

  * bf16 where the device multiplies it natively (CUDA capability >= 8.0; a CPU with
    AVX512-BF16 or AMX): half the bytes, no loss scaling, fp32's exponent range;
  * fp16 with dynamic loss scaling on a CUDA device with fp16 tensor cores (capability
    >= 7.0) but no bf16: the paper's own V100 regime;
  * fp32 otherwise: on such a CPU it is the fastest dtype there is.

The choice is made once, when the runtime meets its device, and carried in the config the
engine runs with, so every later reader sees a concrete dtype. An explicit ``bf16`` or
``fp16`` where the device emulates it is honoured (the user may be checking numerics), with
one warning that names the cheaper choice.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import torch

from outcore.device.accel import default_device
from outcore.device.machine import cpu_features, cpu_model
from outcore.errors import user_stacklevel

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16,
                                  "fp32": torch.float32}
"""The concrete compute dtypes by their config names."""


class EmulatedDtypeWarning(UserWarning):
    """A 16-bit compute dtype was asked for on a device that does not multiply it natively."""


@dataclass(frozen=True)
class Capabilities:
    """What one compute device multiplies natively; tests build these by hand."""

    device_type: str
    """``"cpu"`` or ``"cuda"``."""
    name: str
    """The CPU model or GPU name, for messages."""
    bf16: bool
    """bf16 matrix products run natively (not widened to fp32 element by element)."""
    fp16: bool
    """fp16 matrix products run natively."""
    detail: str
    """The feature behind the two flags, e.g. ``"AMX"`` or ``"compute capability 7.0"``."""


def capabilities(device: torch.device) -> Capabilities:
    """Read ``device``'s native 16-bit support from torch's own checks."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return Capabilities("cuda", torch.cuda.get_device_name(device), bf16=major >= 8,
                            fp16=major >= 7, detail=f"compute capability {major}.{minor}")
    f = cpu_features()
    found = [n for n, key in (("AMX", "amx"), ("AVX512-BF16", "avx512_bf16")) if f[key]]
    detail = " and ".join(found) if found else "no AVX512-BF16, no AMX"
    return Capabilities("cpu", cpu_model(), bf16=bool(found), fp16=f["amx_fp16"], detail=detail)


@dataclass(frozen=True)
class DtypeChoice:
    """The compute dtype in force, what was asked for, and why."""

    name: str
    """The concrete dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``."""
    requested: str
    """What the config said: ``"auto"`` or the same as ``name``."""
    native: bool
    """Whether the device multiplies ``name`` natively (fp32 always does)."""
    reason: str
    """One sentence: why this dtype, on which device."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    def to_json(self) -> dict[str, str | bool]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def choose(requested: str, caps: Capabilities) -> DtypeChoice:
    """Resolve ``requested`` (``auto`` or a concrete dtype) for a device with ``caps``."""
    where = f"{caps.name} ({caps.detail})"
    if requested == "auto":
        if caps.bf16:
            return DtypeChoice("bf16", "auto", True, f"auto: {where} multiplies bf16 natively")
        if caps.device_type == "cuda" and caps.fp16:
            return DtypeChoice("fp16", "auto", True, f"auto: {where} has fp16 but no bf16 "
                               "tensor cores; fp16 with dynamic loss scaling")
        return DtypeChoice("fp32", "auto", True, f"auto: {where} has no native bf16; "
                           "torch would emulate it far slower than fp32")
    if requested not in DTYPES:
        raise ValueError(f"unknown dtype {requested!r}; allowed: auto, {', '.join(DTYPES)}")
    if requested == "fp32":
        return DtypeChoice("fp32", "fp32", True, "fp32 as configured")
    native = caps.bf16 if requested == "bf16" else caps.fp16
    if native:
        return DtypeChoice(requested, requested, True, f"{requested} as configured; "
                           f"{where} multiplies it natively")
    return DtypeChoice(requested, requested, False, f"{requested} as configured; {where} "
                       "does not multiply it natively, so torch emulates it (slow)")


_warned: set[tuple[str, str]] = set()


def resolve(requested: str, device: torch.device) -> DtypeChoice:
    """``choose`` for a real device; warns once per process where the choice is emulated."""
    caps = capabilities(device)
    choice = choose(requested, caps)
    if not choice.native and (device.type, choice.name) not in _warned:
        _warned.add((device.type, choice.name))
        better = choose("auto", caps).name
        warnings.warn(f"dtype {choice.name}: {caps.name} ({caps.detail}) does not multiply "
                      f"{choice.name} natively, so torch emulates it and matrix products may "
                      f"run tens of times slower than in {better}. Use dtype 'auto' (here: "
                      f"{better}) unless you need {choice.name} numerics.",
                      EmulatedDtypeWarning, stacklevel=user_stacklevel())
    return choice


def planned(requested: str) -> DtypeChoice:
    """What the runtime will resolve ``requested`` to on this machine's compute device, for
    readers that run before one exists (placement, the probe, benchmarks); never warns."""
    return choose(requested, capabilities(default_device()))
