"""Measure this machine: disk read/write through outcore's own I/O path, host copy, matmul.

[Note: what the probe measures and why this way]
The efficiency model (``estimate.py``) needs the bandwidths outcore will actually get, not
the device's data sheet. So the disk numbers come from the same ``NvmeStore``/``AioEngine``
path that training uses (O_DIRECT, the engine's thread count and block size), on the folder
the swap would live in. Each number is the best of a few rounds: the first write into
freshly reserved blocks pays for extent conversion, which a long run amortises, and a noisy
neighbour only ever makes a round slower. The data is read back and compared, so a probe on
a broken disk or filesystem fails instead of reporting a speed.

[Note: sized by time, so it ends on any machine]
A fixed size cannot fit every machine: a 4096-square bf16 product is quick where AMX
multiplies bf16 and orders of magnitude slower where torch emulates it; 512 MiB is a blink for an
NVMe drive and seconds for a network disk. So every measurement grows its size until one
operation takes a set time (or a cap is reached), then takes the best of a few rounds at
that size: fast devices get large, accurate measurements and slow ones end in seconds. Each
dtype's matmul rate is reported beside whether the device multiplies it natively, and
``auto_dtype`` names what ``dtype: auto`` would train in here (compute_dtype.py), so
``outcore estimate --probe`` can take that dtype's rate as the peak.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from outcore.device.accel import default_device
from outcore.device.compute_dtype import DTYPES, capabilities, choose
from outcore.device.machine import describe
from outcore.errors import StorageError
from outcore.offload.aio import DEFAULT_BLOCK_BYTES, DEFAULT_THREADS, AioEngine
from outcore.offload.buffers import ALIGN, BufferPool, aligned_empty, round_up
from outcore.offload.nvme import NvmeStore

DEFAULT_SIZE_BYTES = 512 << 20
"""At most this many bytes are written and read per round: large against the device's cache."""
CALIBRATION_BYTES = 32 << 20
"""The first write's size, from which the disk phase sizes itself to its time budget."""


@dataclass(frozen=True)
class ProbeResult:
    """Rates measured by ``measure``; ``to_json`` gives them to ``outcore estimate``."""

    disk_read_GBps: float
    """Sequential read through the NVMe store, 10^9 bytes per second."""
    disk_write_GBps: float
    """Sequential write through the NVMe store, 10^9 bytes per second."""
    host_copy_GBps: float
    """Bytes copied per second by one large host tensor copy, 10^9 bytes per second."""
    matmul_bf16_TFLOPs: float
    """bf16 square matmul on the compute device, 10^12 flop per second."""
    matmul_fp32_TFLOPs: float
    """fp32 square matmul on the compute device, 10^12 flop per second."""
    direct_io: bool
    """Whether the disk numbers bypassed the page cache (O_DIRECT)."""
    matmul_fp16_TFLOPs: float = 0.0
    """fp16 square matmul on the compute device, 10^12 flop per second."""
    native: dict[str, bool] = field(default_factory=dict)
    """Per dtype name, whether the compute device multiplies it natively."""
    matmul_n: dict[str, int] = field(default_factory=dict)
    """Per dtype name, the square size the rate was measured at (grown by time)."""
    auto_dtype: str = "bf16"
    """The compute dtype ``dtype: auto`` resolves to on this device."""
    disk_bytes: int = 0
    """Bytes written and read per disk round (sized by time, at most ``size_bytes``)."""
    device: str = "cpu"
    """The compute device the matmuls ran on."""
    machine: dict[str, Any] = field(default_factory=dict)
    """``outcore.device.machine.describe()``: CPU model and features, cores, torch, GPU, date."""

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON-ready dict keyed by the field names."""
        return asdict(self)


def _best_rate(
    run: Callable[[], object], work: float, rounds: int, before: Callable[[], object] = int
) -> float:
    """``work`` divided by the fastest of ``rounds`` timed calls of ``run`` (``before`` untimed)."""
    best = float("inf")
    for _ in range(rounds):
        before()
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return work / best


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"probe: {message}", file=sys.stderr, flush=True)


def _pattern_fill(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill ``data`` with a repeating random pattern; return the pattern and a check."""
    nbytes = data.numel()
    pattern = torch.randint(0, 256, (min(nbytes, 1 << 20),), dtype=torch.uint8)
    rows = data[: nbytes - nbytes % pattern.numel()].view(-1, pattern.numel())
    rows.copy_(pattern.expand_as(rows))
    tail = data[rows.numel() :]
    tail.copy_(pattern[: tail.numel()])
    return pattern, rows


