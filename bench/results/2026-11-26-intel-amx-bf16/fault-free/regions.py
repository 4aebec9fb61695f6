import sys, tempfile, time
sys.path.insert(0, "/work/exp/bench"); sys.path.insert(0, "/work/exp")
import train_worker, torch
from outcore.app.models import resolve_config
import outcore.offload.buffers as B
sizes = {}
orig = B.huge_page_mapping
def hp(n):
    sizes[n] = sizes.get(n, 0) + 1
    return orig(n)
B.huge_page_mapping = hp
batch, seq = int(sys.argv[1]), int(sys.argv[2])
spec = {"row": "nvme+opt", "model": "gpt-335m", "nvme_path": tempfile.mkdtemp(dir="/work/prof"), "clip": 0.0,
        "prefetch_bytes": None, "dtype": "bf16", "outcore_set": {}}
engine, _ = train_worker.outcore_engine(spec)
x, y = train_worker.make_batch(resolve_config("gpt-335m").vocab, batch, seq, engine.device)
step = train_worker.engine_step(engine, x, y)
rt = engine.rt if hasattr(engine, "rt") else None
R = None
for obj in gc_objs() if False else []: pass
import gc
R = [o for o in gc.get_objects() if isinstance(o, B.AlignedRegions)][0]
print("cap", R.cap_bytes >> 20, "MiB")
for i in range(5):
    sizes.clear(); f0, m0 = R.fills, R.mapped
    step()
    print(i, "fills", R.fills - f0, "mapped", R.mapped - m0, "cached MiB", R.cached_bytes >> 20,
          "fresh MiB", sum(k*v for k, v in sizes.items()) >> 20, sorted(((k >> 10, v) for k, v in sizes.items()), reverse=True)[:6], flush=True)
