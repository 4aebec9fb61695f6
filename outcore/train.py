"""``outcore train``: the main job. With no arguments it trains the ``small`` GPT preset on the
standard library's Python source, with parameters and optimizer states on NVMe.

The CLI wires ``add_arguments`` and ``run`` into ``outcore train``; everything here is also
usable from Python (``run(parser.parse_args([...]))``).

[Note: where settings come from]
Job defaults < the ``--config`` file < command-line flags. A flag's argparse default is None so
that "not given" is visible and the file's value survives. The config file holds the engine's
keys (``dtype``, ``optimizer``, ``offload`` ...) and may add a ``train:`` section with the job's
own keys (``model``, ``data``, ``steps``, ``batch`` ...), which are not engine config.

[Note: resume reproduces the uninterrupted run]
Everything that decides step s+1 is either in the engine's checkpoint (weights, optimizer
state, RNG states) or a pure function of s: the batch (data.BatchSampler, whose state is the
step) and the learning rate (the schedule). So a run resumed from step s computes exactly the
losses the uninterrupted run computed after s. The client state also carries the seed, so a
resume without ``--seed`` uses the original one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from outcore import data as datamod
from outcore import models
from outcore.errors import ConfigError, OutcoreError
from outcore.report import MetricsWriter, read_metrics, write_report
from outcore.units import format_bytes, format_count

__all__ = ["JOB_DEFAULTS", "add_arguments", "run"]

JOB_DEFAULTS: dict[str, Any] = {
    "model": "small", "data": None, "steps": 300, "save_every": 100, "out": "./outcore-run",
    "batch": 8, "seq": None, "offload": "nvme", "lr_schedule": "cosine",
}
"""The job's own settings when neither a flag nor the config file's ``train:`` section sets them."""

_ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "bf16",  # AMX/tensor cores: ~2x the fp32 step rate on the test machine
    "optimizer": {"type": "adamw", "betas": [0.9, 0.95], "weight_decay": 0.0},
    "gradient_clipping": 1.0,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``outcore train``'s options; defaults are None so the config file can set them."""
    a = parser.add_argument
    a("--model", help="preset (" + ", ".join(models.PRESETS) + ") or a local Hugging Face "
      "model folder (default: small)")
    a("--data", help="text file or folder of text files (default: the Python standard "
      "library's source)")
    a("--config", help="JSON or YAML config; flags override it")
    a("--offload", choices=["none", "cpu", "nvme", "auto"],
      help="tier for parameters and optimizer states (default: nvme)")
    a("--nvme-path", help="folder for swap files (default: OUT/swap)")
    a("--steps", type=int, help="optimizer steps to train in total (default: 300)")
    a("--save-every", type=int, help="checkpoint every N steps, and at the end (default: 100)")
    a("--out", help="folder for metrics, checkpoints, report and swap (default: ./outcore-run)")
    a("--resume", action="store_true", help="continue from the latest complete checkpoint in OUT")
    a("--seed", type=int, help="seed for weights and data (default: 0; on resume: the run's)")
    a("--batch", type=int, help="sequences per rank per micro-step (default: 8)")
    a("--seq", type=int, help="tokens per sequence (default: the model's, at most 256)")
    a("--lr", type=float, help="peak learning rate (default: 1e-3 for small presets)")
    a("--lr-schedule", choices=["cosine", "constant"],
      help="warmup then cosine decay to 10%%, or constant (default: cosine)")
    a("--dtype", choices=["bf16", "fp16", "fp32"], help="compute dtype (default: bf16)")


# -- settings ------------------------------------------------------------------------------
def _read_config_file(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"--config: cannot read {p}: {e.strerror or e}") from None
    import yaml

    try:
        loaded = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"--config: {p} is not valid {p.suffix or 'YAML'}: {e}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config: {p} must hold a mapping of keys, not {type(loaded).__name__}")
    return loaded


def _job_settings(args: argparse.Namespace, file_job: dict[str, Any]) -> dict[str, Any]:
    unknown = set(file_job) - set(JOB_DEFAULTS)
    if unknown:
        raise ConfigError(f"unknown config key 'train.{sorted(unknown)[0]}'; allowed keys here: "
                          + ", ".join(sorted(JOB_DEFAULTS)))
    job = {**JOB_DEFAULTS, **file_job}
    for key in JOB_DEFAULTS:
        if getattr(args, key, None) is not None:
            job[key] = getattr(args, key)
    for key in ("steps", "save_every", "batch", "seq"):
        value = job[key]
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"--{key.replace('_', '-')}: must be a whole number >= 1, "
                              f"got {value!r}")
    if job["offload"] not in ("none", "cpu", "nvme", "auto"):
        raise ConfigError(f"train.offload: got {job['offload']!r}; allowed: none, cpu, nvme, auto")
    job["out"] = Path(job["out"])
    return job


def _default_lr(model: str, n_params: int) -> float:
    if models.is_hf_folder(model):
        return 1e-4  # fine-tuning: a pretrained-sized model wants a gentle step
    return 1e-3 if n_params < 50e6 else 3e-4


