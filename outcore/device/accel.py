"""The one seam between outcore and the compute device.

[Note: CPU here, CUDA behind the same calls]
Everything that differs between a CUDA device and the CPU lives in this file: which device
computes, which collective backend to use, whether host buffers are page-locked, and how a
host tensor reaches the device. On the CPU the device *is* host memory, so ``to_device`` hands
back the same tensor and there is nothing to pin. On CUDA the copy runs on a dedicated stream
so it overlaps compute, and the caller gets a ``DeviceCopy`` to wait on. The CPU suite runs the
CPU path; ``--device cuda`` (tests/conftest.py) runs the same suite through the CUDA path.

[Note: a copy is waited for where it is used]
Three things order a copy on the copy stream, as FSDP2 orders its all-gathers
(``_fsdp_param_group.py``: ``unshard`` issues, ``wait_for_unshard`` makes the compute stream
``wait_event`` on the copy-out's event) and its CPU-offloaded gradients
(``_fsdp_collectives.foreach_reduce``: ``.to("cpu", non_blocking=True)`` from the reduce stream,
an event the optimizer's host thread blocks on):
* the destination is allocated on the compute stream and the copy stream first waits for it
  (``wait_stream``: the memory may have been freed by compute kernels still queued), so the
  caching allocator never hands the block to another stream's allocation early;
* the compute stream waits on the copy's event only when the data is needed: ``wait()``.
  Issuing the copy at prefetch time and waiting at use is what overlaps it with compute;
  waiting right after issuing, as ``to_device`` does, only moves it off the compute stream;
* a page-locked source must not be refilled, and a device source not freed, before the copy
  has read it: ``synchronize()`` blocks the host until then (a pool buffer goes back only
  after it), and a device source is recorded on the copy stream (``record_stream``).
On the CPU every copy is done when the call returns: ``wait()`` and ``synchronize()`` cost a
Python call and the tensors are the ones passed in, so the CPU path is unchanged.

What uses it next (a plan, to be done and measured on a GPU):
* ``zero/group.py``: ``unshard()`` reads each shard from its home tier into page-locked host
  memory (NVMe: the pool's pinned buffers; a host tier: its shard, pinned when built), then
  issues ``copy_to_device(full or send buffer, host)`` and keeps the ``DeviceCopy`` beside the
  read futures; ``wait_unshard()`` waits for the reads, then ``copy.wait()`` (no host block),
  then the all-gather. Today at one rank the reads land straight in the full tensor, which on
  CUDA is device memory: an NVMe read cannot land there (``nvme.py`` wants a CPU tensor) and a
  host-tier read is a synchronous pageable copy. At several ranks with parameters on the
  device, the send buffer is host memory, so a device shard makes a round trip through the
  host: it should be a device buffer there.
* Gradients (``reduce_grads``/``PendingReduce.finish`` and ``param.add_grad``): reduce-scatter
  on the device as now, then ``copy_to_host(pinned grad slot, output slice)`` on the copy
  stream; the optimizer's worker calls ``synchronize()`` on it before reading the shard, so
  backward never blocks on the D2H copy. The updated 16-bit shard goes back to its tier the
  same way (``copy_to_device`` where parameters live on the device).
* The all-gather stays in program order (schedule.py's note: a prefetched collective that one
  rank issues and another does not would pair collectives wrongly and hang). It can be
  issued early without that risk along an order every rank has confirmed: each rank's trace
  is hashed at the end of an iteration and the hashes all-reduced (one tiny collective per
  iteration, in program order on every rank); only a trace all ranks agree on is followed
  with all-gathers issued one or two groups ahead on a side stream (FSDP2's implicit forward
  prefetch). Whether a group's all-gather goes early must then depend on the trace and the
  cursor alone, never on timing (an update still running on the group, bytes another thread
  released), so every rank issues the same collectives in the same order. ZeRO-3 already
  needs every rank to run the same order, so all ranks meet a divergence at the same point:
  each finishes the all-gathers it issued early (the same ones on every rank) and then
  fetches on demand. Until then all-gathers wait in place and only the tier reads run ahead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from outcore.errors import ConfigError

DEVICE_ENV = "OUTCORE_DEVICE"
"""Environment variable naming the compute device: ``cpu``, ``cuda`` or ``auto`` (unset)."""


def default_device() -> torch.device:
    """The device ``Accelerator.detect`` computes on (its type), without selecting one.

    ``OUTCORE_DEVICE=cpu|cuda`` chooses; unset (or ``auto``) means CUDA when torch sees a
    GPU, else the CPU. So one GPU machine can run both paths (the test suite's switch,
    ``tests/conftest.py``), and a request for CUDA where there is none fails here, clearly.
    """
    choice = os.environ.get(DEVICE_ENV, "").strip().lower() or "auto"
    if choice == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if choice not in ("cpu", "cuda"):
        raise ConfigError(f"{DEVICE_ENV}={os.environ[DEVICE_ENV]!r}: expected cpu, cuda or auto")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{DEVICE_ENV}=cuda, but torch sees no CUDA device (torch "
                          f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'})")
    return torch.device(choice)


class DeviceCopy:
    """A copy between host and device memory; see [Note: a copy is waited for where it is
    used]. Done at creation on the CPU."""

    def __init__(self, event: object | None = None, keep: torch.Tensor | None = None) -> None:
        self._event, self._keep = event, keep  # ``keep``: the source, alive until the copy is

    def wait(self) -> None:
        """Make the current (compute) stream wait for the copy; the host does not block."""
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)  # type: ignore[arg-type]

    def synchronize(self) -> None:
        """Block the host until the copy is done (before reusing or reading host memory)."""
        if self._event is not None:
            self._event.synchronize()  # type: ignore[attr-defined]
        self._keep = None

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())  # type: ignore[attr-defined]


DONE = DeviceCopy()
"""The copy that is already done (every copy on the CPU)."""


@dataclass
class Accelerator:
    """Device, collective backend and host<->device copies for one rank."""

    device: torch.device
    _copy_stream: object | None = field(default=None, repr=False)

    @classmethod
    def detect(cls) -> Accelerator:
        """``default_device()``'s choice; on CUDA, the local rank's device."""
        if default_device().type == "cuda":
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
        """Bring a host tensor to the compute device, ready for the compute stream's next
        kernel; the identity on the CPU."""
        out, copy = self.to_device_async(host)
        copy.wait()
        return out

    def to_device_async(self, host: torch.Tensor) -> tuple[torch.Tensor, DeviceCopy]:
        """A device tensor with ``host``'s values once the returned copy is waited for; on the
        CPU, ``host`` itself and ``DONE``."""
        if not self.is_cuda:
            return host, DONE
        out = torch.empty_like(host, device=self.device)  # on the compute stream
        return out, self.copy_to_device(out, host)

    def to_device_inline(self, host: torch.Tensor) -> torch.Tensor:
        """A small host tensor on the device, queued on the *current* stream without blocking
        the host: page-locked first (torch's host cache keeps that block until the copy has
        read it), so no stream hop and no event, for values the next kernel on this stream
        reads (staging.py's [Note: step counts cross in one copy]). A pageable ``host`` may
        be reused at once; an already page-locked one is copied from directly, so it must
        not be refilled before the stream has read it. On the CPU, ``host``."""
        if not self.is_cuda:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> DeviceCopy:
        """Copy host ``src`` into device ``dst`` on the copy stream; wait before using
        ``dst``, synchronize before refilling ``src``. On the CPU: copied now (or nothing,
        when ``dst`` is ``src``)."""
        return self._copy(dst, src, device_src=False)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> DeviceCopy:
        """Copy device ``src`` into host ``dst`` (page-locked, for the copy to be
        asynchronous) on the copy stream; synchronize before reading ``dst``. On the CPU:
        copied now (or nothing, when ``dst`` is ``src``)."""
        return self._copy(dst, src, device_src=True)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, device_src: bool) -> DeviceCopy:
        """One copy on the copy stream, after the compute stream's work so far. A device
        ``src`` is recorded on the copy stream (the allocator frees it only after the copy);
        a host ``src`` is kept alive by the returned ``DeviceCopy`` instead."""
        if not self.is_cuda:
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
            return DONE
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream())  # type: ignore[attr-defined]
        with torch.cuda.stream(stream):  # type: ignore[arg-type]
            dst.copy_(src, non_blocking=True)
            if device_src:
                src.record_stream(stream)  # type: ignore[arg-type]
            event = torch.cuda.Event()
            event.record(stream)  # type: ignore[arg-type]
        return DeviceCopy(event) if device_src else DeviceCopy(event, keep=src)

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
