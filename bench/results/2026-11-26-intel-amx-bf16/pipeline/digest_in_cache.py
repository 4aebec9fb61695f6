import time, torch, xxhash
torch.set_num_threads(1)
N = 64 << 20  # bytes of bf16 output
master = torch.randn(N // 2, dtype=torch.float32)
out = torch.empty(N // 2, dtype=torch.bfloat16)
def bv(t): return t.view(torch.uint8).numpy()
def whole():
    out.copy_(master)
    return xxhash.xxh3_64_intdigest(bv(out))
def pieces(p):
    h = xxhash.xxh3_64()
    n = p // 2
    for i in range(0, out.numel(), n):
        o = out[i:i+n]; o.copy_(master[i:i+n]); h.update(bv(o))
    return h.intdigest()
def castonly():
    out.copy_(master)
assert whole() == pieces(1 << 20)
for name, f in [("cast only", castonly), ("cast then hash", whole), ("pieces 256K", lambda: pieces(256 << 10)), ("pieces 1M", lambda: pieces(1 << 20)), ("pieces 4M", lambda: pieces(4 << 20))]:
    ts = []
    for _ in range(7):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    ts.sort(); print(f"{name}: {ts[3]*1e3:.1f} ms for {N>>20} MiB out")
