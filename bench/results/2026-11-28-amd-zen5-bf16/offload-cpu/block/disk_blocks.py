"""Read, write and mixed GB/s through outcore's AioEngine at several thread counts and block
sizes, with the process's CPU seconds per GB moved.

Lab script of the 2026-11-28 Zen 5 offload-CPU record (the script that ran, restructured
after the run for ruff; the same requests in the same order):
    PYTHONPATH=<repo> .venv/bin/python disk_blocks.py <file on the swap disk> <GB each way>
"""

import collections
import itertools
import os
import sys
import time

from outcore.offload.aio import AioEngine
from outcore.offload.buffers import aligned_empty

CHUNK = 64 << 20


def run(eng: AioEngine, fd: int, bufs: list, reads: list[int], writes: list[int]) -> float:
    """Reads and writes interleaved (mix.py's order), at most 6 requests of 64 MiB in
    flight; seconds taken."""
    ops = [op for pair in itertools.zip_longest(
        [("r", off) for off in reads], [("w", off) for off in writes]) for op in pair if op]
    start, inflight = time.perf_counter(), collections.deque()
    for k, (kind, off) in enumerate(ops):
        if len(inflight) == 6:
            inflight.popleft().result()
        io = eng.pread if kind == "r" else eng.pwrite
        inflight.append(io(fd, bufs[k % 8], off))
    while inflight:
        inflight.popleft().result()
    return time.perf_counter() - start


def main() -> None:
    path, gb = sys.argv[1], float(sys.argv[2])
    n = int(gb * 1e9) // CHUNK * CHUNK
    bufs = [aligned_empty(CHUNK).fill_(7) for _ in range(8)]  # eight 64 MiB sources/targets
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, 2 * n)  # two halves: one read while the other is written
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
