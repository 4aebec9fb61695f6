"""Scale demonstration: a model whose states are twice this machine's RAM, trained on NVMe.

Builds a GPT preset under ``outcore.init`` with parameters and optimizer state on NVMe (``--dtype``,
default auto; fp32 master), trains a few steps, and reports peak RSS, seconds per step, bytes
moved per step and step time / floor, where the floor is the disk time of those bytes at the
bandwidths ``outcore probe`` measures (or the compute estimate, if larger).

    .venv/bin/python bench/scale.py --model gpt-3b --steps 3 --nvme-path bench/out/swap

Run by hand; results go to bench/RESULTS.md. Needs ~16 bytes per parameter free on the disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

import outcore
from outcore.app.models import PRESETS, build_model, num_params
from outcore.device.machine import describe


class PeakRSS:
    """Polls this process's RSS in a thread; ``ru_maxrss`` alone misses nothing but is coarse
    to report per phase, so both are kept."""

    def __init__(self, every: float = 0.05) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._proc = psutil.Process()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(every)

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _page_cache() -> int:
    """Bytes of file pages the kernel caches now: swap traffic through O_DIRECT adds none."""
    return psutil.virtual_memory().cached


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-3b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, help="a GPT of this depth instead of a preset "
                    "(with --hidden; heads = hidden / 128, vocab 32000): e.g. 48 x 2816, "
                    "4.66B parameters, the largest whose states fit ~75 GB of free disk")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--nvme-path", default="bench/out/swap")
    ap.add_argument("--host-buffer-mib", type=int, default=256)
    ap.add_argument("--prefetch-mib", type=int, default=256)
    ap.add_argument("--probe", help="JSON from `outcore probe --json` (else measured now)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                    help="compute dtype (default: auto, the fastest this machine has)")
    args = ap.parse_args(argv)

    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    if args.probe:
        probe = json.loads(Path(args.probe).read_text())
    else:
        from outcore.sizing.probe import measure

        probe = measure(args.nvme_path).to_json()
    gpt = PRESETS[args.model]
    if args.layers is not None:
        gpt = dataclasses.replace(gpt, layers=args.layers, hidden=args.hidden,
                                  heads=args.hidden // 128)
        args.model = f"gpt-{args.layers}x{args.hidden}"
    n = num_params(gpt)
    cfg = outcore.Config.from_dict({
        "dtype": args.dtype, "optimizer": {"lr": 1e-4, "betas": [0.9, 0.95]},
        "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": args.nvme_path,
                    "host_buffer_bytes": args.host_buffer_mib << 20},
        "zero": {"prefetch_bytes": args.prefetch_mib << 20},
    })
    print(f"{args.model}: {n / 1e9:.2f}B parameters, model states {16 * n / 1e9:.1f} GB "
          f"(16 B/param), RAM {psutil.virtual_memory().total / 2**30:.0f} GiB", flush=True)
    cache0 = _page_cache()
    rss = PeakRSS()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with outcore.init(cfg):
        model = build_model(gpt)
    engine = outcore.initialize(model, cfg)
    build_s = time.perf_counter() - t0
    dtype = engine.dtype_choice.name
    machine = describe(dtype)
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, features "
          f"{machine['cpu_features']}; dtype {engine.dtype_choice}", flush=True)
    store = engine.rt.nvme
    print(f"built under outcore.init in {build_s:.0f} s; swap file {store.file_bytes / 1e9:.1f} GB,"
          f" peak RSS so far {rss.peak / 2**30:.2f} GiB", flush=True)
    peak = probe.get(f"matmul_{dtype}_TFLOPs", probe["matmul_bf16_TFLOPs"])  # older probes
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, gpt.vocab, (args.batch, args.seq + 1), generator=gen)
    rows = []
    for step in range(args.steps):
        r0, w0 = store.bytes_read, store.bytes_written
        t = time.perf_counter()
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        engine.step()
        dt = time.perf_counter() - t
        read, wrote = store.bytes_read - r0, store.bytes_written - w0
        io_s = read / (probe["disk_read_GBps"] * 1e9) + wrote / (probe["disk_write_GBps"] * 1e9)
        compute_s = 8 * n * args.batch * args.seq / (peak * 1e12)
        floor = max(io_s, compute_s)
        rows.append({"step": step, "loss": loss.item(), "seconds": dt, "read_GB": read / 1e9,
                     "written_GB": wrote / 1e9, "floor_s": floor, "ratio": dt / floor})
        print(f"step {step}: loss {loss.item():.4f}  {dt:.1f} s  read {read / 1e9:.1f} GB  "
              f"wrote {wrote / 1e9:.1f} GB  floor {floor:.1f} s  step/floor {dt / floor:.2f}  "
              f"peak RSS {rss.peak / 2**30:.2f} GiB", flush=True)
    report = engine.memory_report()
    cache_growth = _page_cache() - cache0
    direct = store.direct
    engine.close(keep_values=False)  # no hand-back: it would count in the peak RSS
    peak = rss.close()
    result = {"model": args.model, "params": n, "model_state_GB": 16 * n / 1e9,
              "build_s": build_s, "steps": rows, "peak_rss_GiB": peak / 2**30,
              "peak_rss_over_model_states": peak / (16 * n),
              "page_cache_growth_GiB": cache_growth / 2**30, "o_direct": direct,
              "schedule": report["schedule"], "probe": probe, "machine": machine,
              "command": " ".join([sys.executable, *sys.argv])}
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
