"""Fresh full-tensor mappings per step with the prefetch budget forced to BUDGET_MIB and the
region cap set to FACTOR budgets after the first step (gpt-335m, nvme+opt, 512 tokens).

Run from the repository root: python bench/results/.../fault-free/regions2.py 256 2
"""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(REPO / "bench"), str(REPO)]

import psutil  # noqa: E402
import train_worker  # noqa: E402

import outcore.offload.buffers as buffers  # noqa: E402
import outcore.sizing.placement as placement  # noqa: E402
from outcore.app.models import resolve_config  # noqa: E402

budget, factor = int(sys.argv[1]) << 20, float(sys.argv[2])
placement.prefetch_share = lambda free: budget
spec = {"row": "nvme+opt", "model": "gpt-335m", "nvme_path": tempfile.mkdtemp(),
        "clip": 0.0, "prefetch_bytes": None, "dtype": "bf16", "outcore_set": {}}
engine, _ = train_worker.outcore_engine(spec)
x, y = train_worker.make_batch(resolve_config("gpt-335m").vocab, 1, 512, engine.device)
step = train_worker.engine_step(engine, x, y)
regions = next(o for o in gc.get_objects() if isinstance(o, buffers.AlignedRegions))
step()
print("budget", engine.schedule.prefetch_bytes >> 20, "cap after settle",
      regions.cap_bytes >> 20, "reusing", engine.rt.reusing)
regions.cap_bytes = int(factor * engine.schedule.prefetch_bytes)
for i in range(4):
    fills, mapped = regions.fills, regions.mapped
    step()
    rss = psutil.Process().memory_info().rss / 2**30
    print(i, "fills", regions.fills - fills, "mapped", regions.mapped - mapped,
          "cached MiB", regions.cached_bytes >> 20, f"rss GiB {rss:.2f}", flush=True)
