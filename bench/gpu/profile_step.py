"""Where a GPU step's time goes, variant by variant: torch's profiler over a few steps each.

On the H100 (bench/gpu/2026-11-26-h100/README.md) outcore without offload took 0.189 s per
step where plain PyTorch took 0.139 (gpt-1.3b, 4 x 2048 tokens), the backward 0.058 s longer.
This script tells the parts apart in one device call. Each variant runs in its own process:
its warm-up steps, then ``--steps`` steps under ``torch.profiler`` (CPU and CUDA activities,
every thread). Per variant it writes ``profile-<variant>.txt`` (``+`` written ``-``: the device
tool brings back only names of letters, digits, ``.``, ``_`` and ``-``; the top operators by device
and by CPU self time) and one summary JSON line: step time, kernel time per step, kernel
launches per step, and the time inside outcore's ranges (``outcore::*``).

Variants: ``plain`` (bf16 model, fused AdamW on bf16), ``plain-master`` (fp32 masters and
moments, as outcore keeps them), ``none`` (outcore, no offload), ``none-serial`` (the same with
``zero.overlap_optimizer: false``: updates after backward, not during it), ``cpu+opt``
(parameters and optimizer state in host memory: the host AdamW and the copies beside the GPU).

    python3 bench/gpu/profile_step.py --out $OUT          # on the GPU machine
    .venv/bin/python bench/gpu/profile_step.py --model tiny --batch 2 --seq 64 --out bench/out/prof
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import train  # noqa: E402  (bench/ on the path: its run_child runs each variant)
import train_worker  # noqa: E402

# variant -> None (plain PyTorch) or (bench/train_worker.py's row, its config overrides)
VARIANTS: dict[str, tuple[str, dict] | None] = {
    "plain": None, "plain-master": None, "none": ("none", {}),
    "none-serial": ("none", {"zero": {"overlap_optimizer": False}}),
    "cpu+opt": ("cpu+opt", {})}


def _device_us(event) -> float:
    """An event's own device time, under the attribute name of this torch."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def profiled(spec: dict) -> dict:
    """Warm up, then profile ``spec["steps"]`` steps of one variant; the text tables go to
    ``spec["table"]``."""
    import torch
    from torch.profiler import ProfilerActivity

    from outcore.profiling import profile

    engine = None
    variant = VARIANTS[spec["variant"]]
    if variant is None:
        step = train_worker.plain_step({**spec, "row": spec["variant"]})
    else:
        row, overrides = variant
        engine, _ = train_worker.outcore_engine({**spec, "row": row, "outcore_set": overrides})
        x, y = train_worker.make_batch(spec["vocab"], spec["batch"],
                                       spec["seq"], engine.device)
        step = train_worker.engine_step(engine, x, y)
    for _ in range(spec["warmup"]):
        step()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()  # the profiler's start and its processing at exit left out
        for _ in range(spec["steps"]):
            step()
        wall = (time.perf_counter() - t0) / spec["steps"]
    if engine is not None:
        engine.close(keep_values=False)  # what it created goes; the values are not wanted
    events = prof.key_averages()
    by_device = "self_device_time_total" if cuda else "self_cpu_time_total"
    try:
        device_table = events.table(sort_by=by_device, row_limit=30)
    except (AttributeError, KeyError, ValueError):  # an older torch names it for CUDA
        device_table = events.table(sort_by="self_cuda_time_total", row_limit=30)
    Path(spec["table"]).write_text(
        f"{spec['variant']}: {wall:.4f} s per profiled step\n\nby device time\n{device_table}"
        f"\n\nby CPU time\n{events.table(sort_by='self_cpu_time_total', row_limit=30)}\n")
    n = spec["steps"]
    # the kernels themselves: a CPU operator also reports the device time of what it launched
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return {
        "variant": spec["variant"], "step_s": wall,
        "kernel_ms_per_step": sum(_device_us(e) for e in kernels) / 1e3 / n,
        "launches_per_step": sum(e.count for e in events if "LaunchKernel" in e.key) / n,
        "cpu_ops_per_step": sum(e.count for e in events if e.key.startswith("aten::")) / n,
        "outcore_ranges_ms_per_step": {e.key: round(e.cpu_time_total / 1e3 / n, 2)
                                       for e in events if e.key.startswith("outcore::")},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="gpt-1.3b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="profiled steps per variant")
    ap.add_argument("--timeout", type=float, default=120, help="seconds per variant")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "gpu-profile")
    args = ap.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(profiled(json.loads(args.worker))), flush=True)
        return 0
    from outcore.app.models import resolve_config

    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {','.join(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for variant in args.variants.split(","):
        name = variant.replace("+", "-")  # a file name the device tool brings back
        spec = {"variant": variant, "model": args.model, "batch": args.batch, "seq": args.seq,
                "vocab": resolve_config(args.model).vocab, "warmup": args.warmup,
                "steps": args.steps, "dtype": "bf16", "clip": 0.0, "prefetch_bytes": None,
                "nvme_path": str(args.out), "table": str(args.out / f"profile-{name}.txt")}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
        res, err = train.run_child(cmd, args.out / f"profile-{name}.log", args.timeout)
        results.append(res or {"variant": variant, "error": err.splitlines()[0]})
        print(json.dumps(results[-1]), flush=True)
    (args.out / "profile-summary.json").write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
