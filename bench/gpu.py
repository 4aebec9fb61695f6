"""One GPU, one JSON: outcore against plain PyTorch, on a GPT that fits in GPU memory and on one
whose model states do not (issue 21).

    python bench/gpu.py --tiny                            # seconds, on a CPU too: the script works
    python bench/gpu.py --models gpt-1.3b --out bench/gpu/fits.json
    python bench/gpu.py --models gpt-6b --probe-from bench/gpu/fits.json --no-sweep --out ...
    python bench/gpu.py --merge bench/gpu/fits.json bench/gpu/big.json > bench/gpu/all.json

Rows, each in its own subprocess with a timeout (bench/train.py's ``run_child``, which also takes
the peak RSS from ``wait4``), built and timed by bench/train_worker.py, in ``--dtype`` (bf16):

    plain         plain PyTorch in device memory: bf16 parameters, fused AdamW (bf16 moments)
    plain-master  plain PyTorch doing outcore's arithmetic: bf16 model, fp32 masters and moments
    none          outcore, no offload
    opt-cpu       outcore, optimizer state (fp32 masters, moments, gradients) on the host
    cpu+opt       outcore, parameters and optimizer state on the host
    nvme+opt      outcore, parameters and optimizer state on NVMe
    nvme+opt-cpu  outcore, parameters on NVMe, optimizer state on the host (for a model whose
                  14 bytes per parameter of NVMe state exceed the disk); the trainable
                  parameters' copies are cast from the host masters and stored nowhere
                  (storage.py's CastShard), so the row holds nothing on NVMe

``--checkpoint`` checkpoints every block of the outcore rows (``outcore train
--checkpoint-activations on``), ``--checkpoint N`` the first N blocks, so more tokens
fit beside the device's share of the states: the host-memory row's optimizer work is paid once
per step however many tokens it carries, and each block checkpointed costs its forward again.

A model whose 16 bytes per parameter of model states fit the device gets the first six rows,
one whose states do not gets plain, opt-cpu, cpu+opt and nvme+opt-cpu (``--rows`` chooses).
A row whose predicted bytes exceed the device, the host or the disk is skipped with the
numbers (``--force`` runs it). Each row prints: tokens/s, achieved TFLOP/s (model flops
``6·N + 12·layers·hidden·seq`` per token) and its share of the measured bf16 matmul peak,
peak device memory (``torch.cuda.max_memory_allocated``), peak host RSS, NVMe bytes read and
written per step, and step ÷ floor, where the floor is the largest of: compute (the ``none``
row's step at the same tokens, else the ``opt-cpu`` row's forward + backward, else the flops
at the measured peak), the disk time of the row's bytes at the probe's rates, and the
host-device link time of the bytes the placement must move (parameters fetched in forward
and backward, 16-bit gradients down and parameters back up when the optimizer is on the
host) at the measured page-locked copy rates.

The sweep (``--sweep-row``, default cpu+opt, on the first model) times the ``none`` row and
the offload row at several tokens per step in the same two processes (the engine is built
once): efficiency measured (no-offload step ÷ offload step) beside the paper's prediction
(``outcore.sizing.estimate.predict_efficiency``) at the tier's bandwidth, the link's for
the host tier, the disk's for NVMe: params/grads traffic only where the optimizer runs on the
host (its state never crosses the link), all of it where the state streams from NVMe.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import train
import train_worker
from train_report import LABEL

REPO = Path(__file__).resolve().parents[1]
FITS_ROWS = ["plain", "plain-master", "none", "opt-cpu", "cpu+opt", "nvme+opt"]
BIG_ROWS = ["plain", "opt-cpu", "cpu+opt", "nvme+opt-cpu"]
PLAIN = ("plain", "plain-master")
DEFAULT_POINT = {"gpt-1.3b": (4, 2048), "gpt-6b": (2, 2048)}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the worker: one row in this fresh process --------------------------------------------------
def link_rates(nbytes: int = 1 << 30, rounds: int = 5) -> dict:
    """Page-locked host -> device and device -> host copy rates, 10^9 bytes/s (CUDA only)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d_GBps", dev, host), ("d2h_GBps", host, dev)):
        best = float("inf")
        for _ in range(rounds):
            t0 = train_worker.now()
            dst.copy_(src, non_blocking=True)
            best = min(best, train_worker.now() - t0)
        out[name] = nbytes / best / 1e9
    return out


