"""The compute device seam: the OUTCORE_DEVICE override, and copies waited for where used."""

from __future__ import annotations

import pytest
import torch

from outcore.device import accel
from outcore.device.accel import DONE, Accelerator, default_device
from outcore.errors import ConfigError


@pytest.mark.parametrize("value", ["", "auto", " AUTO "])
def test_unset_or_auto_picks_cuda_where_torch_sees_one(value: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTCORE_DEVICE", value)
    assert default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_cpu_is_chosen_even_beside_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTCORE_DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    acc = Accelerator.detect()
    assert acc.device == torch.device("cpu") and acc.backend == "gloo"
    assert not acc.pin_host_buffers


def test_bad_values_and_missing_cuda_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTCORE_DEVICE", "tpu")
    with pytest.raises(ConfigError, match="OUTCORE_DEVICE='tpu': expected cpu, cuda or auto"):
        default_device()
    monkeypatch.setenv("OUTCORE_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="OUTCORE_DEVICE=cuda, but torch sees no CUDA device"):
        Accelerator.detect()


def test_cpu_copies_are_done_when_the_call_returns() -> None:
    """[Note: a copy is waited for where it is used]: on the CPU nothing is copied twice and
    nothing waits."""
    acc = Accelerator(torch.device("cpu"))
    host = torch.arange(6.0)
    out, copy = acc.to_device_async(host)
    assert out is host and copy is DONE and copy.done()
    copy.wait()
    copy.synchronize()
    assert acc.to_device(host) is host
    dst = torch.zeros(6)
    assert acc.copy_to_device(dst, host).done() and torch.equal(dst, host)
    back = torch.zeros(6)
    assert acc.copy_to_host(back, dst) is DONE and torch.equal(back, host)
    assert acc.copy_to_host(back, back) is DONE  # the same memory: nothing to do
    assert acc.to_device_inline(host) is host


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_inline_copy_queues_on_the_current_stream() -> None:
    """The optimizer's step counts: one copy queued behind the current stream's work, which
    the host does not wait for (a copy from pageable memory would wait for the stream), from
    a page-locked copy of its own (the caller may reuse its tensor at once)."""
    acc = Accelerator(torch.device("cuda"), torch.cuda.Stream())
    stream = torch.cuda.current_stream()
    counts = torch.tensor([1.0, 2.0, 3.0])
    torch.cuda._sleep(10**9)  # keeps the current stream busy for ~0.5 s
    out = acc.to_device_inline(counts)
    assert not stream.query(), "the host waited for the stream"
    counts.fill_(0.0)
    stream.synchronize()
    assert out.device.type == "cuda" and out.cpu().tolist() == [1.0, 2.0, 3.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copies_wait_on_an_event_not_the_whole_stream() -> None:
    acc = Accelerator(torch.device("cuda"), torch.cuda.Stream())
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    out, copy = acc.to_device_async(host)
    assert out.device.type == "cuda" and isinstance(copy, accel.DeviceCopy)
    copy.wait()  # the compute stream orders after the copy
    assert torch.equal(out.cpu(), host)
    back = torch.empty_like(host).pin_memory()
    down = acc.copy_to_host(back, out * 2)
    down.synchronize()
    assert down.done() and torch.equal(back, host * 2)