def _engine_config(args: argparse.Namespace, file_cfg: dict[str, Any], job: dict[str, Any],
                   n_params: int) -> Any:
    import outcore

    cfg = outcore.Config.from_dict(_merge(_ENGINE_DEFAULTS, file_cfg))
    over: dict[str, Any] = {"offload": {}}
    if args.nvme_path is not None or not cfg.offload.nvme_path:
        over["offload"]["nvme_path"] = str(args.nvme_path or job["out"] / "swap")
    if args.offload is not None or "offload" not in file_cfg or job["offload"] == "auto":
        tier = job["offload"]
        if tier == "auto":
            over["offload"].update(_auto_offload(n_params))
        else:
            over["offload"].update(params=tier, optimizer=tier)
    if args.lr is not None:
        over.setdefault("optimizer", {})["lr"] = args.lr
    elif "lr" not in file_cfg.get("optimizer", {}):
        over.setdefault("optimizer", {})["lr"] = _default_lr(job["model"], n_params)
    if args.dtype is not None:
        over["dtype"] = args.dtype
    if args.seed is not None:
        over["seed"] = args.seed
    return cfg.with_overrides(over)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# [Note: --offload auto]
# Model states of mixed-precision AdamW take ~2 bytes/param (training-dtype weights) plus ~16
# (fp32 master, gradient, two moments). Each kind goes to the fastest tier where it fits in 40%
# of that tier's free memory (leaving room for activations and the I/O buffer pool): device
# ("none"), then host ("cpu", only distinct from the device with a GPU), then NVMe.
def _auto_offload(n_params: int) -> dict[str, str]:
    import psutil

    host_free = psutil.virtual_memory().available
    dev_free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else host_free
    plan = {}
    for kind, per_param in (("params", 2), ("optimizer", 16)):
        need = per_param * n_params
        if need <= 0.4 * dev_free:
            plan[kind] = "none"
        elif torch.cuda.is_available() and need <= 0.4 * host_free:
            plan[kind] = "cpu"
        else:
            plan[kind] = "nvme"
        _say(f"auto offload: {kind} need {format_bytes(need)}; device free "
             f"{format_bytes(dev_free)}, host free {format_bytes(host_free)} -> {plan[kind]}")
    return plan


# -- model and data ------------------------------------------------------------------------
def _describe_model(name: str) -> tuple[int, int]:
    """(parameter count, longest sequence) without building the model."""
    if models.is_hf_folder(name):
        hf = json.loads((Path(name) / "config.json").read_text())
        seq = int(hf.get("max_position_embeddings") or hf.get("n_positions") or 1024)
        from outcore.estimate import shape_from_hf_config

        return int(shape_from_hf_config(Path(name)).params), seq
    cfg = models.resolve_config(name)
    return models.num_params(cfg), cfg.seq_len


def _build(name: str) -> nn.Module:
    return models.load_hf_model(name) if models.is_hf_folder(name) else models.build_model(name)