def run_points(spec: dict) -> dict:
    """An outcore row built once and timed at each of ``spec["points"]`` (batch, seq)."""
    import torch

    from outcore.app.models import num_params, resolve_config

    engine, init_s = train_worker.outcore_engine(spec)
    init_peaks = train_worker.device_peaks()
    vocab = resolve_config(spec["model"]).vocab
    points = []
    for batch, seq in spec["points"]:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        x, y = train_worker.make_batch(vocab, batch, seq, engine.device)
        res = train_worker.timed_steps(train_worker.engine_step(engine, x, y), spec["steps"],
                                       spec["warmup"], train_worker.store_counters(engine))
        points.append({**res, **train_worker.device_peaks(), "batch": batch, "seq": seq})
    report, stats = engine.memory_report(), engine.schedule_stats()
    engine.close(keep_values=False)  # no hand-back: it would count in the peak RSS
    return {"points": points, "init_s": round(init_s, 1), "init_peaks": init_peaks,
            "checkpointed_blocks": spec.get("checkpointed_blocks", 0),
            # where updates ran, and what the fetches found (a deferred update releases the
            # carried head: schedule.py's [Note: carrying the head across iterations])
            "updates": {k: v for k, v in stats.items()
                        if k.startswith("updates_") or k in ("fetches", "carried")},
            "params": num_params(resolve_config(spec["model"])),
            "memory_report": {k: report.get(k) for k in ("device", "host", "nvme", "rss")}}


def worker(spec: dict) -> None:
    sys.path.insert(0, str(REPO))
    if spec["row"] == "probe":
        res = {**train_worker.run_probe(spec), **link_rates(spec.get("link_bytes", 1 << 30))}
    elif spec["row"] == "link":
        res = link_rates(spec["link_bytes"])
    elif spec["row"] in PLAIN:
        batch, seq = spec["points"][0]
        one = train_worker.run_plain({**spec, "batch": batch, "seq": seq})
        res = {"points": [{**one, "batch": batch, "seq": seq}], "params": one["params"]}
    else:
        res = run_points(spec)
    print("RESULT " + json.dumps(res), flush=True)


# -- the driver --------------------------------------------------------------------------------
def shape(model: str) -> dict:
    from outcore.app.models import num_params, resolve_config

    c = resolve_config(model)
    n = num_params(c)
    return {"params": n, "layers": c.layers, "hidden": c.hidden, "vocab": c.vocab,
            "seq_len": c.seq_len, "state_bytes": 16 * n}


def flops_per_token(m: dict, seq: int) -> float:
    """Model flops of one token, forward and backward (PaLM's count, attention included)."""
    return 6 * m["params"] + 12 * m["layers"] * m["hidden"] * seq


# Plain PyTorch's bytes per parameter, all on the device: bf16 weights, gradients and moments
# (8), or with fp32 masters and moments beside the bf16 weights and gradients (20).
PLAIN_PER_PARAM = {"plain": 8, "plain-master": 20}


def _checkpoint_arg(text: str) -> str | int:
    """``--checkpoint [N]``: "on" (every block) or a number of blocks, 0 or more."""
    if text == "on":
        return text
    if text.isascii() and text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a number of blocks, got {text!r}")


def predicted_bytes(row: str, m: dict, batch: int, seq: int, dtype: str = "bf16",
                    checkpoint: str | int | None = None) -> dict:
    """Bytes a row needs per tier: model states (an outcore row's as ``Config.auto`` prices
    them, sizing/placement.py's ``state_bytes``, plus the 16-bit gradients of parameters kept
    on the device), plus on the device the activations (34 bytes per token, layer and hidden unit; 6
    per token and vocabulary entry for the logits) and two gathered layers. With a block
    checkpointed (``checkpoint``: "on" for every block, or a number of the first ones), its
    activations are on the device only while it is recomputed, and its 16-bit input waits in
    host memory (``checkpoint_blocks`` offloads it there)."""
    n = m["params"]
    if row in PLAIN_PER_PARAM:
        dev, host, nvme = PLAIN_PER_PARAM[row] * n, 0, 0
    else:
        from outcore import Config
        from outcore.sizing.placement import state_bytes

        params, optimizer = train_worker.PLACEMENT[row][:2]
        use = state_bytes(n, 1, Config(dtype=dtype), "cuda", params, optimizer)
        # parameters kept on the device leave their 16-bit gradients there through backward
        dev = use["device"] + (2 * n if params == "none" else 0)
        host, nvme = use["host"], use["nvme"]
    tokens, h = batch * seq, m["hidden"]
    blocks = m["layers"] if checkpoint == "on" else min(checkpoint or 0, m["layers"])
    # the first blocks are checkpointed: one is recomputed after the others' are freed
    layers_kept = max(m["layers"] - blocks, 1)
    dev += 34 * tokens * h * layers_kept + 6 * tokens * m["vocab"] + 2 * 2 * 12 * h * h
    host += 2 * tokens * h * blocks
    return {"device": dev, "host": host, "nvme": nvme}


