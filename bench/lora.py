"""LoRA over an offloaded base: base in memory vs base on NVMe under a host budget smaller
than the base, against a full fine-tune of the same model.

Every row trains the same GPT preset (``outcore.app.models``) on the same fixed random token
batch (AdamW, seed 0) in a fresh subprocess, so each row's peak RSS is its own (``wait4``'s
``ru_maxrss``, the whole process, build included) and the RSS of its measured steps alone is
polled beside it. The LoRA rows wrap the model built under ``outcore.init`` with peft
(``outcore.hf.lora``'s spec: ``r=8,alpha=16,targets=qkv,proj,fc`` is every Linear of every
block of these presets; the tied embedding/head stays frozen) and hand it to
``outcore.initialize``. Rows:

    lora-plain     LoRA in plain PyTorch (peft, fused AdamW over the adapters), no outcore:
                   what the in-memory row costs without the engine
    lora-mem       LoRA, base in memory: offload.params=none, optimizer=none. On a CPU-only
                   host the compute device *is* host memory, so the base sits in RAM as the
                   compute tensors themselves (zero copy at one rank).
    lora-nvme      LoRA, base on NVMe (params=nvme), the adapters' optimizer state in memory
                   (optimizer=none), host budgets (offload.host_buffer_bytes +
                   zero.prefetch_bytes) smaller than the base
    lora-nvme+opt  as lora-nvme with the adapters' optimizer state on NVMe too
    full-nvme      full fine-tune, params and optimizer on NVMe, the same budgets
    full-mem       full fine-tune in memory (16 B/parameter: small models only)

The LoRA rows build the base under ``outcore.init(cfg, frozen=True)`` (what ``outcore train
--lora`` does: no fp32 master for the base even during the build); ``--no-frozen-init``
builds it the ordinary way, every parameter with an fp32 master in the optimizer tier until
``outcore.initialize`` drops the frozen ones.

The host budgets of the NVMe rows are the two keys that bound host memory for parameters
on NVMe: ``--host-buffer-mib`` (offload.host_buffer_bytes, default 64) and ``--prefetch-mib``
(zero.prefetch_bytes, default 256: a few of gpt-1.3b's largest layers, which a smaller budget
fetches on demand); the JSON sets their sum beside the base's bytes.

Columns: median step time after warm-up and tokens/s, peak RSS (the process; the measured
steps; after the build and after each step in the JSON), the RAM outcore's ledger counted at
its peak, bytes per tier and by kind from ``engine.memory_report()`` (after the last step;
the peaks are over the measured steps), NVMe bytes read/written per step (outcore's store
counters) and the CPU other processes took (the JSON also holds CPU seconds, page faults
and forward/backward times per step). The compute dtype is ``--dtype``
resolved for this CPU (``auto``: bf16 where the CPU multiplies it natively, else fp32); the
base is stored in that dtype, so where it resolves to fp32 the base costs 4 bytes per
parameter, not 2. One JSON goes to stdout (and ``--out``), the table to stderr. The record:
bench/results/2026-11-23-amd-epyc-fp32-lora-base-on-nvme.md.

    .venv/bin/python bench/lora.py --tiny                       # seconds: checks the script
    .venv/bin/python bench/lora.py --model gpt-1.3b --nvme /tmp/x --probe --wait-quiet 600
    .venv/bin/python bench/lora.py --rows lora-mem,lora-nvme --set offload.reuse_freed_memory=false
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
_MiB = 1 << 20

# row -> (LoRA?, offload.params, offload.optimizer, capped host budgets?)
ROWS = {
    "lora-plain": (True, "", "", False),
    "lora-mem": (True, "none", "none", False),
    "lora-nvme": (True, "nvme", "none", True),
    "lora-nvme+opt": (True, "nvme", "nvme", True),
    "full-nvme": (False, "nvme", "nvme", True),
    "full-mem": (False, "none", "none", False),
}
LABEL = {
    "lora-plain": "LoRA in plain PyTorch + peft, no outcore",
    "lora-mem": "LoRA, base in memory",
    "lora-nvme": "LoRA, base on NVMe",
    "lora-nvme+opt": "LoRA, base and adapters' optimizer state on NVMe",
    "full-nvme": "full fine-tune, params+optimizer on NVMe",
    "full-mem": "full fine-tune, in memory",
}
KINDS = ("params", "master", "optimizer", "grads")
TIERS = ("device", "host", "nvme")
DEFAULT_SPEC = "r=8,alpha=16,targets=qkv,proj,fc"


# -- the worker: one row in this process ---------------------------------------------------
class RssPoll:
    """This process's RSS polled in a thread from ``start()`` on (the measured steps only;
    ``ru_maxrss`` covers the whole process, the build included)."""

    def __init__(self, every: float = 0.05) -> None:
        import psutil

        self.peak, self._proc, self._every = 0, psutil.Process(), every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.peak = self._proc.memory_info().rss
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return max(self.peak, self._proc.memory_info().rss)


def lora_model(model, spec: str):
    """``model`` with LoRA adapters from an ``outcore.hf.lora`` spec.

    ``outcore.hf.apply_lora`` builds a ``PeftModelForCausalLM`` (task type CAUSAL_LM), which
    needs a Hugging Face model (``prepare_inputs_for_generation``); outcore's own GPT presets
    have none, so the same ``LoraConfig`` is applied without a task type: a plain
    ``PeftModel`` whose forward passes ``(tokens, targets)`` through to the GPT."""
    from peft import get_peft_model

    from outcore.hf.lora import lora_config

    config = lora_config(spec)
    config.task_type = None
    return get_peft_model(model, config)


def _unique_params(model) -> list:
    return list({id(p): p for p in model.parameters()}.values())


def worker(spec: dict) -> dict:
    import peft  # noqa: F401  (every row imports it, so its RSS is the same in every row)
    import torch
    from train_worker import HP, engine_step, make_batch, store_counters, timed_steps

    import outcore
    from outcore.app.models import build_model, resolve_config

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    if spec["row"] == "lora-plain":
        return plain_worker(spec)
    lora, params, optim, capped = ROWS[spec["row"]]
    offload: dict = {"params": params, "optimizer": optim, "nvme_path": spec["nvme_path"]}
    zero: dict = {}
    if capped:
        offload["host_buffer_bytes"] = spec["host_buffer_bytes"]
        zero["prefetch_bytes"] = spec["prefetch_bytes"]
    cfg = outcore.Config.from_dict({"dtype": spec["dtype"], "seed": 0,
                                    "optimizer": {"type": "adamw", **HP},
                                    "offload": offload, "zero": zero})
    cfg = cfg.with_overrides(spec.get("outcore_set") or {})
    t0 = time.perf_counter()
    torch.manual_seed(0)
    # unless --no-frozen-init the LoRA base is built frozen (param.py's [Note: a parameter
    # born frozen]), so no fp32 master is made for it, not even during the build
    frozen_init = bool(lora and spec.get("frozen_init"))
    with outcore.init(cfg, **({"frozen": True} if frozen_init else {})):
        model = build_model(spec["model"])
    if lora:
        model = lora_model(model, spec["lora"])
    every = _unique_params(model)
    trainable = sum(p.numel() for p in every if p.requires_grad)
    frozen = sum(p.numel() for p in every if not p.requires_grad)
    engine = outcore.initialize(model, cfg)
    init_s = time.perf_counter() - t0
    after_build = engine.memory_report()
    rss_after_build = after_build["rss"]
    itemsize = engine.rt.compute_dtype.itemsize

    x, y = make_batch(resolve_config(spec["model"]).vocab, spec["batch"], spec["seq"],
                      engine.device)
    store = store_counters(engine)
    rss = RssPoll()

    def counters() -> tuple[int, int]:
        # first called when the measured steps begin: the ledger's peaks and the RSS poll
        # start there, so both cover the measured steps only
        if not rss._thread.is_alive() and not rss._stop.is_set():
            engine.rt.ledger.reset_peaks()
            rss.start()
        return store()

    step, rss_after = engine_step(engine, x, y), []

    def step_and_rss():  # the RSS after each step: does it grow from step to step?
        out = step()
        rss_after.append(rss._proc.memory_info().rss)
        return out

    res = timed_steps(step_and_rss, spec["steps"], spec["warmup"], counters)
    res["rss_after_step"], res["rss_after_build"] = rss_after, rss_after_build
    res["rss_steps_peak"] = rss.stop()
    report = engine.memory_report()
    engine.close(keep_values=False)  # no hand-back: it would count in the peak RSS
    res.update(
        row=spec["row"], label=LABEL[spec["row"]], lora=lora, frozen_init=frozen_init,
        placement={"params": params, "optimizer": optim},
        host_buffer_bytes=cfg.offload.host_buffer_bytes, outcore_set=spec.get("outcore_set"),
        prefetch_bytes=cfg.zero.prefetch_bytes,
        dtype=report["dtype"], init_s=round(init_s, 1),
        params_total=trainable + frozen, params_trainable=trainable, params_frozen=frozen,
        # the frozen base in the compute dtype: what a LoRA row keeps of the base
        base_bytes=frozen * itemsize, compute_itemsize=itemsize,
        tiers={t: report[t] for t in TIERS},
        by_kind=report["by_kind"], kinds=kind_totals(report["by_kind"]),
        after_build={"tiers": {t: after_build[t] for t in TIERS},
                     "by_kind": after_build["by_kind"]},
        schedule=report["schedule"], rss_end=report["rss"],
        tokens_per_step=spec["batch"] * spec["seq"],
        torch_threads=torch.get_num_threads())
    res["tokens_per_s"] = res["tokens_per_step"] / res["step_s"]
    return res


def plain_worker(spec: dict) -> dict:
    """The ``lora-plain`` row: the same model, adapters, batch and AdamW in plain PyTorch."""
    import torch
    from train_worker import HP, make_batch, timed_steps

    from outcore.app.models import build_model, resolve_config
    from outcore.device.compute_dtype import DTYPES

    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = lora_model(build_model(spec["model"]).to(DTYPES[spec["dtype"]]), spec["lora"])
    every = _unique_params(model)
    train = [p for p in every if p.requires_grad]
    trainable, frozen = sum(p.numel() for p in train), sum(p.numel() for p in every) - sum(
        p.numel() for p in train)
    opt = torch.optim.AdamW(train, lr=HP["lr"], betas=tuple(HP["betas"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], fused=True)
    init_s = time.perf_counter() - t0
    x, y = make_batch(resolve_config(spec["model"]).vocab, spec["batch"], spec["seq"])
    rss, rss_after = RssPoll(), []
    rss_after_build = rss._proc.memory_info().rss

    def step():
        if len(rss_after) == spec["warmup"]:
            rss.start()
        loss = model(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rss_after.append(rss._proc.memory_info().rss)
        return float(loss.detach()), t1, t2

    res = timed_steps(step, spec["steps"], spec["warmup"])
    res["rss_after_step"], res["rss_after_build"] = rss_after, rss_after_build
    res["rss_steps_peak"] = rss.stop()
    size = DTYPES[spec["dtype"]].itemsize
    # what plain PyTorch holds, by outcore's kinds: parameters in the compute dtype, AdamW's
    # two moments and the gradients of the adapters (all of it in RAM)
    kinds = {"params": size * (trainable + frozen), "master": 0,
             "optimizer": 2 * size * trainable, "grads": size * trainable}
    res.update(
        row="lora-plain", label=LABEL["lora-plain"], lora=True, frozen_init=False,
        placement={"params": "plain PyTorch", "optimizer": "plain PyTorch"},
        host_buffer_bytes=0, prefetch_bytes=0, outcore_set=None,
        dtype={"name": spec["dtype"]}, init_s=round(init_s, 1),
        params_total=trainable + frozen, params_trainable=trainable, params_frozen=frozen,
        base_bytes=frozen * size, compute_itemsize=size,
        tiers={"device": sum(kinds.values()), "host": 0, "nvme": 0}, by_kind={},
        kinds={k: {"device": v, "peak_device": v} if v else {} for k, v in kinds.items()},
        schedule={}, rss_end=rss_after[-1], tokens_per_step=spec["batch"] * spec["seq"],
        torch_threads=torch.get_num_threads())
    res["tokens_per_s"] = res["tokens_per_step"] / res["step_s"]
    return res


def kind_totals(by_kind: dict) -> dict:
    """``{kind: {tier: bytes now, "peak_<tier>": peak bytes}}`` for the model-state kinds."""
    out: dict = {}
    for kind in KINDS:
        cell = {}
        for tier in TIERS:
            now, peak = by_kind.get(f"{tier}.{kind}", 0), by_kind.get(f"peak.{tier}.{kind}", 0)
            if now or peak:
                cell[tier], cell[f"peak_{tier}"] = now, peak
        out[kind] = cell
    return out


# -- the driver ----------------------------------------------------------------------------
def outcore_tree() -> str:
    """The outcore code a row runs: HEAD's short hash, and a hash of uncommitted changes
    under outcore/ (``+dirty:<sha>``) when there are any."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=REPO).stdout

    head = git("rev-parse", "--short", "HEAD").strip() or "?"
    diff = git("diff", "HEAD", "--", "outcore")
    if not diff:
        return head
    return f"{head}+dirty:{hashlib.sha1(diff.encode()).hexdigest()[:10]}"


