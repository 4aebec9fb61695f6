"""Training throughput of outcore against plain PyTorch and DeepSpeed ZeRO-3, side by side.

One run prints one table. Every row trains the same GPT preset on the same fixed random token
batch (AdamW, seed 0) in a fresh subprocess (bench/train_worker.py), so each row's peak RSS is
its own (taken from ``wait4``'s rusage, what ``/usr/bin/time -v`` reports). The compute dtype
is ``--dtype`` resolved once for this machine (``auto``: bf16 where the CPU multiplies it
natively, else fp32) and the same for every row, DeepSpeed's included; ``--compute-threads N``
caps torch's threads in every row (the accelerator regime, emulated: compute keeps N cores,
outcore's I/O threads the rest). The results JSON carries the machine (``machine_info``: CPU
model, avx512_bf16/amx, cores, torch, dtype, threads, date). Rows:

    plain        plain PyTorch in memory: parameters in the compute dtype, fused AdamW
    plain-master plain PyTorch doing outcore's 16-bit arithmetic: 16-bit model, fp32 master
                 weights and moments, fused AdamW on the masters, cast back (bf16/fp16 only)
    none         outcore without offload (fp32 master weights and moments, compute copy)
    cpu-p0, cpu                 params on host, prefetch off / on
    nvme-p0, nvme               params on NVMe, prefetch off / on (optimizer in memory: the
                                trainable copies are cast from the masters, so these rows
                                move no bytes; storage.py's CastShard)
    nvme+opt-p0, nvme+opt       params and optimizer state on NVMe, prefetch off / on
    nvme+opt-reuse              nvme+opt with ``offload.reuse_freed_memory: true``
    nvme+opt-return             nvme+opt with ``offload.reuse_freed_memory: false`` (large
                                frees given back whatever the host's room)
    nvme+opt-wait               nvme+opt with ``zero.speculative_step: false`` (with
                                ``--clip``, every update waits for the step)
    nvme+opt-early              nvme+opt with ``zero.overlap_step_with_forward: true`` (the
                                step returns before its last updates; the forward follows them)
    nvme+opt-lean               nvme+opt with the smallest footprint: freed memory given
                                back, 64 MiB of host buffers and of prefetch
    nvme+opt-small              nvme+opt-lean's 64 MiB buffers with freed memory kept
                                for reuse where the host has room (the default policy)
    nvme+opt-act, nvme+opt-lean-act   nvme+opt and nvme+opt-lean with every block's saved
                                tensors on NVMe (``outcore.offload_activations``)
    deepspeed    DeepSpeed ZeRO-3, params and optimizer on NVMe (bench/ds_contender.py, run in
                 DeepSpeed's own venv; skipped if that venv is missing)

Columns: median step time after warm-up, tokens/s, ratio to plain PyTorch, peak RSS, bytes
read/written per step (outcore's NVMe store counters; /proc/<pid>/io for DeepSpeed), the
floor ``max(compute, read/read_bw + written/write_bw)`` with the bandwidths from
``outcore.sizing.probe.measure()`` on the swap folder and compute = the ``none`` row's step time,
CPU seconds per step and per GB moved (bench/train_report.py), and step time / floor
(``--probe-each-row``: the bandwidths measured right after that row, as the disk's speed
drifts during a run). Then a sweep of tokens per step for ``nvme+opt``
(or each of ``--sweep-rows``) against ``none`` and a plot of efficiency against tokens per
step, measured and predicted by the paper's formula (bench/out/efficiency.png).

    python bench/train.py --quick                       # tiny model, checks the script works
    python bench/train.py                               # gpt-335m, batch 1 x seq 512, sweep
    python bench/train.py --rows none,nvme+opt --no-sweep --steps 4
    python bench/train.py --rows none --sweep-rows nvme+opt,nvme+opt-reuse
    python bench/train.py --compute-threads 1 --rows plain,none,nvme,nvme+opt
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import train_report
import train_worker
from train_report import OUT, ROWS, Row, machine_line, report

REPO = Path(__file__).resolve().parents[1]
DS_VENV = Path(os.environ.get("DS_VENV", "~/.cache/outcore-peers/ds-venv")).expanduser()
HP = train_worker.HP


def run_child(cmd: list[str], log: Path, timeout: float,
              env: dict | None = None) -> tuple[dict, str]:
    """Run ``cmd``; return (its RESULT json plus peak RSS from wait4, error text or "")."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        start = time.monotonic()
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - start > timeout:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.2)
        proc.returncode = os.waitstatus_to_exitcode(status)
    text = log.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(text.splitlines()[-15:])
        return {}, f"exit {proc.returncode} after {time.monotonic() - start:.0f}s:\n{tail}"
    res = json.loads(lines[-1][len("RESULT "):])
    res["peak_rss"] = usage.ru_maxrss * 1024  # kB on Linux
    res["wall_s"] = round(time.monotonic() - start, 1)
    return res, ""