def capacities(probe: dict, nvme_root: Path) -> dict:
    import psutil

    gpu = (probe.get("machine") or {}).get("gpu")
    host = psutil.virtual_memory().available
    return {"device": gpu["memory_bytes"] if gpu and probe.get("device", "").startswith("cuda")
            else host, "host": host, "nvme": shutil.disk_usage(nvme_root).free}


def fits(need: dict, room: dict) -> str:
    """Empty if ``need`` fits ``room`` (92% of the device, 85% of the host, 95% of the disk),
    else the reason."""
    share = {"device": 0.92, "host": 0.85, "nvme": 0.95}
    over = [f"{t} {need[t] / 1e9:.1f} GB > {share[t]:.0%} of {room[t] / 1e9:.1f} GB"
            for t in share if need[t] > share[t] * room[t]]
    return "; ".join(over)


def run_row(name: str, model: str, points: list[tuple[int, int]], args, dtype: str,
            nvme_root: Path, logs: Path) -> dict:
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=nvme_root))
    spec = {"row": name, "model": model, "points": points, "steps": args.steps,
            "warmup": args.warmup, "clip": 0.0, "nvme_path": str(folder),
            "prefetch_bytes": None, "outcore_set": args.outcore_set, "dtype": dtype,
            "checkpoint": None if name in PLAIN else args.checkpoint}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    say(f"{model} {name} at {', '.join(f'{b}x{s}' for b, s in points)} ...")
    try:
        res, err = train.run_child(cmd, logs / f"{model}-{name}.log", args.row_timeout)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    # the row's raw result in the log too: a session cut short still brings back the rows run
    lines = [line for line in (err or "").splitlines() if line.strip()]
    say(f"  failed: {lines[0]} {lines[-1] if len(lines) > 1 else ''}" if err else
        f"  done: {json.dumps(res, default=str)[:1500]}")
    return {"result": res, "error": err}


