"""Disk rates with O_DIRECT, as the swap file sees them.

    python disk.py mixed PATH_PREFIX GIB   # read alone, write alone, both at once (4 threads
                                           # each, 8 MiB requests), three rounds
    python disk.py qd PATH                 # rates against request size and threads
"""

import mmap
import os
import sys
import threading
import time


def filled(nbytes: int) -> mmap.mmap:
    buffer = mmap.mmap(-1, nbytes)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(nbytes))
    return buffer


def prepare(path: str, size: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    os.ftruncate(fd, size)
    block = filled(8 << 20)
    for offset in range(0, size, 8 << 20):
        os.pwrite(fd, block, offset)
    os.fsync(fd)
    return fd


def move(fd: int, size: int, write: bool, buffers: list[mmap.mmap]) -> None:
    """Read or write ``size`` bytes in ``len(buffers[0])`` requests, one thread per buffer."""
    block = len(buffers[0])
    offsets, lock = list(range(0, size, block)), threading.Lock()

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

    together([(worker, (b,)) for b in buffers])


def together(calls: list[tuple[object, tuple]]) -> float:
    threads = [threading.Thread(target=f, args=a) for f, a in calls]  # type: ignore[arg-type]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def mixed(prefix: str, size: int) -> None:
    a, b = prepare(prefix + ".a", size), prepare(prefix + ".b", size)
    reading = (move, (a, size, False, [filled(8 << 20) for _ in range(4)]))
    writing = (move, (b, size, True, [filled(8 << 20) for _ in range(4)]))
    gb = size / 1e9
    for _ in range(3):
        tr, tw = together([reading]), together([writing])
        tm = together([reading, writing])
        print(f"read {gb / tr:.2f} GB/s ({tr:.2f} s), write {gb / tw:.2f} GB/s ({tw:.2f} s), "
              f"sum {tr + tw:.2f} s; both at once {tm:.2f} s = {tm / (tr + tw):.2f} of the sum",
              flush=True)
    for fd, suffix in ((a, ".a"), (b, ".b")):
        os.close(fd)
        os.unlink(prefix + suffix)


def queue_depth(path: str, size: int = 2 << 30) -> None:
    fd = prepare(path, size)
    for block in (1 << 20, 8 << 20, 32 << 20):
        for n in (1, 2, 4, 8, 16):
            rates = [size / 1e9 / together([(move, (fd, size, write,
                                                    [filled(block) for _ in range(n)]))])
                     for write in (False, True)]
            print(f"{block >> 20:>2} MiB x {n:>2} threads: read {rates[0]:.2f} GB/s, "
                  f"write {rates[1]:.2f} GB/s", flush=True)
    os.close(fd)
    os.unlink(path)


if __name__ == "__main__":
    if sys.argv[1] == "mixed":
        mixed(sys.argv[2], int(float(sys.argv[3]) * 2**30))
    else:
        queue_depth(sys.argv[2])
