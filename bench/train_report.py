"""bench/train.py's reporting: the rows' table, the tokens-per-step sweep and its plot.

Every table says which machine and compute dtype its numbers came from (``machine_line``),
since the same step takes fifty times longer where bf16 is emulated. Columns beyond the
times: bytes moved per step, the floor ``max(compute, read/read_bw + written/write_bw)``, the
CPU seconds of the process per step and, for offload rows, the CPU seconds each GB moved to
and from the disk cost beyond the no-offload row.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
ROWS = ["plain", "plain-master", "none", "cpu-p0", "cpu", "nvme-p0", "nvme", "nvme+opt-p0",
        "nvme+opt", "nvme+opt-reuse", "nvme+opt-return", "nvme+opt-wait", "nvme+opt-early",
        "nvme+opt-lean", "nvme+opt-small", "nvme+opt-act", "nvme+opt-lean-act", "nvme+opt-ckpt",
        "nvme+opt-ckpt-p384", "nvme+opt-ckpt-early", "nvme+opt-ckpt-p512",
        "nvme+opt-ckpt-p512-early", "deepspeed"]
LABEL = {
    "plain": "plain PyTorch, in memory (params in the compute dtype, fused AdamW)",
    "plain-master": "plain PyTorch, 16-bit params + fp32 master copy (outcore's arithmetic)",
    "none": "outcore, no offload",
    "cpu-p0": "outcore, params on host, prefetch off", "cpu": "outcore, params on host",
    "nvme-p0": "outcore, params on NVMe, prefetch off", "nvme": "outcore, params on NVMe",
    "nvme+opt-p0": "outcore, params+optimizer on NVMe, prefetch off",
    "nvme+opt": "outcore, params+optimizer on NVMe",
    "nvme+opt-reuse": "outcore, params+optimizer on NVMe, reuse_freed_memory",
    "nvme+opt-return": "outcore, params+optimizer on NVMe, freed memory always given back",
    "nvme+opt-wait": "outcore, params+optimizer on NVMe, no speculative step",
    "nvme+opt-early": "outcore, params+optimizer on NVMe, step returns before its updates",
    "nvme+opt-lean": "outcore, params+optimizer on NVMe, smallest footprint",
    "nvme+opt-small": "outcore, params+optimizer on NVMe, small buffers, freed memory kept",
    "nvme+opt-act": "outcore, params+optimizer on NVMe, activations on NVMe",
    "nvme+opt-lean-act": "outcore, params+optimizer on NVMe, smallest footprint, activations "
                         "on NVMe",
    "nvme+opt-ckpt": "outcore, params+optimizer on NVMe, every block checkpointed, freed "
                     "memory given back",
    "nvme+opt-ckpt-p384": "outcore, params+optimizer on NVMe, every block checkpointed, freed "
                          "memory given back, 384 MiB prefetch",
    "nvme+opt-ckpt-early": "outcore, params+optimizer on NVMe, every block checkpointed, freed "
                           "memory given back, step returns before its updates",
    "nvme+opt-ckpt-p512": "outcore, params+optimizer on NVMe, every block checkpointed, freed "
                          "memory given back, 512 MiB prefetch",
    "nvme+opt-ckpt-p512-early": "outcore, params+optimizer on NVMe, every block checkpointed, "
                                "freed memory given back, 512 MiB prefetch, step returns "
                                "before its updates",
    # bench/gpu.py's rows (params in device memory there unless offloaded)
    "opt-cpu": "outcore, optimizer on host", "cpu+opt": "outcore, params+optimizer on host",
    "nvme+opt-cpu": "outcore, params on NVMe, optimizer on host",
    "deepspeed": "DeepSpeed ZeRO-3, params+optimizer on NVMe",
}


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


def cpu_s(r: dict) -> float | None:
    """CPU seconds (user + system, all threads) the row's process spent per measured step;
    None for results that predate the counters."""
    if "user_s_per_step" not in r:
        return None
    return r["user_s_per_step"] + r.get("sys_s_per_step", 0.0)


def cpu_per_gb(r: dict, base: float | None) -> str:
    """CPU seconds per GB moved to and from the disk beyond the no-offload row's CPU per step:
    what the offload's host work costs per byte (issue: at most 0.2 s/GB)."""
    moved, mine = sum(_bytes(r)) / 1e9, cpu_s(r)
    if base is None or mine is None or moved < 0.05:
        return "—"
    return f"{(mine - base) / moved:.2f}"


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _gb(nbytes: float) -> str:
    return "0" if nbytes < 1e6 else f"{nbytes / 1e9:.3g}"


