"""Read alone, write alone, and both at once, O_DIRECT, 4 threads each, 8 MiB requests."""
import mmap, os, sys, threading, time
path = sys.argv[1]; size = int(float(sys.argv[2]) * 2**30); blk = 8 << 20; nthr = 4
buf = [mmap.mmap(-1, blk) for _ in range(2 * nthr)]
for b in buf: b.write(os.urandom(1024) * (blk // 1024)); b.seek(0)
def prep(p):
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    os.ftruncate(fd, size)
    for off in range(0, size, blk): os.pwrite(fd, buf[0], off)
    os.fsync(fd); return fd
def run(fd, write, bufs):
    offs = list(range(0, size, blk)); lock = threading.Lock()
    def worker(b):
        while True:
            with lock:
                if not offs: return
                off = offs.pop()
            (os.pwrite if write else os.preadv)(fd, b, off) if write else os.preadv(fd, [b], off)
    ts = [threading.Thread(target=worker, args=(b,)) for b in bufs]
    [t.start() for t in ts]; [t.join() for t in ts]
a = prep(path + ".a"); b = prep(path + ".b")
for rep in range(3):
    t0 = time.perf_counter(); run(a, False, buf[:nthr]); tr = time.perf_counter() - t0
    t0 = time.perf_counter(); run(b, True, buf[nthr:]); tw = time.perf_counter() - t0
    t0 = time.perf_counter()
    th = [threading.Thread(target=run, args=(a, False, buf[:nthr])), threading.Thread(target=run, args=(b, True, buf[nthr:]))]
    [t.start() for t in th]; [t.join() for t in th]; tm = time.perf_counter() - t0
    g = size / 1e9
    print(f"read {g/tr:.2f} GB/s ({tr:.2f} s), write {g/tw:.2f} GB/s ({tw:.2f} s), sum {tr+tw:.2f} s; both at once {tm:.2f} s = {tm/(tr+tw):.2f} of the sum", flush=True)
os.close(a); os.close(b); os.unlink(path + ".a"); os.unlink(path + ".b")