def wait_quiet(max_wait: float, busy_max: float = 0.15, disk_max: float = 50.0,
               window: float = 5.0) -> str:
    """Wait until other work leaves the CPU and disk mostly idle (at most ``max_wait`` s)."""
    def busy() -> tuple[int, int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        sectors = 0
        with open("/proc/diskstats") as f:
            for line in f:
                d = line.split()
                whole = (d[2].startswith(("vd", "sd")) and not d[2][-1].isdigit()
                         or d[2].startswith("nvme") and "p" not in d[2][4:])
                if whole:  # whole disks only, not their partitions
                    sectors += int(d[5]) + int(d[9])
        return sum(v), sum(v) - v[3] - v[4], sectors

    start = time.monotonic()
    while True:
        a = busy()
        time.sleep(window)
        b = busy()
        share = (b[1] - a[1]) / max(1, b[0] - a[0])
        disk = (b[2] - a[2]) * 512 / window / 1e6
        waited = time.monotonic() - start
        if (share < busy_max and disk < disk_max) or waited >= max_wait:
            return f"cpu busy {share:.2f}, disk {disk:.0f} MB/s after {waited:.0f}s wait"


def run_row(row: Row, args, nvme_root: Path, logs: Path) -> Row:
    """Run one row; rerun it (after waiting for quiet) if other processes took much CPU."""
    best: dict = {}
    for attempt in range(args.retries + 1):
        quiet = wait_quiet(args.wait_quiet) if args.wait_quiet > 0 else ""
        _run_row_once(row, args, nvme_root, logs, quiet)
        if row.result and (not best or row.result["other_cpu"] < best["other_cpu"]):
            best = row.result
        if row.error or row.result["other_cpu"] <= args.max_other_cpu:
            break
        if attempt < args.retries:
            print(f"  other processes used {row.result['other_cpu']:.2f} of the CPU: rerunning",
                  flush=True)
    if best:  # the attempt other processes disturbed least
        row.result, row.error = best, ""
    return row


def _run_row_once(row: Row, args, nvme_root: Path, logs: Path, quiet: str) -> None:
    folder = Path(tempfile.mkdtemp(prefix=f"{row.name}-", dir=nvme_root))
    spec = {"row": row.name, "model": args.model, "batch": row.batch, "seq": row.seq,
            "steps": args.steps, "warmup": args.warmup, "clip": args.clip,
            "nvme_path": str(folder), "prefetch_bytes": args.prefetch_bytes,
            "outcore_set": args.outcore_set, "dtype": args.dtype_resolved,
            "compute_threads": args.compute_threads}
    log = logs / f"{row.name}-{row.tokens}.log"
    if row.name == "deepspeed":
        cmd = [str(DS_VENV / "bin" / "python"), str(REPO / "bench" / "ds_contender.py"),
               "--spec", json.dumps({**spec, "hp": HP})]
        env = {**os.environ, "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    else:
        if args.profile and row.name == args.profile:
            spec["profile"] = str(OUT / f"profile-{row.name}-{row.tokens}.pstats")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
        env = None
    print(f"[{time.strftime('%H:%M:%S')}] {row.name} at {row.batch}x{row.seq} ({quiet}) ...",
          end=" ", flush=True)
    try:
        row.result, row.error = run_child(cmd, log, args.row_timeout, env)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if row.error:
        print(f"FAILED (log {log})\n{row.error}", flush=True)
    else:
        r = row.result
        print(f"{r['step_s']:.2f} s/step, peak RSS {r['peak_rss'] / 2**30:.2f} GiB, "
              f"other CPU {r['other_cpu']:.2f}", flush=True)
    if row.result and args.probe_each_row and ("nvme" in row.name or row.name == "deepspeed"):
        # the disk's speed drifts by +-20% over a run here: price each row's bytes at the
        # rates measured right after it (see the module docstring)
        pr = row.result["probe"] = probe(args, nvme_root, logs)
        print(f"  disk after the row: read {pr['disk_read_GBps']:.2f} GB/s, write "
              f"{pr['disk_write_GBps']:.2f} GB/s", flush=True)


def probe(args, nvme_root: Path, logs: Path) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="probe-", dir=nvme_root))
    # the matmul peak on the threads every row computes on (--compute-threads)
    spec = {"row": "probe", "nvme_path": str(folder), "compute_threads": args.compute_threads}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    try:
        res, err = run_child(cmd, logs / "probe.log", 600)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if err:
        raise SystemExit(f"probe failed: {err}")
    return res


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores, {mem:.0f} GiB RAM"