def table(rows: list[Row], pr: dict) -> str:
    by = {r.name: r for r in rows if r.result}
    plain = by.get("plain")
    head = ("| row | s/step | tokens/s | × plain | peak RSS GiB | read GB/step | written GB/step "
            "| floor s | step ÷ floor | fwd / bwd / opt s | CPU s/step | +CPU s per GB | "
            "other CPU |")
    out = [head, "|---" * 13 + "|"]
    first = next((r for r in rows if r.name == "none" and r.result), None)
    compute = first.result["step_s"] if first else None
    base_cpu = cpu_s(first.result) if first else None
    for row in rows:
        if row.name == "none" and row.result:  # rows listed twice: each round against its own
            compute, base_cpu = row.result["step_s"], cpu_s(row.result)
        if not row.result:
            out.append(f"| {LABEL[row.name]} | failed: {row.error.splitlines()[0]} |" + " |" * 11)
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
            f"{_num(cpu_s(r))} | {cpu_per_gb(r, base_cpu)} | {r['other_cpu']:.2f} |")
    return "\n".join(out)


def peak_TFLOPs(pr: dict, dtype: str) -> float:
    """The probe's matmul rate in the run's compute dtype (bf16 for runs that predate it)."""
    return pr.get(f"matmul_{dtype}_TFLOPs", pr["matmul_bf16_TFLOPs"])


def sweep_table(pairs: list[tuple[Row, Row]], pr: dict, n_params: int,
                dtype: str) -> tuple[str, list[dict]]:
    from outcore.sizing.efficiency import predict_efficiency

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
        p_probe = predict_efficiency(off.tokens, pr["disk_read_GBps"], peak_TFLOPs(pr, dtype),
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


def plot(points: list[dict], pr: dict, path: Path, title: str, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from outcore.sizing.efficiency import predict_efficiency

    fig, ax = plt.subplots(figsize=(7, 4.5))
    dense = [int(2 ** (k / 8)) for k in range(8 * 5, 8 * 13 + 1)]  # 32 .. 8192 tokens
    peak = peak_TFLOPs(pr, dtype)
    ach = statistics.median(p["achieved_TFLOPs"] for p in points)
    for tflops, style, name in ((peak, "--", f"probe {dtype} matmul peak {peak:.2f} TFLOP/s"),
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
    ax.set_title(title, fontsize=9, wrap=True)  # the machine line is long
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # nothing of the title cut off
    plt.close(fig)


def report(main_rows: list[Row], pairs: list[tuple[Row, Row]], pr: dict, model: str,
           warmup: int, steps: int, dtype: str = "bf16", machine: str = "") -> list[dict]:
    """Print the table and the sweep; plot the sweep; return the sweep's points."""
    sys.path.insert(0, str(REPO))
    from outcore.app.models import num_params, resolve_config

    n_params = num_params(resolve_config(model))
    first = main_rows[0] if main_rows else pairs[0][0]
    text = [f"model {model} ({n_params / 1e6:.0f}M params), {dtype}, {first.batch}×{first.seq} "
            f"= {first.tokens} tokens/step, median of steps {warmup}...{steps - 1}"
            + (f"; {machine}" if machine else ""), "",
            table(main_rows, pr)]
    points: list[dict] = []
    for name in dict.fromkeys(off.name for _, off in pairs):
        st, mine = sweep_table([(a, b) for a, b in pairs if b.name == name], pr, n_params,
                               dtype)
        text += ["", f"Sweep, {LABEL[name]} (prefetch on) against no offload:", "", st]
        points += mine
    print("\n" + "\n".join(text))
    if len(points) >= 2:
        title = (f"outcore, {model}, {dtype}, offload against none; disk "
                 f"{pr['disk_read_GBps']:.1f}/{pr['disk_write_GBps']:.1f} GB/s read/write"
                 + (f"\n{machine}" if machine else ""))
        plot(points, pr, OUT / "efficiency.png", title, dtype)
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
    report(main_rows, pairs, base["probe"], a["model"], int(a["warmup"]), int(a["steps"]),
           a.get("dtype_resolved", "bf16"), machine_line(base.get("machine_info", {})))
    return 0


def machine_line(m: dict) -> str:
    """One line naming the machine of a ``outcore.device.machine.describe()`` dict."""
    if not m:
        return ""
    f = m.get("cpu_features", {})
    isa = ", ".join(k for k in ("avx512_bf16", "amx") if f.get(k)) or "AVX2, no native bf16"
    gpu = f", {m['gpu']['name']}" if m.get("gpu") else ""
    threads = f", torch threads {m['compute_threads']}" if m.get("compute_threads") else ""
    return (f"{m.get('cpu', '?')} ({isa}), {m.get('cores', '?')} cores{gpu}, torch "
            f"{m.get('torch', '?')}{threads}, {m.get('date', '')}")
