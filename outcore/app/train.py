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
import contextlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from outcore.app import blocks, models, saves
from outcore.app import data as datamod
from outcore.app import job as jobs
from outcore.app import lora as loramod
from outcore.app.evaluate import EVAL_BATCHES, held_out_loss
from outcore.app.job import JOB_DEFAULTS, LR_SCHEDULES
from outcore.app.job import job_settings as _job_settings
from outcore.app.ranks import global_mean, say
from outcore.app.report import MetricsWriter, read_metrics, write_report
from outcore.config import Config, merge_mappings
from outcore.engine import initialize
from outcore.engine.lifetime import check_swap_space
from outcore.errors import CommError, ConfigError
from outcore.guard.lock import lock_run_folder
from outcore.guard.preemption import Preemption, preemption, with_hangup
from outcore.io.manifest import latest_checkpoint, read_client_state
from outcore.offload.nvme import MADE_MARK, remove_if_left_empty
from outcore.offload.storage import Tier
from outcore.sizing.estimate import shape_from_hf_config
from outcore.sizing.placement import check_fits
from outcore.units import format_bytes, format_count
from outcore.zero.init import init

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""Signals answered with a stop and a checkpoint at the next step boundary. SIGUSR1 is SLURM's
usual ``--signal=USR1@<seconds>`` warning; its default action ends a run mid-step, with no
checkpoint and its swap left behind. It stops as SIGTERM does (exit 75: preempted), and so
does SIGHUP where the run was not started ignoring it (``with_hangup``)."""

__all__ = ["JOB_DEFAULTS", "add_arguments", "run"]


_ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "auto",  # compute_dtype.py: bf16 where native, else fp32 (fp16 on older GPUs)
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
    a("--lr-schedule", choices=LR_SCHEDULES,
      help="warmup then cosine decay to 10%%, or constant (default: cosine)")
    a("--dtype", choices=["auto", "bf16", "fp16", "fp32"],
      help="compute dtype (default: auto, the fastest this device multiplies natively)")
    a("--checkpoint-activations", metavar="auto|on|off|N", type=_checkpoint_mode,
      help="keep only a block's input for backward and recompute the rest: in every block "
      "(on), in none (off) or in the first N (default: auto, the fewest first blocks that keep "
      "the model's activations under 1/8 of the memory left to them)")
    a("--offload-activations", choices=list(blocks.ACTIVATION_PLACES),
      help="keep what each block saves for backward in the swap folder (nvme) or, on a GPU, "
      "in host memory (cpu) instead of in memory, recomputing nothing; blocks checkpointed "
      "keep their input only, and auto then checkpoints none (default: off)")
    a("--lora", metavar="SPEC", help="train LoRA adapters over the frozen --model HF_FOLDER, "
      "e.g. r=8,alpha=16,targets=q_proj,v_proj (keys r, alpha, dropout, targets; peft's "
      "module names); writes them in PEFT's format to OUT/adapter at the end")


# -- settings ------------------------------------------------------------------------------
def _checkpoint_mode(text: str) -> str | int:
    """``--checkpoint-activations``: auto, on, off, or a number of blocks."""
    try:
        return blocks.checkpoint_mode(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _default_lr(model: str, n_params: int) -> float:
    if models.is_hf_folder(model):
        return 1e-4  # fine-tuning: a pretrained-sized model wants a gentle step
    return 1e-3 if n_params < 50e6 else 3e-4


def _engine_config(args: argparse.Namespace, file_cfg: dict[str, Any], job: dict[str, Any],
                   n_params: int, trainable: int | None = None) -> Config:
    """The engine's Config: job defaults < file < flags (see [Note: where settings come from]).

    ``--offload`` is shorthand for both placements; without the flag, a placement the file
    names explicitly wins over the job's default tier. ``auto`` asks ``Config.auto`` to choose
    from the model size and this machine's free memory and disk (it prints the plan and why).
    """
    for key in ("offload", "optimizer"):  # merged below, a non-mapping would vanish
        value = file_cfg.get(key)
        if value is None:
            file_cfg.pop(key, None)  # YAML's empty "optimizer:" would replace the defaults
        elif not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {key} settings, got {value!r}")

    def section(key: str) -> dict[str, Any]:
        return file_cfg.get(key) or {}

    file_off, over = section("offload"), {"offload": {}}
    if args.nvme_path == "":
        raise ConfigError("--nvme-path: expected a folder for swap files, got ''")
    if args.nvme_path is not None or not file_off.get("nvme_path"):
        over["offload"]["nvme_path"] = str(args.nvme_path or job["out"] / "swap")
    tier = job["offload"]
    if tier != "auto":
        for kind in ("params", "optimizer"):
            if args.offload is not None or kind not in file_off:
                over["offload"][kind] = tier
    if args.lr is not None or "lr" not in section("optimizer"):
        lr = args.lr if args.lr is not None else _default_lr(job["model"], n_params)
        over["optimizer"] = {"lr": lr}
    if args.dtype is not None:
        over["dtype"] = args.dtype
    if args.seed is not None:
        over["seed"] = args.seed
    merged = merge_mappings(merge_mappings(_ENGINE_DEFAULTS, file_cfg), over)
    if tier != "auto":
        return Config.from_dict(merged)
    nvme_path = merged["offload"]["nvme_path"]
    merged["offload"] = {k: v for k, v in merged["offload"].items()
                         if k not in ("params", "optimizer")}  # the plan decides these
    return Config.auto(n_params, Config.from_dict(merged),
                       world_size=int(os.environ.get("WORLD_SIZE", "1")), nvme_path=nvme_path,
                       trainable=trainable)


# -- model and data ------------------------------------------------------------------------
def _describe_model(name: str) -> tuple[int, int, int]:
    """(parameter count, longest sequence, vocabulary size) without building the model."""
    if models.is_hf_folder(name):
        params = int(shape_from_hf_config(Path(name)).params)  # a broken file: one line
        models.load_hf_config(name)  # an architecture transformers cannot build: one line
        hf = json.loads((Path(name) / "config.json").read_text())
        seq = int(hf.get("max_position_embeddings") or hf.get("n_positions") or 1024)
        vocab = int(hf.get("vocab_size") or 0)
        return params, seq, vocab
    cfg = models.resolve_config(name)
    return models.num_params(cfg), cfg.seq_len, cfg.vocab


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
def _activations_line(checkpointed: int, offloaded: int, place: str) -> str:
    """The banner's line on activations, or nothing where every block keeps its own."""
    parts = []
    if checkpointed:  # a checkpointed block is no longer offloaded: checkpointing replaced it
        parts.append(f"{checkpointed} block{'s' * (checkpointed != 1)} checkpointed (inputs "
                     "kept, the rest recomputed in backward)")
    if offloaded > checkpointed:
        parts.append(f"{offloaded - checkpointed} block{'s' * (offloaded - checkpointed != 1)}"
                     f" offloaded to {'NVMe' if place == 'nvme' else 'host memory'} "
                     "(everything saved for backward)")
    elif place == "cpu" and not offloaded:
        parts.append("in host memory already on a CPU device (--offload-activations cpu moves "
                     "nothing)")
    elif place != "off" and not offloaded:
        parts.append("no repeated blocks found to offload (a Hugging Face model's "
                     "_no_split_modules, a preset's blocks)")
    return f"\n  activations: {'; '.join(parts)}" if parts else ""


