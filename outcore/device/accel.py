"""The one seam between outcore and the compute device.

[Note: CPU here, CUDA behind the same calls]
Everything that differs between a CUDA device and the CPU lives in this file: which device
computes, which collective backend to use, whether host buffers are page-locked, and how a
host tensor reaches the device. On the CPU the device *is* host memory, so ``to_device`` hands
back the same tensor and there is nothing to pin. On CUDA the copy runs on a dedicated stream
so it overlaps compute, and the caller gets an event to wait on. Only the CPU path runs in this
project's tests; the CUDA path is kept small so it can be read and checked by eye.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


def default_device() -> torch.device:
    """The device ``Accelerator.detect`` computes on (its type), without selecting one."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class Accelerator:
    """Device, collective backend and host<->device copies for one rank."""

    device: torch.device
    _copy_stream: object | None = field(default=None, repr=False)

    @classmethod
    def detect(cls) -> Accelerator:
        """CUDA when available (one device per local rank), else the CPU."""
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            return cls(torch.device("cuda", local), torch.cuda.Stream())
        return cls(torch.device("cpu"))

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def backend(self) -> str:
        return "nccl" if self.is_cuda else "gloo"

    @property
    def pin_host_buffers(self) -> bool:
        """Page-locked buffers only help (and only exist) when a DMA engine copies them."""
        return self.is_cuda

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Bring a host tensor to the compute device; the identity on the CPU."""
        if not self.is_cuda:
            return host
        stream = self._copy_stream
        with torch.cuda.stream(stream):  # type: ignore[arg-type]
            out = host.to(self.device, non_blocking=True)
        torch.cuda.current_stream().wait_stream(stream)  # type: ignore[arg-type]
        return out

    def to_host(self, dev: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy a device tensor into host memory (``out`` when given)."""
        if not self.is_cuda:
            if out is None:
                return dev
            out.copy_(dev)
            return out
        if out is None:
            return dev.to("cpu")
        out.copy_(dev, non_blocking=False)
        return out
