"""Read, write and mixed GB/s through outcore's AioEngine at several thread counts and block
sizes, with the process's CPU seconds per GB moved.

Lab script of the 2026-11-28 Zen 5 offload-CPU record:
    PYTHONPATH=<repo> .venv/bin/python disk_blocks.py <file on the swap disk> <GB each way>
"""

import os
import sys
import time

from outcore.offload.aio import AioEngine
from outcore.offload.buffers import aligned_empty

CHUNK = 64 << 20


def run(eng: AioEngine, fd: int, bufs: list, reads: list[int], writes: list[int]) -> float:
    """Reads and writes interleaved, at most 6 requests of 64 MiB in flight; seconds taken."""
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


def main() -> None:
    path, gb = sys.argv[1], float(sys.argv[2])
    n = int(gb * 1e9) // CHUNK * CHUNK
    bufs = [aligned_empty(CHUNK) for _ in range(8)]
    for b in bufs:
        b.fill_(7)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, 2 * n)
    first, second = list(range(0, n, CHUNK)), list(range(n, 2 * n, CHUNK))
    with AioEngine(8) as eng:
        run(eng, fd, bufs, [], first + second)  # lay out both halves
    g = n / 1e9
    for rnd in range(2):
        for threads, blk in [(4, 4), (8, 4), (4, 16), (8, 16), (4, 64)]:
            with AioEngine(threads, blk << 20) as eng:
                t0 = time.process_time()
                tw = run(eng, fd, bufs, [], first)
                tr = run(eng, fd, bufs, second, [])
                tm = run(eng, fd, bufs, second, first)
                cpu = time.process_time() - t0
            print(f"threads {threads} block {blk} MiB r{rnd}: write {g / tw:.2f} read "
                  f"{g / tr:.2f} serial {2 * g / (tw + tr):.2f} mixed {2 * g / tm:.2f} GB/s; "
                  f"cpu {cpu / (4 * g):.3f} s/GB", flush=True)
    os.close(fd)
    os.unlink(path)


if __name__ == "__main__":
    main()