def run(args: argparse.Namespace) -> int:
    """Train as ``args`` say; returns the exit code. User mistakes raise ConfigError/DataError."""

    file_cfg, under = jobs.read_config_file(args.config)
    job = _job_settings(args, file_cfg.get("train") or {})  # YAML's empty "train:" is None
    jobs.check_out(job["out"])
    latest = latest_checkpoint(job["out"] / "checkpoints") if args.resume else None
    changed: list[str] = []
    client: dict[str, Any] = {}
    if latest is not None:  # the run's own settings, where not given again (job.py's note)
        client = read_client_state(latest)
        file_cfg, changed = jobs.resumed_settings(args, file_cfg, client)
        job = _job_settings(args, file_cfg.get("train") or {})
    file_cfg = merge_mappings(under, file_cfg)  # a DeepSpeed file's defaults (job.py)
    record = jobs.run_record(args, file_cfg)  # what a resume of this run starts from
    file_cfg = {k: v for k, v in file_cfg.items() if k != "train"}
    lora = loramod.prepare(job["lora"], job["model"])  # a typo fails before the build
    if latest is not None:  # from the manifest alone, before the build
        changed += jobs.check_resume(latest, client, job["model"], job["steps"], job["batch"])
        loramod.check_resume(lora, latest)
    for line in changed:
        say(f"--resume: {line}")
    n_params, max_seq, vocab = _describe_model(job["model"])
    seq = job["seq"] or min(256, max_seq)
    if seq > max_seq:
        raise ConfigError(f"--seq: {seq} exceeds the model's longest sequence {max_seq}")
    trainable = lora.trainable if lora is not None else None  # a LoRA base is frozen
    cfg = _engine_config(args, file_cfg, job, n_params, trainable)
    record["effective"] = {  # what the run ran with, for a resume to name what it changes
        **{k: job[k] for k in jobs.RUN_OPTIONS if k in job and job[k] is not None},
        "offload": jobs.placement(job["offload"], cfg), "seq": seq, "lr": cfg.optimizer.lr,
        "dtype": cfg.dtype,
        "data": str(Path(job["data"]).resolve()) if job["data"] else None}
    for line in jobs.drifted(client, record["effective"], changed) if latest is not None else []:
        say(f"--resume: {line}")
    jobs.warn_unused_nvme_path(args, cfg, job)
    caution = check_fits(cfg, n_params, int(os.environ.get("WORLD_SIZE", "1")),  # before the build
                         trainable=trainable)
    if caution:
        say(caution)
    # a second run on OUT stops here (guard/lock.py's [Note: two runs, one folder]); whatever
    # ends the run below, the folder is given back, and removed if this run made it and a
    # failure left it empty
    out = job["out"]  # rank 0 makes it and its missing parents (guard/lock.py); the others
    missing = ([p for p in (out, *out.parents) if not p.exists()]  # leave clean-up to it
               if int(os.environ.get("RANK", "0")) == 0 else [])
    try:
        with lock_run_folder(out, cfg.comm.timeout_s):
            return _run_holding_out(args, job, cfg, n_params, vocab, seq, lora, record)
    except BaseException as e:  # other ranks' swap folders go as their engines close, a
        swap, world = out / "swap", int(os.environ.get("WORLD_SIZE", "1"))  # dead one's never
        deadline = time.monotonic() + (10 if world > 1 and not isinstance(e, CommError) else 0)
        while missing and swap.is_dir() and time.monotonic() < deadline and any(
                p.name != MADE_MARK for p in swap.iterdir()):
            time.sleep(0.05)
        if missing:  # rank 0 made OUT: an empty swap in it is the job's, marked or not
            remove_if_left_empty(swap)
        for folder in [swap, *missing] if missing else []:
            with contextlib.suppress(OSError):  # not empty: kept
                folder.rmdir()
        raise


