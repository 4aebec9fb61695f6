"""Which parameters' updates make the step's tail (the time from the end of backward to the
end of step()), with params + optimizer on NVMe: per measured step, each sub-group's
stage_in start, apply end and stage_out end relative to the end of backward, and what it holds
(parameter names, elements). Bench-only scoping for issue 29.

    PYTHONPATH=$wt python tail_jobs.py --seq 128|512 [--set KEY=JSON ...] --nvme-path DIR
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

wt = Path(os.environ.get("PYTHONPATH", ".").split(":")[0])
sys.path.insert(0, str(wt / "bench"))
import train_worker  # noqa: E402
from train import parse_set  # noqa: E402

from outcore.app.models import resolve_config  # noqa: E402
from outcore.config import merge_mappings  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--set", dest="sets", type=parse_set, action="append", default=[])
    ap.add_argument("--nvme-path", required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    os.makedirs(args.nvme_path, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="tail-", dir=args.nvme_path)
    sets: dict = {}
    for one in args.sets:
        sets = merge_mappings(sets, one)
    spec = {"row": "nvme+opt", "model": "gpt-335m", "nvme_path": folder, "clip": 0.0,
            "prefetch_bytes": None, "dtype": "bf16", "outcore_set": sets}
    engine, _ = train_worker.outcore_engine(spec)
    x, y = train_worker.make_batch(resolve_config("gpt-335m").vocab, 1, args.seq, engine.device)
    step = train_worker.engine_step(engine, x, y)
    opt = engine.sharded_optimizer
    events: list[tuple] = []
    lock = threading.Lock()
    rec = {"on": False}

    def wrap(name: str) -> None:
        orig = getattr(opt, name)

        def timed(work, *a, **k):
            t0 = time.perf_counter()
            try:
                return orig(work, *a, **k)
            finally:
                if rec["on"]:
                    what = [(sl.sp.name, sl.hi - sl.lo) for sl in work.params]
                    with lock:
                        events.append((name, t0, time.perf_counter(), id(work), what))
        setattr(opt, name, timed)

    for n in ("stage_in", "apply", "stage_out"):
        wrap(n)
    sub = opt.pipeline.submit

    def submit(job, grad_bytes, unseen=0):
        t0 = time.perf_counter()
        try:
            return sub(job, grad_bytes, unseen)
        finally:
            if rec["on"]:
                with lock:
                    events.append(("submit", t0, time.perf_counter(), id(job), grad_bytes))
    opt.pipeline.submit = submit
    for _ in range(args.warmup):
        step()
    steps = []
    for _ in range(args.steps):
        events.clear()
        rec["on"] = True
        start = train_worker.now()
        _, fwd_end, bwd_end = step()
        end = train_worker.now()
        rec["on"] = False
        steps.append({"start": start, "fwd_end": fwd_end, "bwd_end": bwd_end, "end": end,
                      "events": list(events)})
    engine.close(keep_values=False)
    # summary
    out = []
    for s in steps:
        b = s["bwd_end"]
        tail_elems: dict[str, int] = {}
        emb_last = None
        for kind, t0, t1, _, what in s["events"]:
            if kind == "stage_in" and t0 >= b - 1e-4:
                for name, n in what:
                    tail_elems[name] = tail_elems.get(name, 0) + n
            if kind == "stage_out" and any("tok_emb" in n for n, _ in what):
                emb_last = t1 - b
        subs = [(t0 - b, g) for kind, t0, t1, _, g in s["events"] if kind == "submit"]
        row = {"fwd": s["fwd_end"] - s["start"], "bwd": b - s["fwd_end"], "tail": s["end"] - b,
               "tail_stage_in_elems": tail_elems,
               "emb_stage_out_end_after_bwd": emb_last,
               "last_submit_after_bwd_start": max(t for t, _ in subs) + (b - s["fwd_end"])
               if subs else None,
               "events": [(k, t0 - b, t1 - b, w) for k, t0, t1, _, w in s["events"]
                          if k != "submit"]}
        out.append(row)
        te = sum(tail_elems.values())
        emb = sum(n for k, n in tail_elems.items() if "tok_emb" in k)
        print(f"fwd {row['fwd']:.2f} bwd {row['bwd']:.2f} tail {row['tail']:.2f} s; "
              f"sub-groups begun in the tail hold {te / 1e6:.1f}M elems, "
              f"embedding {emb / 1e6:.1f}M;"
              f" its last write issued {emb_last if emb_last is None else round(emb_last, 3)} s "
              f"after backward; names in tail: {sorted(tail_elems)[:8]}...")
    args.out.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
