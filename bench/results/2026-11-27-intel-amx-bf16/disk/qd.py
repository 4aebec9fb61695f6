"""Read and write rates against request size and requests in flight (threads), O_DIRECT.

    python qd.py PATH
"""

import mmap
import os
import sys
import threading
import time

PATH, SIZE = sys.argv[1], 2 << 30
fd = os.open(PATH, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
os.ftruncate(fd, SIZE)
fill = mmap.mmap(-1, 8 << 20)
fill.write(os.urandom(8 << 20))
for offset in range(0, SIZE, 8 << 20):
    os.pwrite(fd, fill, offset)
os.fsync(fd)


def rate(threads: int, block: int, write: bool = False) -> float:
    offsets, lock = list(range(0, SIZE, block)), threading.Lock()

    def worker() -> None:
        buffer = mmap.mmap(-1, block)
        buffer.write(os.urandom(block))
        while True:
            with lock:
                if not offsets:
                    return
                offset = offsets.pop()
            if write:
                os.pwrite(fd, buffer, offset)
            else:
                os.preadv(fd, [buffer], offset)

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    start = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return SIZE / 1e9 / (time.perf_counter() - start)


for block in (1 << 20, 8 << 20, 32 << 20):
    for n in (1, 2, 4, 8, 16):
        print(f"{block >> 20:>2} MiB x {n:>2} threads: read {rate(n, block):.2f} GB/s, "
              f"write {rate(n, block, True):.2f} GB/s", flush=True)
os.close(fd)
os.unlink(PATH)