def _run_holding_out(args: argparse.Namespace, job: dict[str, Any], cfg: Config, n_params: int,
                     vocab: int, seq: int, lora: loramod.LoraJob | None,
                     record: dict[str, Any]) -> int:
    """The run itself, with ``--out`` held: data, model, training, the report."""
    out: Path = job["out"]
    ckpt_root = out / "checkpoints"
    latest = latest_checkpoint(ckpt_root)
    if latest is not None and not args.resume:
        # its checkpoints would mix with this run's, and a later --resume pick the wrong one
        raise ConfigError(f"--out {out} holds the checkpoints of an earlier run (latest: "
                          f"{latest.name}); add --resume to continue it, or give another --out")
    if args.resume and latest is None:
        say(f"--resume: no complete checkpoint in {ckpt_root}; starting from step 0 with "
             f"this command's settings (model {job['model']}, data {job['data'] or 'default'}):"
             " a run's own are recorded in its checkpoints only")

    # before any swap file: fail fast
    tokens, tokenized_by = datamod.job_tokens(job, vocab, cfg.offload.nvme_path)
    train_tokens, held_out = datamod.split_tokens(tokens)
    is_hf = models.is_hf_folder(job["model"])

    out.mkdir(parents=True, exist_ok=True)  # the default swap folder lives inside it
    torch.manual_seed(cfg.seed)
    # a LoRA base is born frozen, never with an fp32 master (param.py), and read in place
    # from the folder's own files when it lives on NVMe (zero/deferred.py, offload/file_shard.py)
    weights = job["model"] if is_hf and models.hf_has_weights(job["model"]) else None
    if weights is not None:
        say(f"fine-tuning: {'reading' if lora is not None else 'loading'} the weights in "
             f"{job['model']}")
    building = init(cfg, frozen=lora is not None, weights=weights)
    with building:
        # the swap's room, on every rank, before the build writes to it (lifetime.py's note);
        # a LoRA base with weights takes none: it is read in place from its own files
        assert building.runtime is not None
        trainable = lora.trainable if lora is not None else n_params
        stored = trainable if lora is not None and weights is not None else n_params
        check_swap_space(building.runtime, stored, trainable)
        model = _build(job["model"])
    try:  # until initialize takes the runtime, a failure here must close it (its swap file)
        if lora is not None:  # before the engine: its optimizer gets the adapters only
            torch.manual_seed(cfg.seed)  # the adapters' init, whatever the base's build drew
            model = loramod.wrap(model, lora, job["model"])
        # offloaded blocks keep no activations in memory: auto has nothing to checkpoint then
        offloaded = blocks.offload_blocks(model, job["offload_activations"])
        mode = job["checkpoint_activations"]
        checkpointed = blocks.checkpoint_blocks(model, "off" if offloaded and mode == "auto"
                                                else mode, job["batch"], seq)
    except BaseException:
        if building.runtime is not None:
            building.runtime.close()
        raise
    # SIGTERM, SIGUSR1 or Ctrl-C: finish the step, save, close (swap removed), then exit 75
    # or 130 (see STOP_SIGNALS)
    with preemption(with_hangup(STOP_SIGNALS)) as stop, initialize(model, cfg) as engine:
        rank, world = engine.rank, engine.world_size
        client: dict[str, Any] = {}
        if latest is not None:
            client = jobs.load_latest(engine, latest)
        seed = args.seed if args.seed is not None else int(client.get("seed", cfg.seed))
        accum = cfg.gradient_accumulation_steps
        sampler = datamod.BatchSampler(train_tokens, job["batch"], seq, seed, rank, world)
        if "sampler" in client:
            sampler.load_state_dict(client["sampler"])
        start = int(client.get("step", 0))
        state = {"elapsed": float(client.get("elapsed_s", 0.0)), "seed": seed, "run": record,
                 "lora": lora.client_state() if lora is not None else None}

        src = job["data"] or "the Python standard library's source"
        say(f"outcore train: {job['model']} ({format_count(n_params)} params), {world} rank(s), "
             f"dtype {engine.dtype_choice}, offload params={cfg.offload.params} "
             f"optimizer={cfg.offload.optimizer}\n  data: {src} ({format_count(len(tokens))} "
             f"tokens: {tokenized_by}), "
             f"batch {job['batch']}x{seq} per rank x{accum} accumulation\n  out: {out}"
             + (f" (resuming at step {start})" if start else "")
             + (f"\n  {loramod.describe(model, lora)}" if lora is not None else "")
             + _activations_line(checkpointed, offloaded, job["offload_activations"]))
        metrics = MetricsWriter(out / "metrics.jsonl", resume_step=start) if rank == 0 else None
        try:
            stopped_at = _loop(engine, sampler, job, seq, start, state, metrics, is_hf, stop)
        finally:
            if metrics is not None:
                metrics.close()
        lines: list[str] = []
        if stopped_at is None:  # every rank: each forward is a collective
            held = held_out_loss(engine, held_out, job["batch"], seq, is_hf)
            if held is not None:
                lines.append(f"  held-out loss: {held:.3f} (the last 1% of the data, "
                             f"{EVAL_BATCHES} batches)")
        if lora is not None and stopped_at is None:  # at the end only; every rank writes
            lines += [loramod.save(engine, model, out), loramod.memory_line(engine)]
        if rank == 0 and stopped_at is None:
            _finish(out, job, n_params, start, lines)
        engine.close(keep_values=False)  # the checkpoints hold the model: no hand-back
    if stopped_at is not None:
        return saves.stopped(stop, stopped_at, ckpt_root)
    return 0


