"""Does hashing a cast slice while it is still in cache cost less than hashing it after?

One thread: 64 MiB of bf16 cast from fp32 masters, then xxh3 over all of it, against the
cast and a streaming xxh3 in pieces (the digest is the same). Prints the median of 7 runs.

    .venv/bin/python bench/results/2026-11-26-intel-amx-bf16/pipeline/digest_in_cache.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import xxhash

N = 64 << 20  # bytes of bf16 output
master = torch.randn(N // 2, dtype=torch.float32)
out = torch.empty(N // 2, dtype=torch.bfloat16)


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


def cast_only() -> None:
    out.copy_(master)


def cast_then_hash() -> int:
    out.copy_(master)
    return xxhash.xxh3_64_intdigest(as_bytes(out))


def in_pieces(piece_bytes: int) -> int:
    h, n = xxhash.xxh3_64(), piece_bytes // 2
    for i in range(0, out.numel(), n):
        piece = out[i : i + n]
        piece.copy_(master[i : i + n])
        h.update(as_bytes(piece))
    return h.intdigest()


def median_ms(f: Callable[[], object]) -> float:
    times = []
    for _ in range(7):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return sorted(times)[3] * 1e3


if __name__ == "__main__":
    torch.set_num_threads(1)
    assert cast_then_hash() == in_pieces(1 << 20)
    for name, f in [("cast only", cast_only), ("cast then hash", cast_then_hash),
                    ("pieces 256K", lambda: in_pieces(256 << 10)),
                    ("pieces 1M", lambda: in_pieces(1 << 20)),
                    ("pieces 4M", lambda: in_pieces(4 << 20))]:
        print(f"{name}: {median_ms(f):.1f} ms for {N >> 20} MiB out")
