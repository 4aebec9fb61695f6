"""Count the full tensors' fills and fresh mappings per step of bench/train.py's nvme+opt row.

Run from the repository root: python bench/results/.../fault-free/regions.py BATCH SEQ.
The before-side numbers of the record came from a worktree of 2b97bcd whose region cap
could be set with EXP_CAP (bytes); this script reads whatever the checkout does.
"""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(REPO / "bench"), str(REPO)]

import train_worker  # noqa: E402

import outcore.offload.buffers as buffers  # noqa: E402
from outcore.app.models import resolve_config  # noqa: E402

sizes: dict[int, int] = {}
_mapping = buffers.huge_page_mapping


def counted(nbytes: int):  # noqa: ANN201 - a tensor, as the original returns
    sizes[nbytes] = sizes.get(nbytes, 0) + 1
    return _mapping(nbytes)


buffers.huge_page_mapping = counted
batch, seq = int(sys.argv[1]), int(sys.argv[2])
spec = {"row": "nvme+opt", "model": "gpt-335m", "nvme_path": tempfile.mkdtemp(),
        "clip": 0.0, "prefetch_bytes": None, "dtype": "bf16", "outcore_set": {}}
engine, _ = train_worker.outcore_engine(spec)
x, y = train_worker.make_batch(resolve_config("gpt-335m").vocab, batch, seq, engine.device)
step = train_worker.engine_step(engine, x, y)
regions = next(o for o in gc.get_objects() if isinstance(o, buffers.AlignedRegions))
print("cap", regions.cap_bytes >> 20, "MiB")
for i in range(5):
    sizes.clear()
    fills, mapped = regions.fills, regions.mapped
    step()
    fresh = sum(k * v for k, v in sizes.items()) >> 20
    print(i, "fills", regions.fills - fills, "mapped", regions.mapped - mapped,
          "cached MiB", regions.cached_bytes >> 20, "fresh MiB", fresh, flush=True)
