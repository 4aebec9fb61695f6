import mmap, os, sys, threading, time
path = sys.argv[1]; size = 2 << 30
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT); os.ftruncate(fd, size)
w = mmap.mmap(-1, 8 << 20); w.write(os.urandom(8 << 20))
for off in range(0, size, 8 << 20): os.pwrite(fd, w, off)
os.fsync(fd)
def run(nthr, blk, write=False):
    offs = list(range(0, size, blk)); lock = threading.Lock()
    def worker():
        b = mmap.mmap(-1, blk); b.write(os.urandom(blk))
        while True:
            with lock:
                if not offs: return
                off = offs.pop()
            if write: os.pwrite(fd, b, off)
            else: os.preadv(fd, [b], off)
    ts = [threading.Thread(target=worker) for _ in range(nthr)]
    t0 = time.perf_counter(); [t.start() for t in ts]; [t.join() for t in ts]
    return size / 1e9 / (time.perf_counter() - t0)
for blk in (1 << 20, 8 << 20, 32 << 20):
    for n in (1, 2, 4, 8, 16):
        print(f"{blk>>20:>2} MiB x {n:>2} threads: read {run(n, blk):.2f} GB/s, write {run(n, blk, True):.2f} GB/s", flush=True)
os.close(fd); os.unlink(path)
