"""Read alone, write alone, and both at once: O_DIRECT, 4 threads each, 8 MiB requests.

    python mixed.py PATH_PREFIX GIB
"""

import mmap
import os
import sys
import threading
import time

PATH, SIZE = sys.argv[1], int(float(sys.argv[2]) * 2**30)
BLOCK, THREADS = 8 << 20, 4
BUFFERS = [mmap.mmap(-1, BLOCK) for _ in range(2 * THREADS)]
for buffer in BUFFERS:
    buffer.write(os.urandom(1024) * (BLOCK // 1024))


def prepare(path: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    os.ftruncate(fd, SIZE)
    for offset in range(0, SIZE, BLOCK):
        os.pwrite(fd, BUFFERS[0], offset)
    os.fsync(fd)
    return fd


def run(fd: int, write: bool, buffers: list[mmap.mmap]) -> None:
    offsets, lock = list(range(0, SIZE, BLOCK)), threading.Lock()

    def worker(buffer: mmap.mmap) -> None:
        while True:
            with lock:
                if not offsets:
                    return
                offset = offsets.pop()
            if write:
                os.pwrite(fd, buffer, offset)
            else:
                os.preadv(fd, [buffer], offset)

    threads = [threading.Thread(target=worker, args=(b,)) for b in buffers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def timed(*jobs: tuple[int, bool, list[mmap.mmap]]) -> float:
    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


a, b = prepare(PATH + ".a"), prepare(PATH + ".b")
reading, writing = (a, False, BUFFERS[:THREADS]), (b, True, BUFFERS[THREADS:])
gb = SIZE / 1e9
for _ in range(3):
    tr, tw = timed(reading), timed(writing)
    tm = timed(reading, writing)
    print(f"read {gb / tr:.2f} GB/s ({tr:.2f} s), write {gb / tw:.2f} GB/s ({tw:.2f} s), "
          f"sum {tr + tw:.2f} s; both at once {tm:.2f} s = {tm / (tr + tw):.2f} of the sum",
          flush=True)
for fd in (a, b):
    os.close(fd)
for suffix in (".a", ".b"):
    os.unlink(PATH + suffix)
