"""Ad-hoc: RSS over one run's steps with phase marks and the ledger's current kinds at the peak."""
import argparse, json, os, sys, threading, time
import torch
MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE
ap = argparse.ArgumentParser()
ap.add_argument("--seq", type=int, default=128); ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--hb", type=int, default=64); ap.add_argument("--pf", type=int, default=576)
ap.add_argument("--reuse", default="false"); ap.add_argument("--act", action="store_true")
ap.add_argument("--set", action="append", default=[])
a = ap.parse_args()
import outcore
from outcore.app.models import build_model, resolve_config, offload_blocks
off = {"params": "nvme", "optimizer": "nvme", "nvme_path": "/tmp/rt/swap", "host_buffer_bytes": a.hb * MIB}
if a.reuse != "auto": off["reuse_freed_memory"] = a.reuse == "true"
d = {"dtype": "bf16", "seed": 0, "optimizer": {"type": "adamw", "lr": 1e-4}, "offload": off,
     "zero": {"prefetch_bytes": a.pf * MIB}}
for s in a.set:
    k, v = s.split("=", 1); sec, key = k.split(".")
    d.setdefault(sec, {})[key] = json.loads(v)
cfg = outcore.Config.from_dict(d)
torch.manual_seed(0)
with outcore.init(cfg):
    model = build_model("gpt-335m")
if a.act: offload_blocks(model, "nvme")
engine = outcore.initialize(model, cfg)
base = rss()
samples = []; phase = ["build"]; stop = False
def sampler():
    while not stop:
        snap = engine.rt.ledger.snapshot()
        samples.append((time.perf_counter(), rss(), phase[0], snap))
        time.sleep(0.003)
th = threading.Thread(target=sampler, daemon=True); th.start()
shape = resolve_config("gpt-335m")
ids = torch.randint(0, shape.vocab, (1, a.seq + 1), generator=torch.Generator().manual_seed(0))
t0 = time.perf_counter(); steps = []
for i in range(a.steps):
    t = time.perf_counter(); phase[0] = f"{i}:fwd"
    loss = engine(ids[:, :-1], ids[:, 1:]); phase[0] = f"{i}:bwd"
    engine.backward(loss); phase[0] = f"{i}:step"
    engine.step(); engine.synchronize(); steps.append(round(time.perf_counter() - t, 2))
stop = True; th.join()
print("steps", steps, "base", base // MIB)
for i in range(1, a.steps):
    ss = [s for s in samples if s[2].startswith(f"{i}:")]
    pk = max(ss, key=lambda s: s[1])
    byph = {}
    for s in ss: byph[s[2]] = max(byph.get(s[2], 0), s[1] // MIB)
    host = {k: v // MIB for k, v in pk[3].items() if k.startswith("host.") and not k.startswith("peak") and v}
    print(i, "peak", pk[1] // MIB, "in", pk[2], "at", round(pk[0] - [s for s in ss][0][0], 2), "by phase", byph, "ledger", host, "sum", sum(host.values()))
ss = [s for s in samples if s[2].startswith("2:")]
t0 = ss[0][0]; last = None
for s in ss[::5]:
    print(round(s[0]-t0, 3), s[2], s[1] // MIB, (s[3].get("host.grads", 0)) // MIB)
engine.close(keep_values=False)