def resolve_dtype(name: str) -> str:
    """``--dtype`` as every row will train: ``auto`` resolved for this machine's CPU."""
    from outcore.device.compute_dtype import planned

    return planned(name).name


def parse_sweep(text: str) -> list[tuple[int, int]]:
    """``"1x128,1x256,4x512"`` -> [(1, 128), (1, 256), (4, 512)]."""
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]


def parse_set(text: str) -> dict:
    """``"zero.overlap_optimizer=false"`` -> ``{"zero": {"overlap_optimizer": False}}``."""
    key, _, value = text.partition("=")
    out: dict = json.loads(value)
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="gpt-335m", help="outcore.app.models preset")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6, help="steps per row, warm-up included")
    ap.add_argument("--warmup", type=int, default=2, help="steps not measured")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"subset of {','.join(ROWS)}")
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--sweep-points", type=parse_sweep,
                    default=parse_sweep("1x128,1x256,1x512,2x512,4x512"),
                    help="batch x seq points of the sweep (each of --sweep-rows)")
    ap.add_argument("--sweep-rows", default="nvme+opt",
                    help="offload rows swept against no offload (comma-separated)")
    ap.add_argument("--clip", type=float, default=0.0, help="gradient clipping, every row")
    ap.add_argument("--prefetch-bytes", type=int, default=None,
                    help="budget of the prefetch-on rows (default: outcore's default)")
    ap.add_argument("--set", dest="outcore_set", type=parse_set, action="append", default=[],
                    metavar="KEY=JSON", help="outcore config override for every outcore row, "
                    "e.g. --set zero.overlap_optimizer=false (repeatable)")
    ap.add_argument("--nvme-path", type=Path, default=OUT / "swap")
    ap.add_argument("--row-timeout", type=float, default=1800)
    ap.add_argument("--wait-quiet", type=float, default=120,
                    help="before each row, wait up to this many seconds for an idle CPU (0: no)")
    ap.add_argument("--max-other-cpu", type=float, default=0.2,
                    help="rerun a row if other processes used more of the CPU than this")
    ap.add_argument("--retries", type=int, default=1, help="reruns of a noisy row")
    ap.add_argument("--probe-each-row", action="store_true",
                    help="probe the disk again after each row that uses it and use that for "
                         "the row's floor")
    ap.add_argument("--profile", default="", help="cProfile this row's measured steps")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                    help="compute dtype of every row (default: auto, resolved for this CPU)")
    ap.add_argument("--compute-threads", type=int, default=None,
                    help="torch threads for compute in every row (default: all cores)")
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 steps, small sweep")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                    help="no run: print the tables and plot of a run's results JSON, with rows "
                         "of later JSONs (reruns of noisy rows) replacing the same rows when "
                         "other processes disturbed them less")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    sets, args.outcore_set = args.outcore_set, {}
    if sets:  # importing outcore costs seconds; --merge and most workers need none of it
        from outcore.config import merge_mappings

        for one in sets:
            args.outcore_set = merge_mappings(args.outcore_set, one)
    if args.worker:
        train_worker.worker(json.loads(args.worker))
        return 0
    if args.merge:
        return train_report.merge_report(args.merge)
    if args.quick:
        args.model, args.batch, args.seq, args.steps, args.warmup = "tiny", 2, 64, 2, 1
        args.sweep_points = [(1, 64), (2, 64)]
        args.wait_quiet, args.retries = 0, 0
    rows = [r for r in args.rows.split(",") if r]
    sweep_rows = [r for r in args.sweep_rows.split(",") if r]
    unknown = set(rows + sweep_rows) - set(ROWS)
    if unknown:
        ap.error(f"unknown rows {sorted(unknown)}; choose from {','.join(ROWS)}")
    if "none" in sweep_rows:
        ap.error("--sweep-rows: 'none' is what each sweep row is compared against")
    if "deepspeed" in rows + sweep_rows and not (DS_VENV / "bin" / "python").exists():
        print(f"DeepSpeed venv {DS_VENV} not found: skipping the deepspeed row")
        rows = [r for r in rows if r != "deepspeed"]
        sweep_rows = [r for r in sweep_rows if r != "deepspeed"]

    from outcore.app.models import num_params, resolve_config
    from outcore.device.machine import describe

    args.dtype_resolved = resolve_dtype(args.dtype)
    if args.dtype_resolved == "fp32" and "plain-master" in rows:
        print("plain-master: skipped in fp32 (its masters would be the parameters themselves)")
        rows = [r for r in rows if r != "plain-master"]
    info = {**describe(args.dtype_resolved), "compute_threads": args.compute_threads}
    n_params = num_params(resolve_config(args.model))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = OUT / "logs" / stamp
    logs.mkdir(parents=True, exist_ok=True)
    nvme_root = args.nvme_path.resolve()
    made_root = not nvme_root.exists()  # removed at the end only if this run made it
    nvme_root.mkdir(parents=True, exist_ok=True)
    disk = subprocess.run(["df", "-h", "--output=source,fstype,size", str(nvme_root)],
                          capture_output=True, text=True).stdout.split("\n")[1].split()
    print(f"machine: {machine_line(info)}; dtype {args.dtype_resolved}")
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {machine()}; swap folder {nvme_root} "
          f"({' '.join(disk)}); load average {os.getloadavg()[0]:.2f}")
    print(f"model {args.model} ({n_params / 1e6:.0f}M params), batch {args.batch} x seq "
          f"{args.seq} = {args.batch * args.seq} tokens/step, {args.steps} steps "
          f"({args.warmup} warm-up), clip {args.clip}, outcore overrides {args.outcore_set or '-'}"
          f", logs in {logs}", flush=True)

    if args.wait_quiet > 0:
        print(f"probe: {wait_quiet(args.wait_quiet)}", flush=True)
    pr = probe(args, nvme_root, logs)
    print(f"probe on {nvme_root}: read {pr['disk_read_GBps']:.2f} GB/s, write "
          f"{pr['disk_write_GBps']:.2f} GB/s (O_DIRECT {pr['direct_io']}), host copy "
          f"{pr['host_copy_GBps']:.1f} GB/s, bf16 matmul {pr['matmul_bf16_TFLOPs']:.2f} "
          f"TFLOP/s, fp32 {pr['matmul_fp32_TFLOPs']:.2f}", flush=True)
    if args.compute_threads:
        print(f"every row computes on {args.compute_threads} torch thread(s) of "
              f"{info['cores']} cores", flush=True)

    main_rows = [run_row(Row(name, args.batch, args.seq), args, nvme_root, logs) for name in rows]
    pairs: list[tuple[Row, Row]] = []
    if args.sweep:
        done = {(r.name, r.batch, r.seq): r for r in main_rows}
        for b, s in args.sweep_points:
            ref = done.get(("none", b, s)) or run_row(Row("none", b, s), args, nvme_root, logs)
            done[("none", b, s)] = ref
            for name in sweep_rows:
                off = done.get((name, b, s)) or run_row(Row(name, b, s), args, nvme_root, logs)
                pairs.append((ref, off))
    if made_root and not any(nvme_root.iterdir()):
        nvme_root.rmdir()  # every row's private folder is already gone

    points = report(main_rows, pairs, pr, args.model, args.warmup, args.steps,
                    args.dtype_resolved, machine_line(info))
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "probe": pr,
              "rows": [vars(r) for r in main_rows], "sweep": points,
              "sweep_rows": [[vars(a), vars(b)] for a, b in pairs], "machine": machine(),
              "machine_info": info,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    (OUT / f"train-{stamp}.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"results: {OUT / f'train-{stamp}.json'}")
    return 0 if all(r.result for r in main_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
