"""Sustained read, write and mixed throughput through outcore's AioEngine (O_DIRECT).

Lab script of the 2026-11-27 Zen 5 pipeline record:
    PYTHONPATH=<repo> .venv/bin/python mix.py <file on the swap disk> <GB each way> [threads]
"""

import os
import sys
import time

from outcore.offload.aio import AioEngine
from outcore.offload.buffers import aligned_empty

CHUNK = 64 << 20


def main() -> None:
    path, gb = sys.argv[1], float(sys.argv[2])
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    n = int(gb * 1e9) // CHUNK * CHUNK
    bufs = [aligned_empty(CHUNK) for _ in range(8)]
    for b in bufs:
        b.fill_(7)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, 2 * n)
    eng = AioEngine(threads=threads)

    def run(reads: list[int], writes: list[int]) -> float:
        """Reads and writes interleaved, at most 6 requests of 64 MiB in flight."""
        start, futs, ops = time.perf_counter(), [], []
        for i in range(max(len(reads), len(writes))):
            if i < len(reads):
                ops.append(("r", reads[i]))
            if i < len(writes):
                ops.append(("w", writes[i]))
        for k, (op, off) in enumerate(ops):
            if len(futs) >= 6:
                futs.pop(0).result()
            b = bufs[k % 8]
            futs.append(eng.pread(fd, b, off) if op == "r" else eng.pwrite(fd, b, off))
        for f in futs:
            f.result()
        return time.perf_counter() - start

    first, second = list(range(0, n, CHUNK)), list(range(n, 2 * n, CHUNK))
    run([], first + second)  # lay out both halves
    g = n / 1e9
    for rnd in range(2):
        tw, tr, tm = run([], first), run(second, []), run(second, first)
        print(f"threads {threads} round {rnd}: write {g / tw:.2f} GB/s, read {g / tr:.2f} GB/s, "
              f"serial sum {2 * g / (tw + tr):.2f} GB/s, mixed {2 * g / tm:.2f} GB/s "
              f"({tm:.2f} s vs serial {tw + tr:.2f} s)")
    eng.close()
    os.close(fd)
    os.unlink(path)


if __name__ == "__main__":
    main()