def run_row(spec: dict, args, root: Path, logs: Path, say) -> dict:
    """One row in a fresh process, each attempt after waiting for a quiet machine; rerun
    (``--retries``) when other processes took more than ``--max-other-cpu`` of the CPU during
    its measured steps, keeping the least disturbed attempt."""
    from train import run_child, wait_quiet

    name, best = spec["row"], {}
    for attempt in range(args.retries + 1):
        quiet = wait_quiet(args.wait_quiet) if args.wait_quiet > 0 else "no wait"
        folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
        tree = outcore_tree()
        say(f"[{time.strftime('%H:%M:%S')}] {name} ({quiet}; outcore {tree}) ...")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker",
               json.dumps({**spec, "nvme_path": str(folder)})]
        log = logs / f"{name}-{attempt}.log"
        try:
            res, err = run_child(cmd, log, args.row_timeout)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if err:
            say(f"  FAILED (log {log}):\n{err}")
            return best or {"row": name, "error": err}
        res["attempt"], res["wait"], res["outcore_tree"] = attempt, quiet, tree
        say(f"  {res['step_s']:.2f} s/step, {res['tokens_per_s']:.1f} tokens/s, peak RSS "
            f"{res['peak_rss'] / 2**30:.2f} GiB, steps {res['step_times_s']}, other CPU "
            f"{res['other_cpu']:.2f}")
        if not best or res["other_cpu"] < best["other_cpu"]:
            best = res
        if res["other_cpu"] <= args.max_other_cpu:
            break
    return best


