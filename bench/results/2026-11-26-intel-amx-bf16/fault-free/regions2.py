import sys, tempfile, gc, psutil
sys.path.insert(0, "/work/main/bench"); sys.path.insert(0, "/work/main")
import train_worker, torch
from outcore.app.models import resolve_config
import outcore.offload.buffers as B
import outcore.sizing.placement as P
budget = int(sys.argv[1]) << 20; factor = float(sys.argv[2])
P.prefetch_share = lambda free: budget
spec = {"row": "nvme+opt", "model": "gpt-335m", "nvme_path": tempfile.mkdtemp(dir="/work/prof"), "clip": 0.0,
        "prefetch_bytes": None, "dtype": "bf16", "outcore_set": {}}
engine, _ = train_worker.outcore_engine(spec)
x, y = train_worker.make_batch(resolve_config("gpt-335m").vocab, 1, 512, engine.device)
step = train_worker.engine_step(engine, x, y)
R = [o for o in gc.get_objects() if isinstance(o, B.AlignedRegions)][0]
step()
print("budget", engine.schedule.prefetch_bytes >> 20, "cap after settle", R.cap_bytes >> 20, "reusing", engine.rt.reusing)
R.cap_bytes = int(factor * engine.schedule.prefetch_bytes)
from outcore.offload.ledger import Kind
for i in range(4):
    f0, m0 = R.fills, R.mapped
    step()
    print(i, "fills", R.fills - f0, "mapped", R.mapped - m0, "cached MiB", R.cached_bytes >> 20, "rss GiB %.2f" % (psutil.Process().memory_info().rss / 2**30), flush=True)
