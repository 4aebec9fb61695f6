"""Measure this machine: disk read/write through outcore's own I/O path, host copy, matmul.

[Note: what the probe measures and why this way]
The efficiency model (``estimate.py``) needs the bandwidths outcore will actually get, not
the device's data sheet. So the disk numbers come from the same ``NvmeStore``/``AioEngine``
path that training uses (O_DIRECT, the engine's thread count and block size), on the folder
the swap would live in. Each number is the best of a few rounds: the first write into
freshly reserved blocks pays for extent conversion, which a long run amortises, and a noisy
neighbour only ever makes a round slower. The data is read back and compared, so a probe on
a broken disk or filesystem fails instead of reporting a speed.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from outcore.errors import StorageError
from outcore.tiers.aio import DEFAULT_BLOCK_BYTES, DEFAULT_THREADS, AioEngine
from outcore.tiers.buffers import ALIGN, BufferPool, aligned_empty, round_up
from outcore.tiers.nvme import NvmeStore

DEFAULT_SIZE_BYTES = 512 << 20
"""Bytes written and read per round: large against the device's cache, quick to run."""


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
    """bf16 square matmul on the default device, 10^12 flop per second."""
    matmul_fp32_TFLOPs: float
    """fp32 square matmul on the default device, 10^12 flop per second."""
    direct_io: bool
    """Whether the disk numbers bypassed the page cache (O_DIRECT)."""

    def to_json(self) -> dict[str, float | bool]:
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


def _disk(
    path: str | os.PathLike, nbytes: int, threads: int, block_bytes: int, rounds: int
) -> tuple[float, float, bool]:
    """(read GB/s, write GB/s, O_DIRECT) for ``nbytes`` through a private ``NvmeStore``.

    One buffer serves both directions (first-touch page faults are slow on a VM): it is
    zeroed before every read, so the final comparison proves the bytes came from the disk.
    """
    data = aligned_empty(nbytes)
    pattern = torch.randint(0, 256, (min(nbytes, 1 << 20),), dtype=torch.uint8)
    rows = data[: nbytes - nbytes % pattern.numel()].view(-1, pattern.numel())
    rows.copy_(pattern.expand_as(rows))
    tail = data[rows.numel() :]
    tail.copy_(pattern[: tail.numel()])
    with (
        AioEngine(threads, block_bytes) as engine,
        NvmeStore(path, rank=0, engine=engine, pool=BufferPool(ALIGN, ALIGN)) as store,
    ):
        extent = store.allocate(nbytes)
        work = nbytes / 1e9
        write = _best_rate(lambda: store.write(extent, data).result(), work, rounds)
        read = _best_rate(lambda: store.read(extent, data).result(), work, rounds, data.zero_)
        same = torch.equal(rows, pattern.expand_as(rows))
        if not (same and torch.equal(tail, pattern[: tail.numel()])):
            raise StorageError(f"probe bytes read back from {store.path} differ from those written")
        return read, write, store.direct


def _host_copy(nbytes: int, rounds: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # touched now so page faults are not timed
    return _best_rate(lambda: dst.copy_(src), nbytes / 1e9, rounds)


def _matmul(n: int, dtype: torch.dtype, rounds: int) -> float:
    """TFLOP/s of ``n x n @ n x n``: one untimed warm-up, then the best of ``rounds``."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    out = torch.matmul(a, b)
    return _best_rate(lambda: torch.matmul(a, b, out=out), 2 * n**3 / 1e12, rounds)


def measure(
    path: str | os.PathLike = ".",
    *,
    size_bytes: int = DEFAULT_SIZE_BYTES,
    threads: int = DEFAULT_THREADS,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    rounds: int = 3,
    host_copy_bytes: int = 256 << 20,
    bf16_n: int = 4096,
    fp32_n: int = 2048,
    progress: bool = False,
) -> ProbeResult:
    """Measure disk, host-copy and matmul rates; see [Note: what the probe measures ...].

    The disk test writes then reads ``size_bytes`` in a private run folder under ``path``
    (deleted afterwards, also on error) with the I/O engine's ``threads``/``block_bytes``.
    Matmuls are ``bf16_n``/``fp32_n`` squares: on the test CPU fp32 already peaks at 2048
    while bf16 (AMX) still gains up to 4096. The defaults take about 5-10 s on 2 cores.
    """
    if min(size_bytes, host_copy_bytes, bf16_n, fp32_n, rounds) <= 0:
        raise ValueError("size_bytes, host_copy_bytes, bf16_n, fp32_n and rounds must be > 0")
    nbytes = round_up(size_bytes)
    _say(progress, f"disk: writing and reading {nbytes / 2**20:.0f} MiB in {os.fspath(path)}")
    read, write, direct = _disk(path, nbytes, threads, block_bytes, rounds)
    _say(progress, f"disk: read {read:.2f} GB/s, write {write:.2f} GB/s, O_DIRECT={direct}")
    host = _host_copy(host_copy_bytes, rounds)
    _say(progress, f"host copy: {host:.2f} GB/s")
    bf16 = _matmul(bf16_n, torch.bfloat16, rounds)
    _say(progress, f"matmul bf16: {bf16:.3f} TFLOP/s")
    fp32 = _matmul(fp32_n, torch.float32, rounds)
    _say(progress, f"matmul fp32: {fp32:.3f} TFLOP/s")
    return ProbeResult(read, write, host, bf16, fp32, direct)
