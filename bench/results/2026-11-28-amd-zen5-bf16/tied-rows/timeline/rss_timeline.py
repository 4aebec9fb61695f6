"""RSS every 3 ms over a run's steps with phase marks, and the ledger's host kinds at each
step's peak; then step 2 sampled every 5th sample (time, phase, RSS MiB, held gradients MiB).
gpt-335m, everything on NVMe (swap folder /tmp/rt/swap, which must exist)."""
import argparse
import json
import os
import threading
import time

import torch

import outcore
from outcore.app.models import build_model, offload_blocks, resolve_config

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


ap = argparse.ArgumentParser()
ap.add_argument("--seq", type=int, default=128)
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--hb", type=int, default=64, help="offload.host_buffer_bytes, MiB")
ap.add_argument("--pf", type=int, default=576, help="zero.prefetch_bytes, MiB")
ap.add_argument("--reuse", default="false", help="offload.reuse_freed_memory, or auto")
ap.add_argument("--act", action="store_true", help="every block's activations on NVMe")
ap.add_argument("--set", action="append", default=[], help="SECTION.KEY=JSON")
a = ap.parse_args()
off = {"params": "nvme", "optimizer": "nvme", "nvme_path": "/tmp/rt/swap",
       "host_buffer_bytes": a.hb * MIB}
if a.reuse != "auto":
    off["reuse_freed_memory"] = a.reuse == "true"
d = {"dtype": "bf16", "seed": 0, "optimizer": {"type": "adamw", "lr": 1e-4}, "offload": off,
     "zero": {"prefetch_bytes": a.pf * MIB}}
for item in a.set:
    k, v = item.split("=", 1)
    sec, key = k.split(".")
    d.setdefault(sec, {})[key] = json.loads(v)
cfg = outcore.Config.from_dict(d)
torch.manual_seed(0)
with outcore.init(cfg):
    model = build_model("gpt-335m")
if a.act:
    offload_blocks(model, "nvme")
engine = outcore.initialize(model, cfg)
base = rss()
samples: list = []
phase, stop = ["build"], [False]


def sampler() -> None:
    while not stop[0]:
        samples.append((time.perf_counter(), rss(), phase[0], engine.rt.ledger.snapshot()))
        time.sleep(0.003)


th = threading.Thread(target=sampler, daemon=True)
th.start()
shape = resolve_config("gpt-335m")
ids = torch.randint(0, shape.vocab, (1, a.seq + 1), generator=torch.Generator().manual_seed(0))
steps = []
for i in range(a.steps):
    t = time.perf_counter()
    phase[0] = f"{i}:fwd"
    loss = engine(ids[:, :-1], ids[:, 1:])
    phase[0] = f"{i}:bwd"
    engine.backward(loss)
    phase[0] = f"{i}:step"
    engine.step()
    engine.synchronize()
    steps.append(round(time.perf_counter() - t, 2))
stop[0] = True
th.join()
print("steps", steps, "base", base // MIB)
for i in range(1, a.steps):
    ss = [s for s in samples if s[2].startswith(f"{i}:")]
    pk = max(ss, key=lambda s: s[1])
    by_phase: dict = {}
    for s in ss:
        by_phase[s[2]] = max(by_phase.get(s[2], 0), s[1] // MIB)
    host = {k: v // MIB for k, v in pk[3].items()
            if k.startswith("host.") and not k.startswith("peak") and v}
    print(i, "peak", pk[1] // MIB, "in", pk[2], "at", round(pk[0] - ss[0][0], 2), "by phase",
          by_phase, "ledger", host, "sum", sum(host.values()))
ss = [s for s in samples if s[2].startswith("2:")]
for s in ss[::5]:
    print(round(s[0] - ss[0][0], 3), s[2], s[1] // MIB, s[3].get("host.grads", 0) // MIB)
engine.close(keep_values=False)
