"""One huge linear layer trained with and without memory-centric tiling; peak working memory.

    .venv/bin/python bench/tiling.py --hidden 16384 --splits 4 --steps 2 --swap /tmp/oc-swap

Everything lives on NVMe (parameters and optimizer states), so the engine's device tier holds
only gathered parameters: its ledger peak is the peak working memory of the layer. Each
configuration runs in a fresh process so that peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time

import psutil
import torch
from torch import nn

import outcore
from outcore.device.compute_dtype import planned
from outcore.device.machine import describe
from outcore.memory.tiling import TiledLinear, tile_linears

MiB = 2**20


class Layer(nn.Module):
    def __init__(self, hidden: int, splits: int = 1) -> None:
        super().__init__()
        self.fc = (TiledLinear(hidden, hidden, in_splits=splits, out_splits=splits)
                   if splits > 1 else nn.Linear(hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).float().square().mean()


def run(a: argparse.Namespace) -> dict:
    torch.set_num_threads(2)
    cfg = outcore.Config.from_dict({
        "dtype": a.dtype, "optimizer": {"lr": 1e-4},
        "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": a.swap},
        "zero": {"prefetch_bytes": a.prefetch_mib * MiB},
    })
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with outcore.init(cfg):  # built tiled: the layer never exists whole, even at init
        model = Layer(a.hidden, a.splits if a.build == "tiled" else 1)
    if a.splits > 1 and a.build == "linear":  # the same weights, re-cut into tiles
        assert tile_linears(model, 1, a.splits, a.splits) == 1
    engine = outcore.initialize(model, cfg)
    build_s = time.perf_counter() - t0
    build_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    proc, sampled, stop = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            sampled[0] = max(sampled[0], proc.memory_info().rss)
            time.sleep(0.005)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    x = torch.randn(a.tokens, a.hidden, generator=torch.Generator().manual_seed(1))
    times, losses = [], []
    for _ in range(a.steps):
        t = time.perf_counter()
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    stop.set()
    watcher.join()
    kinds = engine.memory_report()["by_kind"]
    ahead = engine.schedule_stats()["peak_ahead_bytes"]
    assert {k for k in kinds if k.startswith("device.")} <= {"device.unsharded"}, kinds
    engine.close(keep_values=False)  # no hand-back: it would count in the peak RSS
    return {"splits": a.splits, "build": a.build, "prefetch_mib": a.prefetch_mib,
            "losses": losses,
            "peak_gathered_mib": kinds["peak.device"] / MiB, "peak_ahead_mib": ahead / MiB,
            "step_s": times,
            "build_s": build_s, "rss_build_mib": build_rss / MiB,
            "rss_train_peak_mib": sampled[0] / MiB,
            "rss_lifetime_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=16384)
    p.add_argument("--splits", type=int, default=4, help="tiles per side (splits x splits)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--swap", default="/tmp/outcore-tiling-swap")
    p.add_argument("--prefetch-mib", type=int, default=128)
    p.add_argument("--build", choices=["linear", "tiled"], default="linear",
                   help="build nn.Linear (then tile_linears) or TiledLinear under outcore.init")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="compute dtype (default: auto, the fastest this machine has)")
    p.add_argument("--one", action="store_true", help="run one configuration (internal)")
    a = p.parse_args()
    if a.one:
        print(json.dumps(run(a)))
        return
    rows = []
    n, budget = a.splits, a.prefetch_mib
    for splits, build, prefetch in ((1, "linear", budget), (n, "linear", budget),
                                    (n, "linear", 0), (n, "tiled", budget)):
        cmd = [sys.executable, __file__, "--one", "--hidden", str(a.hidden), "--splits",
               str(splits), "--steps", str(a.steps), "--tokens", str(a.tokens), "--swap",
               a.swap, "--prefetch-mib", str(prefetch), "--build", build, "--dtype", a.dtype]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    dtype = planned(a.dtype).name
    print(f"machine: {json.dumps(describe(dtype))}")
    print("| layer | tiles | built as | prefetch budget | peak gathered | peak prefetched "
          "| peak RSS (train) | peak RSS (run) | s/step | losses |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        built = "TiledLinear" if r["build"] == "tiled" else "Linear" + (
            " + tile_linears" if r["splits"] > 1 else "")
        print(f"| {a.hidden}x{a.hidden} | {r['splits']}x{r['splits']} | {built} "
              f"| {r['prefetch_mib']} MiB "
              f"| {r['peak_gathered_mib']:.1f} MiB | {r['peak_ahead_mib']:.0f} MiB "
              f"| {r['rss_train_peak_mib']:.0f} MiB "
              f"| {r['rss_lifetime_peak_mib']:.0f} MiB | "
              f"{' / '.join(f'{s:.1f}' for s in r['step_s'])} "
              f"| {' / '.join(f'{v:.6f}' for v in r['losses'])} |")


if __name__ == "__main__":
    main()
