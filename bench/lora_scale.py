"""LoRA over a large base read in place: ``outcore train --model FOLDER --lora SPEC`` as a user
runs it, watched from outside.

    python bench/make_llama.py --size 13b --out /work/llama-13b
    python bench/lora_scale.py --model /work/llama-13b --steps 4

What it records (JSON under ``bench/out/``, a summary on stdout):

- the disk's O_DIRECT read rate, measured first on the base's own files (8 threads x 4 MiB,
  the first ``--probe-gb`` GB), and the step floor: base bytes x 2 passes (forward, and the
  backward's second gather) / that rate;
- per step, from ``metrics.jsonl`` as it is written: step time, tokens/s, loss, and the bytes
  the process read from storage during the step (``/proc/PID/io`` ``read_bytes``);
- start-up: from launch to the start of the first step (its record's time minus its step time);
- peak RSS of the process (``wait4``'s ``ru_maxrss``: anonymous and file-backed pages alike)
  and the RSS polled every 0.2 s beside the steps;
- the most disk space outcore's files took at any moment (``--out``, the swap folder inside
  it included), polled every second, and what is left at the end;
- ``outcore estimate``'s prediction for the same model, for comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from outcore.offload.aio import AioEngine  # noqa: E402
from outcore.offload.buffers import aligned_empty  # noqa: E402


def probe_disk(folder: Path, gigabytes: float) -> float:
    """GB/s of O_DIRECT reads of the folder's own files: 4 MiB blocks, eight in flight at
    every moment (what training's reads keep queued), the first ``gigabytes`` GB."""
    block, want = 4 << 20, int(gigabytes * 1e9)
    jobs = []
    for f in sorted(folder.glob("*.safetensors")):
        jobs += [(f, off) for off in range(0, os.path.getsize(f) // block * block, block)]
    jobs = jobs[: max(want // block, 1)]
    bufs = [aligned_empty(block) for _ in range(8)]
    fds = {f: os.open(f, os.O_RDONLY | os.O_DIRECT) for f in {f for f, _ in jobs}}
    done, t0 = 0, time.perf_counter()
    try:
        with AioEngine(threads=8, block_bytes=block) as engine:
            inflight: list = []
            for i, (f, off) in enumerate(jobs):
                if len(inflight) == 8:
                    done += inflight.pop(0).result()
                inflight.append(engine.pread(fds[f], bufs[i % 8], off))
            done += sum(fu.result() for fu in inflight)
    finally:
        for fd in fds.values():
            os.close(fd)
    return done / (time.perf_counter() - t0) / 1e9


def disk_used(path: Path) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(root, n)).st_blocks * 512
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--lora", default="r=16,alpha=32,targets=q_proj,v_proj")
    ap.add_argument("--out", type=Path, default=Path("/work/lora-scale-run"))
    ap.add_argument("--probe-gb", type=float, default=8.0)
    ap.add_argument("extra", nargs="*", help="more outcore train arguments (after --)")
    a = ap.parse_args()
    base_bytes = sum(f.stat().st_size for f in a.model.glob("*.safetensors"))
    rate = probe_disk(a.model, a.probe_gb)
    floor = base_bytes * 2 / (max(rate, 1e-6) * 1e9)  # a file under 4 MiB: no probe
    print(f"base {base_bytes / 1e9:.1f} GB, disk {rate:.2f} GB/s, floor {floor:.1f} s/step",
          flush=True)
    est = subprocess.run([sys.executable, "-m", "outcore", "estimate", "--model", str(a.model),
                          "--seq", str(a.seq), "--batch", str(a.batch), "--json"],
                         capture_output=True, text=True)
    if a.out.exists():
        subprocess.run(["rm", "-rf", str(a.out)], check=True)
    cmd = [sys.executable, "-m", "outcore", "train", "--model", str(a.model), "--lora", a.lora,
           "--steps", str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq),
           "--out", str(a.out), *a.extra]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    ps = psutil.Process(proc.pid)
    samples: dict[str, list] = {"rss": [], "disk": [], "io": [], "busy_ms": []}
    stop = threading.Event()

    def poll() -> None:
        last_disk = 0.0
        while not stop.is_set():
            now = time.time() - t0
            try:
                samples["rss"].append((now, ps.memory_info().rss))
                samples["io"].append((now, ps.io_counters().read_bytes))
            except psutil.Error:
                pass
            samples["busy_ms"].append((now, disk_busy_ms(a.out)))
            if now - last_disk >= 1.0:
                samples["disk"].append((now, disk_used(a.out) if a.out.exists() else 0))
                last_disk = now
            time.sleep(0.2)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    log = []
    assert proc.stderr is not None
    for line in proc.stderr:
        log.append(line)
        sys.stderr.write(line)
    _, status, usage = os.wait4(proc.pid, 0)
    stop.set()
    watcher.join()
    wall = time.time() - t0
    metrics = [json.loads(x) for x in (a.out / "metrics.jsonl").read_text().splitlines()] \
        if (a.out / "metrics.jsonl").exists() else []
    mtime = (a.out / "metrics.jsonl").stat().st_mtime if metrics else t0
    steps = [m for m in metrics if "step" in m]
    step_s = [a.batch * a.seq / m["tokens_per_s"] for m in steps]
    # the elapsed clock of the run starts at the first step: its start is the file's last
    # write minus the training time, which tells start-up apart from steps
    startup = mtime - t0 - steps[-1]["elapsed_s"] if steps else None
    io = samples["io"]
    read_total = io[-1][1] - io[0][1] if io else 0
    ends = [startup or 0.0]
    for s in step_s:
        ends.append(ends[-1] + s)

    def read_at(t: float) -> int:
        return min(io, key=lambda x: abs(x[0] - t))[1] if io else 0

    per_step = [read_at(b) - read_at(a) for a, b in zip(ends, ends[1:], strict=False)]
    busy = samples["busy_ms"]

    def busy_at(t: float) -> int:
        return min(busy, key=lambda x: abs(x[0] - t))[1] if busy else 0

    disk_busy = [(busy_at(b) - busy_at(a)) / 1000 / (b - a)
                 for a, b in zip(ends, ends[1:], strict=False)]
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": platform.processor() or _cpu_name(), "torch": torch.__version__,
        "command": " ".join(cmd), "exit": os.waitstatus_to_exitcode(status),
        "base_bytes": base_bytes, "disk_GBps": rate, "floor_s": floor,
        "step_s": step_s, "tokens_per_s": [m["tokens_per_s"] for m in steps],
        "loss": [m["loss"] for m in steps], "startup_s": startup, "wall_s": wall,
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "polled_peak_rss_bytes": max((r for _, r in samples["rss"]), default=0),
        "read_bytes_total": read_total,
        "read_bytes_per_step": per_step,
        "disk_busy_in_step": disk_busy,
        "read_GBps_in_step": [b / d / 1e9 for b, d in zip(per_step, step_s, strict=True)],
        "peak_disk_bytes": max((d for _, d in samples["disk"]), default=0),
        "final_disk_bytes": disk_used(a.out) if a.out.exists() else 0,
        "estimate": json.loads(est.stdout) if est.returncode == 0 else est.stderr[-2000:],
        "samples": samples, "log_tail": "".join(log[-40:]),
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = REPO / "bench" / "out" / f"lora-scale-{a.model.name}-{stamp}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    mid = sorted(step_s[1:] or step_s)
    med = mid[len(mid) // 2] if mid else float("nan")
    print(f"\n{a.model.name}: exit {result['exit']}; start-up {startup or float('nan'):.0f} s; "
          f"step {med:.1f} s median after the first ({a.batch * a.seq / med:.1f} tokens/s), "
          f"{med / floor:.2f}x the floor; read {per_step[-1] / 1e9 if per_step else 0:.1f} GB "
          f"in the last step at {result['read_GBps_in_step'][-1] if steps else 0:.2f} GB/s, "
          f"the disk busy {disk_busy[-1] if disk_busy else 0:.0%} of it; "
          f"loss {result['loss']}; peak RSS "
          f"{result['peak_rss_bytes'] / 2**30:.2f} GiB; read {read_total / 1e9:.1f} GB in all; "
          f"peak disk by outcore {result['peak_disk_bytes'] / 1e9:.3f} GB, final "
          f"{result['final_disk_bytes'] / 1e9:.3f} GB\n-> {out}")


def disk_busy_ms(path: Path) -> int:
    """Milliseconds the disk under ``path`` had I/O in flight (``io_ticks``, sysfs)."""
    try:
        dev = os.stat(path if path.exists() else path.parent).st_dev
        major, minor = os.major(dev), os.minor(dev)
        block = Path(f"/sys/dev/block/{major}:{minor}").resolve()
        stat = block / "stat" if (block / "stat").exists() else block.parent / "stat"
        return int(stat.read_text().split()[9])
    except (OSError, IndexError, ValueError):
        return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