def _disk(
    path: str | os.PathLike, max_bytes: int, threads: int, block_bytes: int, rounds: int,
    seconds: float,
) -> tuple[float, float, bool, int]:
    """(read GB/s, write GB/s, O_DIRECT, bytes per round) through a private ``NvmeStore``.

    A first write of ``CALIBRATION_BYTES`` gives the rate from which the rounds are sized to
    take about ``seconds`` in all (at most ``max_bytes`` each; [Note: sized by time ...]).
    One buffer serves both directions (first-touch page faults are slow on a VM): it is
    zeroed before every read, so the final comparison proves the bytes came from the disk.
    """
    with (
        AioEngine(threads, block_bytes) as engine,
        NvmeStore(path, rank=0, engine=engine, pool=BufferPool(ALIGN, ALIGN)) as store,
    ):
        first = min(max_bytes, CALIBRATION_BYTES)
        data = aligned_empty(first)
        _pattern_fill(data)
        extent = store.allocate(first)
        rate = _best_rate(lambda: store.write(extent, data).result(), first, 1)
        store.free(extent)
        fit = int(rate * seconds / (2 * rounds)) // ALIGN * ALIGN
        nbytes = max(first, min(max_bytes, fit))
        if nbytes != first:
            data = aligned_empty(nbytes)
        pattern, rows = _pattern_fill(data)
        extent = store.allocate(nbytes)
        work = nbytes / 1e9
        write = _best_rate(lambda: store.write(extent, data).result(), work, rounds)
        read = _best_rate(lambda: store.read(extent, data).result(), work, rounds, data.zero_)
        tail = data[rows.numel() :]
        same = torch.equal(rows, pattern.expand_as(rows))
        if not (same and torch.equal(tail, pattern[: tail.numel()])):
            raise StorageError(f"probe bytes read back from {store.path} differ from those written")
        return read, write, store.direct, nbytes


def _host_copy(nbytes: int, rounds: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # touched now so page faults are not timed
    return _best_rate(lambda: dst.copy_(src), nbytes / 1e9, rounds)


def _matmul(dtype: torch.dtype, device: torch.device, seconds: float, max_n: int,
            rounds: int) -> tuple[float, int]:
    """(TFLOP/s, n) of ``n x n @ n x n`` with ``n`` grown by time ([Note: sized by time ...]).

    ``n`` doubles from 128 (up to ``max_n``) while the doubled product, eight times the
    work, would still leave room for the warm-up and ``rounds`` rounds within ``seconds``;
    each round runs enough products to last a tenth of ``seconds`` (a GPU finishes one in
    microseconds), and the best round gives the rate.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    target, largest = seconds / 10, seconds / (rounds + 2)

    def timed(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, reps: int) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b, out=out)
        sync()
        return (time.perf_counter() - start) / reps

    n = min(128, max_n)
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        out = torch.matmul(a, b)  # warm-up: kernels chosen, memory touched
        once = timed(a, b, out, 1)
        if 8 * once > largest or 2 * n > max_n:
            break
        n *= 2
    reps = max(1, int(target / max(once, 1e-9)))
    best = min(timed(a, b, out, reps) for _ in range(rounds))
    return 2 * n**3 / best / 1e12, n


def measure(
    path: str | os.PathLike = ".",
    *,
    size_bytes: int = DEFAULT_SIZE_BYTES,
    threads: int = DEFAULT_THREADS,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    rounds: int = 3,
    host_copy_bytes: int = 256 << 20,
    disk_seconds: float = 10.0,
    matmul_seconds: float = 3.0,
    max_n: int | None = None,
    device: torch.device | None = None,
    progress: bool = False,
) -> ProbeResult:
    """Measure disk, host-copy and matmul rates; see the notes above.

    The disk test writes then reads up to ``size_bytes`` per round, sized to take about
    ``disk_seconds`` in all, in a private run folder under ``path`` (deleted afterwards, also
    on error) with the I/O engine's ``threads``/``block_bytes``. Each dtype's matmul takes
    about ``matmul_seconds`` on ``device`` (default: the compute device), squares of at most
    ``max_n`` (default 4096 on a CPU, 16384 on a GPU). About 20 s in all on any machine.
    """
    if min(size_bytes, host_copy_bytes, rounds, disk_seconds, matmul_seconds) <= 0:
        raise ValueError("size_bytes, host_copy_bytes, rounds, disk_seconds and "
                         "matmul_seconds must be > 0")
    device = device or default_device()
    if max_n is not None and max_n < 1:
        raise ValueError(f"max_n must be >= 1, got {max_n}")
    max_n = max_n or (16384 if device.type == "cuda" else 4096)
    _say(progress, f"disk: writing and reading up to {round_up(size_bytes) / 2**20:.0f} MiB "
         f"in {os.fspath(path)} (about {disk_seconds:.0f} s)")
    read, write, direct, nbytes = _disk(path, round_up(size_bytes), threads, block_bytes,
                                        rounds, disk_seconds)
    _say(progress, f"disk: read {read:.2f} GB/s, write {write:.2f} GB/s over "
         f"{nbytes / 2**20:.0f} MiB, O_DIRECT={direct}")
    host = _host_copy(host_copy_bytes, rounds)
    _say(progress, f"host copy: {host:.2f} GB/s")
    caps = capabilities(device)
    native = {"bf16": caps.bf16, "fp16": caps.fp16, "fp32": True}
    rates, sizes = {}, {}
    for name in ("fp32", "bf16", "fp16"):
        rates[name], sizes[name] = _matmul(DTYPES[name], device, matmul_seconds, max_n, rounds)
        how = "native" if native[name] else "emulated"
        _say(progress, f"matmul {name} ({how}, n={sizes[name]}): {rates[name]:.3g} TFLOP/s")
    auto = choose("auto", caps).name
    return ProbeResult(read, write, host, rates["bf16"], rates["fp32"], direct,
                       matmul_fp16_TFLOPs=rates["fp16"], native=native, matmul_n=sizes,
                       auto_dtype=auto, disk_bytes=nbytes, device=str(device),
                       machine=describe(auto))
