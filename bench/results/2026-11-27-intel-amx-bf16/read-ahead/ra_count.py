import sys
import tempfile

sys.path.insert(0, "/work/main/bench")
import train_worker

from outcore.app.models import resolve_config

folder = tempfile.mkdtemp(prefix="rac-", dir="/work/prof")
spec = {
    "row": "nvme+opt",
    "model": "gpt-335m",
    "nvme_path": folder,
    "clip": 0.0,
    "prefetch_bytes": None,
    "dtype": "bf16",
    "outcore_set": {},
}
engine, _ = train_worker.outcore_engine(spec)
x, y = train_worker.make_batch(resolve_config("gpt-335m").vocab, 1, 512, engine.device)
step = train_worker.engine_step(engine, x, y)
ra = engine.sharded_optimizer.pipeline.read_ahead
print("slots cap", ra.capacity)
calls = [0]
orig = ra.pump


def pump():
    calls[0] += 1
    orig()


ra.pump = pump
for i in range(4):
    calls[0] = 0
    r0 = ra.stats["read"]
    t0, fe, be = step()
    done = (
        sum(all(f.done() for f in s.work.pending) for s in ra._staged.values()) if ra._staged else 0
    )
    print(
        i,
        "pump calls",
        calls[0],
        "issued",
        ra.stats["read"] - r0,
        "stats",
        ra.stats,
        "plan",
        len(ra._plan),
    )
