"""Training throughput of outcore against plain PyTorch and DeepSpeed ZeRO-3, side by side.

One run prints one table. Every row trains the same GPT preset on the same fixed random token
batch (bf16, AdamW, seed 0) in a fresh subprocess, so each row's peak RSS is its own (taken
from ``wait4``'s rusage, what ``/usr/bin/time -v`` reports). Rows:

    plain        plain PyTorch in memory: pure bf16 parameters, fused AdamW (no fp32 master)
    plain-master plain PyTorch doing outcore's arithmetic: bf16 model, fp32 master weights and
                 moments, fused AdamW on the masters, cast back (prices the fp32 master alone)
    none         outcore without offload (fp32 master weights and moments, bf16 compute copy)
    cpu-p0, cpu                 params on host, prefetch off / on
    nvme-p0, nvme               params on NVMe, prefetch off / on
    nvme+opt-p0, nvme+opt       params and optimizer state on NVMe, prefetch off / on
    nvme+opt-reuse              nvme+opt with ``offload.reuse_freed_memory: true``
    nvme+opt-early              nvme+opt with ``zero.overlap_step_with_forward: true`` (the
                                step returns before its last updates; the forward follows them)
    deepspeed    DeepSpeed ZeRO-3, params and optimizer on NVMe (bench/ds_contender.py, run in
                 DeepSpeed's own venv; skipped if that venv is missing)

Columns: median step time after warm-up, tokens/s, ratio to plain PyTorch, peak RSS, bytes
read/written per step (outcore's NVMe store counters; /proc/<pid>/io for DeepSpeed), the
floor ``max(compute, read/read_bw + written/write_bw)`` with the bandwidths from
``outcore.probe.measure()`` on the swap folder and compute = the ``none`` row's step time,
and step time / floor (``--probe-each-row``: the bandwidths measured right after that row, as
the disk's speed drifts during a run). Then a sweep of tokens per step for ``nvme+opt``
(or each of ``--sweep-rows``) against ``none`` and a plot of efficiency against tokens per
step, measured and predicted by the paper's formula (bench/out/efficiency.png).

    python bench/train.py --quick                       # tiny model, checks the script works
    python bench/train.py                               # gpt-335m, batch 1 x seq 512, sweep
    python bench/train.py --rows none,nvme+opt --no-sweep --steps 4
    python bench/train.py --rows none --sweep-rows nvme+opt,nvme+opt-reuse
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
DS_VENV = Path(os.environ.get("DS_VENV", "~/.cache/outcore-peers/ds-venv")).expanduser()
ROWS = ["plain", "plain-master", "none", "cpu-p0", "cpu", "nvme-p0", "nvme", "nvme+opt-p0",
        "nvme+opt", "nvme+opt-reuse", "nvme+opt-early", "deepspeed"]
PLACEMENT = {  # row -> (offload.params, offload.optimizer, prefetch on)
    "none": ("none", "none", True),
    "cpu-p0": ("cpu", "none", False), "cpu": ("cpu", "none", True),
    "nvme-p0": ("nvme", "none", False), "nvme": ("nvme", "none", True),
    "nvme+opt-p0": ("nvme", "nvme", False), "nvme+opt": ("nvme", "nvme", True),
    "nvme+opt-reuse": ("nvme", "nvme", True), "nvme+opt-early": ("nvme", "nvme", True),
}
# a row's own overrides, applied after --set (so --set cannot turn a row into another)
ROW_SET = {"nvme+opt-reuse": {"offload": {"reuse_freed_memory": True}},
           "nvme+opt-early": {"zero": {"overlap_step_with_forward": True}}}
LABEL = {
    "plain": "plain PyTorch, in memory (bf16 params, fused AdamW)",
    "plain-master": "plain PyTorch, bf16 params + fp32 master copy (outcore's arithmetic)",
    "none": "outcore, no offload",
    "cpu-p0": "outcore, params on host, prefetch off", "cpu": "outcore, params on host",
    "nvme-p0": "outcore, params on NVMe, prefetch off", "nvme": "outcore, params on NVMe",
    "nvme+opt-p0": "outcore, params+optimizer on NVMe, prefetch off",
    "nvme+opt": "outcore, params+optimizer on NVMe",
    "nvme+opt-reuse": "outcore, params+optimizer on NVMe, reuse_freed_memory",
    "nvme+opt-early": "outcore, params+optimizer on NVMe, step returns before its updates",
    "deepspeed": "DeepSpeed ZeRO-3, params+optimizer on NVMe",
}
HP = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}


# ---------------------------------------------------------------------------------------------
# worker side: one row in this (fresh) process
# ---------------------------------------------------------------------------------------------
def _cpu_jiffies() -> tuple[int, int]:
    """(machine busy jiffies, this process's utime+stime jiffies over all its threads)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    with open("/proc/self/stat") as f:
        p = f.read().rsplit(")", 1)[1].split()
    return sum(v) - v[3] - v[4], int(p[11]) + int(p[12])


def _proc_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process caused at the block layer."""
    vals = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            vals[k] = int(v)
    return vals["read_bytes"], vals["write_bytes"]


def timed_steps(step_fn, steps: int, warmup: int, counters=None, profile: str | None = None
                ) -> dict:
    """Run ``step_fn() -> (loss, t_fwd, t_bwd)`` ``steps`` times; medians after ``warmup``.

    ``counters()`` returns (bytes read, bytes written) of the store; sampled around the
    measured steps, as are /proc/self/io and the CPU other processes used meanwhile.
    With ``profile`` (a path), the measured steps run under cProfile and the stats go there.
    """
    import cProfile
    import resource

    prof = cProfile.Profile() if profile else None
    ru0 = None
    hz, ncpu = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    times, phases, losses, others = [], [], [], []
    io0 = store0 = None
    for i in range(steps):
        if i == warmup:
            io0, store0 = _proc_io(), counters() if counters else (0, 0)
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            if prof:
                prof.enable()
        b0, m0 = _cpu_jiffies()
        t0 = time.perf_counter()
        loss, t1, t2 = step_fn()
        t3 = time.perf_counter()
        b1, m1 = _cpu_jiffies()
        times.append(t3 - t0)
        phases.append((t1 - t0, t2 - t1, t3 - t2))
        losses.append(loss)
        others.append(max(0.0, ((b1 - b0) - (m1 - m0)) / hz / ((t3 - t0) * ncpu)))
        print(f"  step {i} loss {loss:.4f} {t3 - t0:.2f}s (fwd {t1 - t0:.2f} bwd {t2 - t1:.2f} "
              f"step {t3 - t2:.2f}) other_cpu {others[-1]:.2f}", file=sys.stderr, flush=True)
    if prof:
        prof.disable()
        prof.dump_stats(profile)
    n = steps - warmup
    io1, store1 = _proc_io(), counters() if counters else (0, 0)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    med = statistics.median
    return {
        "step_s": med(times[warmup:]), "step_times_s": [round(t, 3) for t in times],
        "fwd_s": med(p[0] for p in phases[warmup:]), "bwd_s": med(p[1] for p in phases[warmup:]),
        "opt_s": med(p[2] for p in phases[warmup:]),
        "losses": [round(x, 5) for x in losses],
        "other_cpu": round(statistics.mean(others[warmup:]), 3),
        "proc_read_per_step": (io1[0] - io0[0]) / n, "proc_write_per_step": (io1[1] - io0[1]) / n,
        "store_read_per_step": (store1[0] - store0[0]) / n,
        "store_write_per_step": (store1[1] - store0[1]) / n,
        # CPU seconds of this process (all threads) and minor page faults, per measured step
        "user_s_per_step": (ru1.ru_utime - ru0.ru_utime) / n,
        "sys_s_per_step": (ru1.ru_stime - ru0.ru_stime) / n,
        "minflt_per_step": (ru1.ru_minflt - ru0.ru_minflt) / n,
    }


def _batch(vocab: int, batch: int, seq: int):
    import torch

    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def engine_step(engine, x, y):
    """One timed training step of an engine with the ``engine(x, y)`` / ``backward`` /
    ``step`` API (outcore's and DeepSpeed's): returns (loss, end of forward, end of backward)."""

    def step():
        loss = engine(x, y)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        return float(loss.float()), t1, t2

    return step


def run_plain(spec: dict) -> dict:
    import torch

    from outcore.models import build_model, num_params, resolve_config

    torch.manual_seed(0)
    model = build_model(spec["model"]).to(torch.bfloat16)
    params = list(model.parameters())
    # plain-master keeps fp32 masters beside the bf16 model, as outcore does
    masters = [p.detach().float() for p in params] if spec["row"] == "plain-master" else None
    opt = torch.optim.AdamW(masters or params, lr=HP["lr"], betas=tuple(HP["betas"]),
                            eps=HP["eps"], weight_decay=HP["weight_decay"], fused=True)
    x, y = _batch(resolve_config(spec["model"]).vocab, spec["batch"], spec["seq"])
    clip = spec["clip"]

    def step():
        loss = model(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if masters:
            for m, p in zip(masters, params, strict=True):
                m.grad, p.grad = p.grad.float(), None
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(masters or params, clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if masters:
            with torch.no_grad():
                for m, p in zip(masters, params, strict=True):
                    p.copy_(m)
        return float(loss.float()), t1, t2

    res = timed_steps(step, spec["steps"], spec["warmup"])
    res["params"] = num_params(resolve_config(spec["model"]))
    return res


def run_outcore(spec: dict) -> dict:
    import torch

    import outcore
    from outcore.models import build_model, num_params, resolve_config

    params, optim, prefetch = PLACEMENT[spec["row"]]
    zero: dict = {"prefetch_bytes": spec["prefetch_bytes"] if prefetch else 0}
    if prefetch and spec["prefetch_bytes"] is None:
        zero = {}  # outcore's default budget
    cfg = outcore.Config.from_dict({
        "dtype": "bf16", "seed": 0, "optimizer": {"type": "adamw", **HP},
        "offload": {"params": params, "optimizer": optim, "nvme_path": spec["nvme_path"]},
        "zero": zero, "gradient_clipping": spec["clip"],
    }).with_overrides(_merge(spec.get("outcore_set", {}), ROW_SET.get(spec["row"], {})))
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with outcore.init(cfg):
        model = build_model(spec["model"])
    engine = outcore.initialize(model, cfg)
    init_s = time.perf_counter() - t0
    x, y = _batch(resolve_config(spec["model"]).vocab, spec["batch"], spec["seq"])
    step = engine_step(engine, x, y)

    def counters():
        store = engine.rt._nvme  # only NVMe placements create the store
        return (store.bytes_read, store.bytes_written) if store is not None else (0, 0)

    res = timed_steps(step, spec["steps"], spec["warmup"], counters, spec.get("profile"))
    report = engine.memory_report()
    res.update(init_s=round(init_s, 1), params=num_params(resolve_config(spec["model"])),
               memory_report={k: report[k] for k in ("device", "host", "nvme", "rss")},
               schedule=engine.schedule_stats())
    engine.close()
    return res


def run_probe(spec: dict) -> dict:
    from outcore.probe import measure

    return measure(spec["nvme_path"]).to_json()


def worker(spec: dict) -> None:
    sys.path.insert(0, str(REPO))
    kind = {"plain": run_plain, "plain-master": run_plain, "probe": run_probe}.get(
        spec["row"], run_outcore)
    res = kind(spec)
    print("RESULT " + json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------------
# driver side: a fresh subprocess per row
# ---------------------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    batch: int
    seq: int
    result: dict = field(default_factory=dict)
    error: str = ""

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def _child(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[dict, str]:
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
            "outcore_set": args.outcore_set}
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
        row.result, row.error = _child(cmd, log, args.row_timeout, env)
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
    spec = {"row": "probe", "nvme_path": str(folder)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    try:
        res, err = _child(cmd, logs / "probe.log", 600)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if err:
        raise SystemExit(f"probe failed: {err}")
    return res


# ---------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------
def io_seconds(r: dict, pr: dict) -> float:
    """Disk time of one step's bytes at the probe's rates (reads and writes share the disk);
    the row's own probe when ``--probe-each-row`` took one."""
    pr = r.get("probe", pr)
    rd, wr = _bytes(r)
    return rd / (pr["disk_read_GBps"] * 1e9) + wr / (pr["disk_write_GBps"] * 1e9)


def _bytes(r: dict) -> tuple[float, float]:
    if r.get("store_read_per_step") or r.get("store_write_per_step"):
        return r["store_read_per_step"], r["store_write_per_step"]
    return r.get("proc_read_per_step", 0.0), r.get("proc_write_per_step", 0.0)


def _gb(nbytes: float) -> str:
    return "0" if nbytes < 1e6 else f"{nbytes / 1e9:.3g}"


def table(rows: list[Row], pr: dict) -> str:
    by = {r.name: r for r in rows if r.result}
    plain = by.get("plain")
    compute = by["none"].result["step_s"] if "none" in by else None
    head = ("| row | s/step | tokens/s | × plain | peak RSS GiB | read GB/step | written GB/step "
            "| floor s | step ÷ floor | fwd / bwd / opt s | other CPU |")
    out = [head, "|---" * 11 + "|"]
    for row in rows:
        if not row.result:
            out.append(f"| {LABEL[row.name]} | failed: {row.error.splitlines()[0]} |" + " |" * 9)
            continue
        r = row.result
        tps = row.tokens / r["step_s"]
        ratio = f"{tps / (plain.tokens / plain.result['step_s']):.2f}" if plain else "—"
        rd, wr = _bytes(r)
        src = "" if r.get("store_read_per_step") or max(rd, wr) < 1e6 else " ᵖ"
        if compute is not None:
            floor = max(compute, io_seconds(r, pr))
            fl, rel = f"{floor:.2f}", f"{r['step_s'] / floor:.2f}"
        else:
            fl = rel = "—"
        if row.name.startswith("plain"):
            fl = rel = "—"
        out.append(
            f"| {LABEL[row.name]} | {r['step_s']:.2f} | {tps:.0f} | {ratio} | "
            f"{r['peak_rss'] / 2**30:.2f} | {_gb(rd)}{src} | {_gb(wr)}{src} | {fl} | "
            f"{rel} | {r['fwd_s']:.2f} / {r['bwd_s']:.2f} / {r['opt_s']:.2f} | "
            f"{r['other_cpu']:.2f} |")
    return "\n".join(out)


def sweep_table(pairs: list[tuple[Row, Row]], pr: dict, n_params: int) -> tuple[str, list[dict]]:
    from outcore.estimate import predict_efficiency

    out = ["| tokens/step (batch×seq) | no offload s/step | offload s/step | "
           "read / written GB per step | floor s | step ÷ floor | efficiency measured | "
           "predicted (probe peak) | predicted (achieved peak) |", "|---" * 9 + "|"]
    points = []
    for ref, off in pairs:
        if not (ref.result and off.result):
            out.append(f"| {off.tokens} ({off.batch}×{off.seq}) | failed |" + " |" * 7)
            continue
        t_ref, t_off = ref.result["step_s"], off.result["step_s"]
        floor = max(t_ref, io_seconds(off.result, pr))
        rd, wr = _bytes(off.result)
        achieved = 6 * off.tokens * n_params / t_ref / 1e12  # TFLOP/s of the no-offload step
        p_probe = predict_efficiency(off.tokens, pr["disk_read_GBps"], pr["matmul_bf16_TFLOPs"],
                                     write_GBps=pr["disk_write_GBps"]).combined
        p_ach = predict_efficiency(off.tokens, pr["disk_read_GBps"], achieved,
                                   write_GBps=pr["disk_write_GBps"]).combined
        pt = {"row": off.name, "tokens": off.tokens, "batch": off.batch, "seq": off.seq,
              "t_ref": t_ref, "t_off": t_off, "floor": floor, "measured": t_ref / t_off,
              "bound": t_ref / floor, "pred_probe": p_probe, "pred_achieved": p_ach,
              "achieved_TFLOPs": achieved}
        points.append(pt)
        out.append(f"| {off.tokens} ({off.batch}×{off.seq}) | {t_ref:.2f} | {t_off:.2f} | "
                   f"{_gb(rd)} / {_gb(wr)} | {floor:.2f} | {t_off / floor:.2f} | "
                   f"{pt['measured']:.2f} | {p_probe:.2f} | {p_ach:.2f} |")
    return "\n".join(out), points


def plot(points: list[dict], pr: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from outcore.estimate import predict_efficiency

    fig, ax = plt.subplots(figsize=(7, 4.5))
    dense = [int(2 ** (k / 8)) for k in range(8 * 5, 8 * 13 + 1)]  # 32 .. 8192 tokens
    peak = pr["matmul_bf16_TFLOPs"]
    ach = statistics.median(p["achieved_TFLOPs"] for p in points)
    for tflops, style, name in ((peak, "--", f"probe bf16 matmul peak {peak:.2f} TFLOP/s"),
                                (ach, ":", f"achieved training rate {ach:.2f} TFLOP/s")):
        ys = [predict_efficiency(t, pr["disk_read_GBps"], tflops,
                                 write_GBps=pr["disk_write_GBps"]).combined for t in dense]
        ax.plot(dense, ys, style, label=f"paper's formula, {name}")
    names = list(dict.fromkeys(p.get("row", "nvme+opt") for p in points))  # older JSONs: none
    for name, (mark, line) in zip(names, itertools.cycle([("o", "-"), ("^", "--"), ("v", ":")])):
        mine = [p for p in points if p.get("row", "nvme+opt") == name]
        xs = [p["tokens"] for p in mine]
        ax.plot(xs, [p["bound"] for p in mine], mark, mfc="none", color="gray",
                label=f"full-overlap bound {name}: compute / floor")
        ax.plot(xs, [p["measured"] for p in mine], mark + line, lw=2, color="black",
                label=f"measured {name}: no-offload step / offload step")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("tokens per step (batch × seq), one rank")
    ax.set_ylabel("efficiency")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(main_rows: list[Row], pairs: list[tuple[Row, Row]], pr: dict, model: str,
           warmup: int, steps: int) -> list[dict]:
    """Print the table and the sweep; plot the sweep; return the sweep's points."""
    sys.path.insert(0, str(REPO))
    from outcore.models import num_params, resolve_config

    n_params = num_params(resolve_config(model))
    first = main_rows[0] if main_rows else pairs[0][0]
    text = [f"model {model} ({n_params / 1e6:.0f}M params), {first.batch}×{first.seq} = "
            f"{first.tokens} tokens/step, median of steps {warmup}...{steps - 1}", "",
            table(main_rows, pr)]
    points: list[dict] = []
    for name in dict.fromkeys(off.name for _, off in pairs):
        st, mine = sweep_table([(a, b) for a, b in pairs if b.name == name], pr, n_params)
        text += ["", f"Sweep, {LABEL[name]} (prefetch on) against no offload:", "", st]
        points += mine
    print("\n" + "\n".join(text))
    if len(points) >= 2:
        title = (f"outcore, {model}, offload against none; disk "
                 f"{pr['disk_read_GBps']:.1f}/{pr['disk_write_GBps']:.1f} GB/s read/write")
        plot(points, pr, OUT / "efficiency.png", title)
        print(f"\nplot: {OUT / 'efficiency.png'}")
    return points


def merge_report(paths: list[Path]) -> int:
    """Tables and plot of ``paths[0]``, with less disturbed reruns from the others swapped in."""
    base = json.loads(paths[0].read_text())
    reruns: dict[tuple, dict] = {}
    for p in paths[1:]:
        for r in json.loads(p.read_text())["rows"]:
            key = (r["name"], r["batch"], r["seq"])
            if r["result"] and (key not in reruns
                                or r["result"]["other_cpu"] < reruns[key]["result"]["other_cpu"]):
                reruns[key] = r

    def pick(d: dict) -> Row:
        row = Row(d["name"], d["batch"], d["seq"], d["result"], d["error"])
        new = reruns.get((row.name, row.batch, row.seq))
        if new and (not row.result or new["result"]["other_cpu"] < row.result["other_cpu"]):
            print(f"{row.name} at {row.batch}x{row.seq}: rerun (other CPU "
                  f"{new['result']['other_cpu']:.2f}) replaces "
                  f"{row.result.get('other_cpu', 'failed')}")
            row.result, row.error = new["result"], ""
        return row

    a = base["args"]
    main_rows = [pick(d) for d in base["rows"]]
    pairs = [(pick(x), pick(y)) for x, y in base["sweep_rows"]]
    report(main_rows, pairs, base["probe"], a["model"], int(a["warmup"]), int(a["steps"]))
    return 0


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores, {mem:.0f} GiB RAM"


def parse_sweep(text: str) -> list[tuple[int, int]]:
    """``"1x128,1x256,4x512"`` -> [(1, 128), (1, 256), (4, 512)]."""
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


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
    ap.add_argument("--model", default="gpt-335m", help="outcore.models preset")
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
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 steps, small sweep")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                    help="no run: print the tables and plot of a run's results JSON, with rows "
                         "of later JSONs (reruns of noisy rows) replacing the same rows when "
                         "other processes disturbed them less")
    args = ap.parse_args(argv)
    sets, args.outcore_set = args.outcore_set, {}
    for one in sets:
        args.outcore_set = _merge(args.outcore_set, one)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.merge:
        return merge_report(args.merge)
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

    sys.path.insert(0, str(REPO))
    from outcore.models import num_params, resolve_config

    n_params = num_params(resolve_config(args.model))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = OUT / "logs" / stamp
    logs.mkdir(parents=True, exist_ok=True)
    nvme_root = args.nvme_path.resolve()
    nvme_root.mkdir(parents=True, exist_ok=True)
    disk = subprocess.run(["df", "-h", "--output=source,fstype,size", str(nvme_root)],
                          capture_output=True, text=True).stdout.split("\n")[1].split()
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
    if not any(nvme_root.iterdir()):
        nvme_root.rmdir()  # every row's private folder is already gone

    points = report(main_rows, pairs, pr, args.model, args.warmup, args.steps)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "probe": pr,
              "rows": [vars(r) for r in main_rows], "sweep": points,
              "sweep_rows": [[vars(a), vars(b)] for a, b in pairs], "machine": machine(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    (OUT / f"train-{stamp}.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"results: {OUT / f'train-{stamp}.json'}")
    return 0 if all(r.result for r in main_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