def _lr_at(step: int, total: int, peak: float, schedule: str) -> float:
    """Learning rate of optimizer step ``step`` (1-based): a pure function, for exact resume."""
    if schedule == "constant":
        return peak
    warmup = max(1, min(100, total // 10))
    if step <= warmup:
        return peak * step / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


# -- the job -------------------------------------------------------------------------------
def _say(text: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(text, file=sys.stderr, flush=True)


def _global_mean(value: float, world_size: int) -> float:
    if world_size == 1 or not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / world_size


def _checkpoint_api() -> Any:
    import outcore

    if not hasattr(outcore, "latest_checkpoint"):
        raise OutcoreError("this build of outcore has no checkpoints (outcore.latest_checkpoint)")
    return outcore.latest_checkpoint


def run(args: argparse.Namespace) -> int:
    """Train as ``args`` say; returns the exit code. User mistakes raise ConfigError/DataError."""
    import outcore

    file_cfg = _read_config_file(args.config)
    job = _job_settings(args, file_cfg.pop("train", None) or {})
    n_params, max_seq = _describe_model(job["model"])
    seq = job["seq"] or min(256, max_seq)
    if seq > max_seq:
        raise ConfigError(f"--seq: {seq} exceeds the model's longest sequence {max_seq}")
    cfg = _engine_config(args, file_cfg, job, n_params)
    out: Path = job["out"]
    ckpt_root = out / "checkpoints"
    latest = _checkpoint_api()(ckpt_root) if args.resume else None
    if args.resume and latest is None:
        _say(f"--resume: no complete checkpoint in {ckpt_root}; starting from step 0")

    tokens = datamod.load_tokens(job["data"])  # before any swap file exists: fail fast
    train_tokens, _ = datamod.split_tokens(tokens)
    is_hf = models.is_hf_folder(job["model"])

    out.mkdir(parents=True, exist_ok=True)  # the default swap folder lives inside it
    torch.manual_seed(cfg.seed)
    with outcore.init(cfg):
        model = _build(job["model"])
    with outcore.initialize(model, cfg) as engine:
        rank, world = engine.rank, engine.world_size
        client: dict[str, Any] = {}
        if latest is not None:
            client = engine.load_checkpoint(latest) or {}
            if client.get("model") not in (None, job["model"]):
                raise ConfigError(f"--resume: {latest} is a checkpoint of model "
                                  f"{client['model']!r}, not {job['model']!r}")
        seed = args.seed if args.seed is not None else int(client.get("seed", cfg.seed))
        accum = cfg.gradient_accumulation_steps
        sampler = datamod.BatchSampler(train_tokens, job["batch"], seq, seed, rank, world)
        if "sampler" in client:
            sampler.load_state_dict(client["sampler"])
        start = int(client.get("step", 0))
        state = {"elapsed": float(client.get("elapsed_s", 0.0)), "seed": seed}

        src = job["data"] or "the Python standard library's source"
        _say(f"outcore train: {job['model']} ({format_count(n_params)} params), {world} rank(s), "
             f"dtype {cfg.dtype}, offload params={cfg.offload.params} "
             f"optimizer={cfg.offload.optimizer}\n  data: {src} ({format_bytes(len(tokens))}), "
             f"batch {job['batch']}x{seq} per rank x{accum} accumulation\n  out: {out}"
             + (f" (resuming at step {start})" if start else ""))
        metrics = MetricsWriter(out / "metrics.jsonl", resume_step=start) if rank == 0 else None
        try:
            _loop(engine, sampler, job, seq, start, state, metrics, is_hf)
        finally:
            if metrics is not None:
                metrics.close()
        if rank == 0:
            _finish(out, job, n_params, start)
    return 0


def _loop(engine: Any, sampler: datamod.BatchSampler, job: dict[str, Any], seq: int, start: int,
          state: dict[str, Any], metrics: MetricsWriter | None, is_hf: bool) -> None:
    """Optimizer steps ``start+1 .. steps``, with metrics, progress and checkpoints."""
    from tqdm import tqdm

    steps, accum, world = job["steps"], engine.cfg.gradient_accumulation_steps, engine.world_size
    peak_lr = engine.cfg.optimizer.lr
    tokens_per_step = job["batch"] * seq * accum * world
    bar = tqdm(total=steps, initial=min(start, steps), unit="step", dynamic_ncols=True,
               disable=engine.rank != 0, file=sys.stderr)
    try:
        for step in range(start + 1, steps + 1):
            lr = _lr_at(step, steps, peak_lr, job["lr_schedule"])
            for group in engine.param_groups:
                group["lr"] = lr
            t0 = time.perf_counter()
            total = 0.0
            for _ in range(accum):
                x, y = sampler.next()
                out = engine(input_ids=x, labels=x) if is_hf else engine(x, y)
                loss = out.loss if is_hf else out
                engine.backward(loss)
                total += float(loss.detach().float())
            engine.step()
            loss_value = _global_mean(total / accum, world)
            dt = time.perf_counter() - t0
            state["elapsed"] += dt
            mem = engine.memory_report()
            record = {"step": step, "loss": loss_value, "tokens_per_s": tokens_per_step / dt,
                      "lr": lr, "elapsed_s": round(state["elapsed"], 3),
                      **{f"bytes_{t}": int(mem[t]) for t in ("device", "host", "nvme")}}
            if metrics is not None:
                metrics.write(record)
            bar.set_postfix_str(
                f"loss {loss_value:.3f}, {record['tokens_per_s']:,.0f} tok/s, "
                + ", ".join(f"{t} {format_bytes(mem[t])}" for t in ("device", "host", "nvme")),
                refresh=False)
            bar.update(1)
            if step % job["save_every"] == 0 or step == steps:
                _save(engine, sampler, job, step, state)
    finally:
        bar.close()


def _save(engine: Any, sampler: datamod.BatchSampler, job: dict[str, Any], step: int,
          state: dict[str, Any]) -> None:
    client = {"step": step, "sampler": sampler.state_dict(), "seed": state["seed"],
              "model": job["model"], "elapsed_s": state["elapsed"]}
    engine.save_checkpoint(job["out"] / "checkpoints" / f"step-{step:08d}", client_state=client)


def _finish(out: Path, job: dict[str, Any], n_params: int, start: int) -> None:
    """Write the report and print the summary (rank 0)."""
    records = read_metrics(out / "metrics.jsonl")
    png = write_report(out / "metrics.jsonl", out / "report.png",
                       title=f"outcore train: {job['model']} ({format_count(n_params)} params)")
    if not records:
        _say(f"no steps recorded; report: {png}")
        return
    this_run = [r for r in records if r["step"] > start] or records
    # Every step moves the same number of tokens, so the run's rate is the harmonic mean.
    tok_s = len(this_run) / sum(1.0 / r["tokens_per_s"] for r in this_run)
    latest = _checkpoint_api()(out / "checkpoints")
    _say(f"done: {records[-1]['step']} steps, loss {records[0]['loss']:.3f} -> "
         f"{records[-1]['loss']:.3f}, {tok_s:,.0f} tokens/s, "
         f"{records[-1]['elapsed_s']:.0f} s of training\n"
         f"  metrics: {out / 'metrics.jsonl'}\n  report: {png}\n  checkpoint: {latest}")