def gb(n: float) -> str:
    return f"{n / 1e9:.3f}" if n < 1e8 else f"{n / 1e9:.2f}"


def cell(c: dict) -> str:
    """'5.26 nvme' / '0.05 dev + 0.01 host' (GB) for one kind's bytes per tier; '0' if none."""
    short = {"device": "dev", "host": "host", "nvme": "nvme"}
    parts = [f"{gb(c[t])} {short[t]}" for t in TIERS if c.get(t)]
    return " + ".join(parts) or "0"


def peak_cell(c: dict) -> str:
    parts = [f"{gb(c[f'peak_{t}'])} {t}" for t in TIERS if c.get(f"peak_{t}")]
    return " + ".join(parts) or "0"


def ledger_ram_peak(r: dict) -> int:
    """Host memory outcore's ledger counted at its peak over the measured steps: the host and
    device tiers' peaks added (both are RAM on a CPU-only host; an upper bound)."""
    return r["by_kind"].get("peak.host", 0) + r["by_kind"].get("peak.device", 0)


def table(result: dict) -> str:
    m = result["machine_info"]
    lines = [
        f"{result['model']} ({result['params_total'] / 1e6:.0f}M parameters), "
        f"{result['batch']} x {result['seq']} tokens/step, dtype {result['dtype']} "
        f"({m['cpu']}, {m['cores']} cores, torch {m['torch']}), {result['date']}",
        f"base (frozen) {result['base_bytes'] / 1e9:.2f} GB in {result['dtype']}; host "
        f"budget of the NVMe rows {result['host_budget_bytes'] / _MiB:.0f} MiB "
        f"(offload.host_buffer_bytes {result['host_buffer_bytes'] / _MiB:.0f} MiB + "
        f"zero.prefetch_bytes {result['prefetch_bytes'] / _MiB:.0f} MiB) = "
        f"{result['host_budget_bytes'] / result['base_bytes']:.1%} of the base",
        "",
        "| row | placement | s/step | tokens/s | peak RSS GiB (process / steps) | RAM in "
        "outcore's ledger, peak GB | device GB | host GB | nvme GB | params | master | "
        "optimizer | grads (peak) | NVMe read / written GB per step | other CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {LABEL[r['row']]} | failed: {r['error'].splitlines()[0]} |")
            continue
        k, t = r["kinds"], r["tiers"]
        p = r["placement"]
        lines.append(
            f"| {r['label']} | params={p['params']}, optimizer={p['optimizer']} | "
            f"{r['step_s']:.2f} | {r['tokens_per_s']:.1f} | "
            f"{r['peak_rss'] / 2**30:.2f} / {r['rss_steps_peak'] / 2**30:.2f} | "
            f"{gb(ledger_ram_peak(r)) if r['by_kind'] else '—'} | "
            f"{gb(t['device'])} | {gb(t['host'])} | {gb(t['nvme'])} | "
            f"{cell(k['params'])} | {cell(k['master'])} | {cell(k['optimizer'])} | "
            f"{peak_cell(k['grads'])} | "
            f"{gb(r['store_read_per_step'])} / {gb(r['store_write_per_step'])} | "
            f"{r['other_cpu']:.2f} |")
    lines += ["", "Tiers and kinds from engine.memory_report() after the last step (on a "
              "CPU-only host the 'device' tier is host memory too); grads: the ledger's peak "
              "over the measured steps; RAM in outcore's ledger: "
              "the peaks of its host and device tiers over the measured steps, added (an upper "
              "bound: gathered parameters, their kept buffers, I/O buffers, state, gradients); "
              "other CPU: the share of the machine's CPU other processes "
              "took during the measured steps."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="gpt-1.3b", help="outcore.app.models preset")
    ap.add_argument("--rows", default="lora-mem,lora-nvme,lora-nvme+opt,full-nvme",
                    help=f"comma-separated subset of {','.join(ROWS)}")
    ap.add_argument("--lora", default=DEFAULT_SPEC, help="outcore.hf.lora spec")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per row, warm-up included (default 4; --tiny: 3)")
    ap.add_argument("--warmup", type=int, default=1, help="steps not measured")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    ap.add_argument("--host-buffer-mib", type=int, default=64,
                    help="offload.host_buffer_bytes of the NVMe rows")
    ap.add_argument("--prefetch-mib", type=int, default=256,
                    help="zero.prefetch_bytes of the NVMe rows")
    ap.add_argument("--nvme", type=Path, default=OUT / "swap-lora",
                    help="folder for the rows' swap folders (removed after each row)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--row-timeout", type=float, default=1800)
    ap.add_argument("--wait-quiet", type=float, default=0,
                    help="before each row, wait up to this many seconds for an idle CPU and "
                         "disk (bench/train.py's wait_quiet; 0: no wait)")
    ap.add_argument("--max-other-cpu", type=float, default=0.2,
                    help="rerun a row if other processes used more of the CPU than this")
    ap.add_argument("--retries", type=int, default=0, help="reruns of a disturbed row")
    ap.add_argument("--probe", action="store_true",
                    help="measure the disk and matmul peak on --nvme first (outcore probe)")
    ap.add_argument("--logs", type=Path, default=None,
                    help="folder for the rows' logs (default bench/out/logs/lora-<time>)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--set", dest="outcore_set", action="append", default=[],
                    metavar="KEY=JSON", help="outcore config override for every row, e.g. "
                    "--set offload.reuse_freed_memory=false (repeatable)")
    ap.add_argument("--frozen-init", action=argparse.BooleanOptionalAction, default=True,
                    help="build the LoRA rows' base under outcore.init(cfg, frozen=True) "
                         "(default; --no-frozen-init: the ordinary build)")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny model, 2 x 64 tokens, 1 MiB budgets: checks the script")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    sys.path.append(str(REPO / "bench"))  # train.py's wait_quiet; after the standard library
    if args.worker:
        res = worker(json.loads(args.worker))
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    from train import parse_set

    from outcore.config import merge_mappings

    overrides: dict = {}
    for one in args.outcore_set:
        overrides = merge_mappings(overrides, parse_set(one))
    if args.tiny:
        args.model, args.batch, args.seq = "tiny", 2, 64
        args.host_buffer_mib, args.prefetch_mib = 1, 1
    if args.steps is None:
        args.steps = 3 if args.tiny else 4
    if not 0 <= args.warmup < args.steps:
        ap.error(f"--warmup {args.warmup} must leave at least one of {args.steps} steps")
    rows = [r for r in args.rows.split(",") if r]
    if unknown := sorted(set(rows) - set(ROWS)):
        ap.error(f"unknown rows {unknown}; choose from {','.join(ROWS)}")

    from outcore.device.compute_dtype import planned
    from outcore.device.machine import describe

    dtype = planned(args.dtype).name
    info = {**describe(dtype), "threads": args.threads}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = args.logs or OUT / "logs" / f"lora-{stamp}"
    logs.mkdir(parents=True, exist_ok=True)
    root = args.nvme.resolve()
    made_root = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    say(f"{info['cpu']} ({', '.join(k for k, v in info['cpu_features'].items() if v)}), "
        f"{info['cores']} cores, torch {info['torch']}, dtype {dtype} (--dtype {args.dtype}); "
        f"{args.model}, {args.batch} x {args.seq} tokens, {args.steps} steps "
        f"({args.warmup} warm-up); swap under {root}; logs in {logs}")
    probe = None
    if args.probe:
        from outcore.sizing.probe import measure

        folder = Path(tempfile.mkdtemp(prefix="probe-", dir=root))
        try:
            probe = measure(str(folder)).to_json()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        say(f"probe: disk read {probe['disk_read_GBps']:.2f} GB/s, write "
            f"{probe['disk_write_GBps']:.2f} GB/s, matmul fp32 "
            f"{probe['matmul_fp32_TFLOPs']:.3f} TFLOP/s")

    results = []
    try:
        for name in rows:
            spec = {"row": name, "model": args.model, "batch": args.batch, "seq": args.seq,
                    "steps": args.steps, "warmup": args.warmup, "dtype": dtype,
                    "lora": args.lora, "threads": args.threads,
                    "frozen_init": args.frozen_init, "outcore_set": overrides,
                    "host_buffer_bytes": args.host_buffer_mib * _MiB,
                    "prefetch_bytes": args.prefetch_mib * _MiB}
            results.append(run_row(spec, args, root, logs, say))
    finally:
        if made_root and not any(root.iterdir()):
            root.rmdir()

    ok = [r for r in results if "error" not in r]
    lora_ok = [r for r in ok if r["lora"]]
    ref = lora_ok[0] if lora_ok else (ok[0] if ok else {})
    budget = (args.host_buffer_mib + args.prefetch_mib) * _MiB
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None
        else " ".join(["bench/lora.py", *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine_info": info, "dtype": dtype,
        "model": args.model, "batch": args.batch, "seq": args.seq, "steps": args.steps,
        "warmup": args.warmup, "lora": args.lora, "outcore_set": overrides,
        "frozen_init": args.frozen_init,
        "params_total": ref.get("params_total", 0),
        # the LoRA rows' frozen base (without one: the whole model) in the compute dtype
        "base_bytes": ref.get("base_bytes") or ref.get("params_total", 0) * ref.get(
            "compute_itemsize", 0),
        "adapter_params": ref.get("params_trainable", 0) if lora_ok else 0,
        "host_buffer_bytes": args.host_buffer_mib * _MiB,
        "prefetch_bytes": args.prefetch_mib * _MiB,
        "host_budget_bytes": budget,
        "base_fits_budget": bool(ref) and ref.get("base_bytes", 0) <= budget,
        "probe": probe, "rows": results,
    }
    if ok:
        say("\n" + table(result))
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