def _loop(engine: Any, sampler: datamod.BatchSampler, job: dict[str, Any], seq: int, start: int,
          state: dict[str, Any], metrics: MetricsWriter | None, is_hf: bool,
          stop: Preemption) -> int | None:
    """Optimizer steps ``start+1 .. steps``, with metrics, progress and checkpoints; returns
    None, or the last step done when ``stop`` asked to stop (saved, unless step ``start``)."""
    from tqdm import tqdm

    steps, accum, world = job["steps"], engine.cfg.gradient_accumulation_steps, engine.world_size
    peak_lr = engine.cfg.optimizer.lr
    tokens_per_step = job["batch"] * seq * accum * world
    device = engine.device  # the compute device (CUDA under torchrun, else CPU)
    bar = tqdm(total=steps, initial=min(start, steps), unit="step", dynamic_ncols=True,
               mininterval=0.5, disable=engine.rank != 0, file=sys.stderr)
    try:
        for step in range(start + 1, steps + 1):
            if stop.stop_requested(engine):  # every rank, at the same step boundary
                if step - 1 > start and (step - 1) % job["save_every"]:
                    saves.save(engine, sampler, job, step - 1, state, bar)
                return step - 1
            lr = _lr_at(step, steps, peak_lr, job["lr_schedule"])
            for group in engine.param_groups:
                group["lr"] = lr
            t0 = time.perf_counter()
            total = 0.0
            for _ in range(accum):
                x, y = (t.to(device, non_blocking=True) for t in sampler.next())
                # HF causal LMs shift labels themselves, so they get the inputs as labels.
                result = engine(input_ids=x, labels=x) if is_hf else engine(x, y)
                loss = result.loss if is_hf else result
                engine.backward(loss)
                total += float(loss.detach().float())
            engine.step()
            loss_value = global_mean(engine, total / accum)
            dt = time.perf_counter() - t0
            state["elapsed"] += dt
            mem = engine.memory_report()
            record = {"step": step, "loss": loss_value, "tokens_per_s": tokens_per_step / dt,
                      "lr": lr, "grad_norm": engine.last_grad_norm,
                      "elapsed_s": round(state["elapsed"], 3),
                      **{f"bytes_{t.value}": int(mem[t.value]) for t in Tier}}
            if metrics is not None:
                metrics.write(record)
            bar.set_postfix_str(
                f"loss {loss_value:.3f}, {record['tokens_per_s']:,.0f} tok/s, "
                + ", ".join(f"{t.value} {format_bytes(mem[t.value])}" for t in Tier),
                refresh=False)
            bar.update(1)
            if step % job["save_every"] == 0 or step == steps:
                saves.save(engine, sampler, job, step, state, bar)
    finally:
        bar.close()
    return None


def _finish(out: Path, job: dict[str, Any], n_params: int, start: int,
            lines: list[str] | None = None) -> None:
    """Write the report and print the summary (rank 0), ending with ``lines`` (LoRA's)."""
    records = read_metrics(out / "metrics.jsonl")
    png = write_report(out / "metrics.jsonl", out / "report.png",
                       title=f"outcore train: {job['model']} ({format_count(n_params)} params)")
    if not records:
        say("\n".join([f"no steps recorded; report: {png}", *(lines or [])]))
        return
    this_run = [r for r in records if r["step"] > start] or records
    # Every step moves the same number of tokens, so the run's rate is the harmonic mean.
    tok_s = len(this_run) / sum(1.0 / r["tokens_per_s"] for r in this_run)
    latest = latest_checkpoint(out / "checkpoints")
    say(f"done: {records[-1]['step']} steps, loss {records[0]['loss']:.3f} -> "
         f"{records[-1]['loss']:.3f}, {tok_s:,.0f} tokens/s, "
         f"{records[-1]['elapsed_s']:.0f} s of training\n"
         f"  metrics: {out / 'metrics.jsonl'}\n  report: {png}\n  checkpoint: {latest}"
         + "".join(f"\n{line}" for line in lines or []))