def probe(args, nvme_root: Path, logs: Path) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="probe-", dir=nvme_root))
    kwargs = ({"size_bytes": 8 << 20, "disk_seconds": 0.5, "matmul_seconds": 0.1,
               "host_copy_bytes": 16 << 20, "max_n": 512} if args.tiny else {})
    spec = {"row": "probe", "nvme_path": str(folder), "probe_kwargs": kwargs,
            "link_bytes": (16 << 20) if args.tiny else (1 << 30)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    say("probe: disk, host copy, matmul peaks, host-device link ...")
    try:
        res, err = train.run_child(cmd, logs / "probe.log", 600)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if err:
        raise SystemExit(f"probe failed: {err}")
    return res


def own_link(pr: dict, args, logs: Path) -> dict:
    """``pr`` (a probe taken from an earlier run) with this machine's host-device copy rates:
    two machines of one kind can differ there, and the link prices every row that moves
    parameters or gradients across it (``--probe-from`` skips the rest of the probe)."""
    spec = {"row": "link", "link_bytes": (16 << 20) if args.tiny else (1 << 30)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    res, err = train.run_child(cmd, logs / "link.log", 120)
    if err:
        say(f"link: not measured ({err.splitlines()[0]}); the earlier probe's rates are kept")
        return {**pr, "link_from": "the earlier probe"}
    rates = {k: v for k, v in res.items() if k.endswith("_GBps")}
    if rates:
        say("link: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()) + " (this machine)")
    return {**pr, **rates, "link_from": "this run" if rates else "the earlier probe"}


def collect(args, nvme_root: Path, logs: Path) -> dict:
    pr = (own_link(json.loads(Path(args.probe_from).read_text())["probe"], args, logs)
          if args.probe_from else probe(args, nvme_root, logs))
    dtype = pr["auto_dtype"] if args.dtype == "auto" else args.dtype
    models = [m for m in args.models.split(",") if m]
    rows_out, shapes = [], {}
    for k, model in enumerate(models):
        m = shapes[model] = shape(model)
        point = (args.batch or DEFAULT_POINT.get(model, (2, 64))[0],
                 args.seq or DEFAULT_POINT.get(model, (2, 64))[1])
        room = capacities(pr, nvme_root)
        big = m["state_bytes"] > 0.92 * room["device"]
        names = args.rows.split(",") if args.rows else (BIG_ROWS if big else FITS_ROWS)
        if dtype == "fp32":
            names = [n for n in names if n != "plain-master"]  # its masters would be itself
        sweep = args.sweep and k == 0
        for name in names:
            points = [point]
            if sweep and name in ("none", args.sweep_row):
                points += [p for p in args.sweep_points if p != point]
            need = predicted_bytes(name, m, *max(points, key=lambda p: p[0] * p[1]), dtype,
                                   checkpoint=None if name in PLAIN else args.checkpoint)
            why = "" if args.force else fits(need, capacities(pr, nvme_root))
            base = {"model": model, "row": name, "label": LABEL[name],
                    "placement": train_worker.PLACEMENT.get(name, ("-", "-", True))[:2],
                    "predicted_bytes": need}
            if why:
                say(f"{model} {name}: skipped ({why})")
                rows_out += [{**base, "batch": b, "seq": s, "main": (b, s) == point,
                              "status": "skipped", "reason": why} for b, s in points]
                continue
            ran = run_row(name, model, points, args, dtype, nvme_root, logs)
            res = ran["result"]
            for i, (b, s) in enumerate(points):
                row = {**base, "batch": b, "seq": s, "main": (b, s) == point}
                if not res:
                    rows_out.append({**row, "status": "failed", "reason": ran["error"]})
                    continue
                one = res["points"][i]
                rows_out.append({**row, "status": "ok", "peak_host_rss": res["peak_rss"],
                                 "init_s": res.get("init_s"), "wall_s": res["wall_s"],
                                 "checkpointed_blocks": res.get("checkpointed_blocks", 0),
                                 "updates": res.get("updates", {}),
                                 "init_peaks": res.get("init_peaks", {}), **one})
    return {"probe": pr, "dtype": dtype, "models": shapes,
            "settings": {k: str(v) for k, v in vars(args).items() if k not in ("worker",)},
            "rows": rows_out}


def summarize(run: dict) -> dict:
    """Columns per row, the sweep and the issue's targets, from the raw rows of ``run``."""
    pr, rows = run["probe"], run["rows"]
    peak = pr[f"matmul_{run['dtype']}_TFLOPs"]  # the measured matmul rate in the run's dtype
    link = pr.get("h2d_GBps") or pr["host_copy_GBps"]
    by = {(r["model"], r["row"], r["batch"], r["seq"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        m, tokens = run["models"][r["model"]], r["batch"] * r["seq"]
        key = (r["model"], r["batch"], r["seq"])
        r["tokens"], r["tokens_per_s"] = tokens, tokens / r["step_s"]
        r["TFLOPs"] = flops_per_token(m, r["seq"]) * tokens / r["step_s"] / 1e12
        r["pct_of_peak"] = 100 * r["TFLOPs"] / peak
        r["peak_device"] = r.get("peak_device_allocated")
        r["read_bytes_per_step"] = r.get("store_read_per_step", 0.0)
        r["written_bytes_per_step"] = r.get("store_write_per_step", 0.0)
        if r["row"] in PLAIN:
            continue
        none, resident = by.get((key[0], "none", *key[1:])), by.get((key[0], "opt-cpu", *key[1:]))
        if none:
            compute, source = none["step_s"], "none row's step"
        elif resident:
            compute, source = resident["fwd_s"] + resident["bwd_s"], "opt-cpu row's fwd+bwd"
        else:
            compute = flops_per_token(m, r["seq"]) * tokens / (peak * 1e12)
            source = "model flops at the measured peak"
        disk = (r["read_bytes_per_step"] / (pr["disk_read_GBps"] * 1e9)
                + r["written_bytes_per_step"] / (pr["disk_write_GBps"] * 1e9))
        p_off, o_off = (t != "none" for t in r["placement"])
        moved = m["params"] * (4 * p_off + (2 + 2 * (not p_off)) * o_off)
        link_s = moved / (link * 1e9) if pr.get("h2d_GBps") else 0.0
        r["floor"] = {"compute_s": compute, "compute_from": source, "disk_s": disk,
                      "link_s": link_s, "link_bytes": moved}
        r["floor_s"] = max(compute, disk, link_s)
        r["step_over_floor"] = r["step_s"] / r["floor_s"]
    return {**run, "peak_TFLOPs": peak, "sweep": sweep(run, by, peak, link),
            "targets": targets(run, by)}


def sweep(run: dict, by: dict, peak: float, link: float) -> dict:
    from outcore.sizing.efficiency import predict_efficiency

    s = run["settings"]
    model, row = s.get("models", "").split(",")[0], s.get("sweep_row", "cpu+opt")
    pr, points = run["probe"], []
    for (mdl, name, b, q), off in sorted(by.items(), key=lambda kv: kv[0][2] * kv[0][3]):
        ref = by.get((mdl, "none", b, q))
        if mdl != model or name != row or ref is None:
            continue
        tokens, disk = b * q, "nvme" in off["placement"]
        bw, write = (pr["disk_read_GBps"], pr["disk_write_GBps"]) if disk else (link, None)
        eff = predict_efficiency(tokens, bw, peak, write_GBps=write).to_json()
        achieved = predict_efficiency(tokens, bw, ref["TFLOPs"], write_GBps=write).to_json()
        # the optimizer's state crosses the tier's link only where it streams from NVMe
        pick = "combined" if off["placement"][1] == "nvme" else "params_grads"
        points.append({"tokens": tokens, "batch": b, "seq": q, "none_step_s": ref["step_s"],
                       "offload_step_s": off["step_s"], "measured": ref["step_s"] / off["step_s"],
                       "bound": ref["step_s"] / off["floor_s"], "predicted": eff[pick],
                       "predicted_at_achieved": achieved[pick], "prediction": eff})
    return {"model": model, "row": row, "bandwidth_GBps": None if not points else (
        pr["disk_read_GBps"] if "nvme" in row else link), "points": points}


def targets(run: dict, by: dict) -> dict:
    """The issue's targets, each with its value and whether it is met (None: not measured)."""
    def main(name: str) -> list[dict]:
        return [r for r in by.values() if r["row"] == name and r["main"]]

    out = {}
    for ref in ("plain", "plain-master"):
        pairs = [(n, p) for n in main("none") for p in main(ref) if p["model"] == n["model"]]
        ratio = max((n["tokens_per_s"] / p["tokens_per_s"] for n, p in pairs), default=None)
        out[f"none_vs_{ref}"] = {"value": ratio, "target": 0.95,
                                 "met": None if ratio is None else ratio >= 0.95}
    pct = max((r["pct_of_peak"] for r in main("none")), default=None)
    out["none_pct_of_peak"] = {"value": pct, "target": 40, "met": None if pct is None
                               else pct >= 40}
    # each row at the most tokens a step it ran (it fits), of one model: the host-memory row
    # may fit more than no offload does (with --checkpoint, several times more)
    def most(name: str, model: str) -> dict | None:
        rows = [r for r in by.values() if r["row"] == name and r["model"] == model]
        return max(rows, key=lambda r: r["tokens"], default=None)

    host = [(h, n) for m in run["models"] if (h := most("cpu+opt", m)) and (n := most("none", m))]
    if host:
        r, n = host[0]
        v = r["tokens_per_s"] / n["tokens_per_s"]
        out["host_vs_none_at_most_tokens"] = {"value": v, "tokens": r["tokens"],
                                              "none_tokens": n["tokens"], "target": 0.8,
                                              "met": v >= 0.8}
    else:
        out["host_vs_none_at_most_tokens"] = {"value": None, "target": 0.8, "met": None}
    # rows that stream from NVMe: nvme+opt-cpu casts its copies from masters in memory
    nv = [r["step_over_floor"] for r in by.values()
          if "nvme" in r["row"] and r["main"] and r["read_bytes_per_step"] > 0]
    out["nvme_step_over_floor"] = {"value": min(nv, default=None), "target": 1.2,
                                   "met": None if not nv else min(nv) <= 1.2}
    device = (run["probe"].get("machine") or {}).get("gpu") or {}
    big = [r for r in by.values() if r["main"] and r["row"] not in PLAIN
           and run["models"][r["model"]]["state_bytes"] > device.get("memory_bytes", float("inf"))]
    falls = [r["losses"][-1] < r["losses"][0] for r in big]
    out["big_model_trains"] = {"value": [f"{r['model']} {r['row']}" for r in big],
                               "target": "loss falls with model states > device memory",
                               "met": None if not falls else all(falls)}
    return out


def merge(paths: list[Path]) -> dict:
    """Runs of several invocations as one: the first's probe, rows of later runs replacing
    the same (model, row, batch, seq)."""
    runs = [json.loads(p.read_text()) for p in paths]
    rows: dict[tuple, dict] = {}
    for run in runs:
        for r in run["rows"]:
            rows[(r["model"], r["row"], r["batch"], r["seq"])] = {
                k: v for k, v in r.items() if k not in ("floor", "floor_s", "step_over_floor")}
    base = runs[0]
    return {**base, "models": {k: v for run in runs for k, v in run["models"].items()},
            "rows": list(rows.values()), "merged_from": [str(p) for p in paths]}


def parse_points(text: str) -> list[tuple[int, int]]:
    """``"1x512,4x2048"`` -> [(1, 512), (4, 2048)]."""
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true",
                    help="tiny models, few steps, a quick probe: checks the script in seconds")
    ap.add_argument("--models", default="gpt-1.3b,gpt-6b", help="GPT presets, in order")
    ap.add_argument("--rows", default="", help="rows for every model (default: by fit)")
    ap.add_argument("--batch", type=int, default=0, help="sequences per step (default per model)")
    ap.add_argument("--seq", type=int, default=0, help="tokens per sequence (default per model)")
    ap.add_argument("--steps", type=int, default=5, help="steps per point, warm-up included")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["auto", "bf16", "fp16", "fp32"])
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--sweep-row", default="cpu+opt", help="the offload row swept (first model)")
    ap.add_argument("--sweep-points", type=parse_points,
                    default=parse_points("1x512,1x2048,2x2048,4x2048,8x2048"))
    ap.add_argument("--nvme-path", type=Path, default=REPO / "bench" / "out" / "gpu-swap")
    ap.add_argument("--row-timeout", type=float, default=540,
                    help="seconds per row's subprocess (the GPU session's commands get 600)")
    ap.add_argument("--probe-from", help="take the probe from this earlier JSON (saves ~30 s)")
    ap.add_argument("--force", action="store_true", help="run rows predicted not to fit")
    ap.add_argument("--set", dest="outcore_set", type=train.parse_set, action="append",
                    default=[], metavar="KEY=JSON",
                    help="outcore config override for every outcore row, e.g. --set "
                         "zero.overlap_step_with_forward=true (repeatable)")
    ap.add_argument("--checkpoint", nargs="?", const="on", default=None, metavar="N",
                    type=_checkpoint_arg,
                    help="outcore rows checkpoint every block, or the first N blocks "
                    "(more tokens fit the device)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                    help="no run: one JSON of several runs' rows, columns recomputed")
    args = ap.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    sys.path.insert(0, str(REPO))
    sets, args.outcore_set = args.outcore_set, {}
    if sets:  # --set a.b=1 --set a.c=2: both apply
        from outcore.config import merge_mappings

        for one in sets:
            args.outcore_set = merge_mappings(args.outcore_set, one)
    if args.merge:
        result = summarize(merge(args.merge))
    else:
        if args.tiny:
            args.models = args.models if args.models != ap.get_default("models") else "tiny,small"
            args.dtype, args.steps, args.warmup = "auto", 3, 1
            if args.sweep_points == ap.get_default("sweep_points"):
                args.sweep_points = [(1, 32), (2, 64)]
            args.batch, args.seq = args.batch or 2, args.seq or 64
        nvme_root = args.nvme_path.resolve()
        made_root = not nvme_root.exists()  # removed at the end only if this run made it
        nvme_root.mkdir(parents=True, exist_ok=True)
        logs = REPO / "bench" / "out" / "logs" / f"gpu-{time.strftime('%Y%m%d-%H%M%S')}"
        logs.mkdir(parents=True, exist_ok=True)
        result = {**summarize(collect(args, nvme_root, logs)), "logs": str(logs)}
        if made_root and not any(nvme_root.iterdir()):
            nvme_root.rmdir()
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    failed = [r for r in result["rows"] if r["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
