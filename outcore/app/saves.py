"""``outcore train``'s checkpoints: saving a step, and what a run that stops or fails to save
says about where it can go on from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from outcore.app import data as datamod
from outcore.app import models
from outcore.app.ranks import global_mean, say
from outcore.errors import FolderInUseError, StorageError
from outcore.guard.preemption import EXIT_PREEMPTED, Preemption
from outcore.io.manifest import latest_checkpoint


def stopped(stop: Preemption, step: int, ckpt_root: Path) -> int:
    """Say where a stopped run can go on from (rank 0) and return its exit code."""
    name = stop.signal.name if stop.signal else "a signal"
    what = "preempted" if stop.exit_code == EXIT_PREEMPTED else "interrupted"
    latest = latest_checkpoint(ckpt_root)
    say(f"outcore train: {what} ({name}) after step {step}; checkpoint: "
         f"{latest or 'none yet'}; run the same command with --resume to continue")
    return stop.exit_code


def save(engine: Any, sampler: datamod.BatchSampler, job: dict[str, Any], step: int,
          state: dict[str, Any], bar: Any = None) -> None:
    """Checkpoint step ``step``; the progress bar says so meanwhile (a large model's save
    takes minutes, in which the bar would otherwise stand still without a word)."""
    if bar is not None:
        bar.set_description_str(f"saving step-{step:08d}", refresh=True)
    try:
        _save_now(engine, sampler, job, step, state)
    except StorageError as e:  # a full disk: the run's progress is in the last checkpoint
        if isinstance(e, FolderInUseError):
            raise  # another run's folder: its own message says what to do
        latest = latest_checkpoint(job["out"] / "checkpoints")
        raise type(e)(f"{e}; " + (f"the last complete checkpoint, {latest}, is intact: once "
                                  "that is mended, run the same command with --resume"
                                  if latest else "no checkpoint of this run is complete yet")
                      ) from e
    finally:
        if bar is not None:
            bar.set_description_str("", refresh=True)


def _save_now(engine: Any, sampler: datamod.BatchSampler, job: dict[str, Any], step: int,
              state: dict[str, Any]) -> None:
    client = {"step": step, "sampler": sampler.state_dict(), "seed": state["seed"],
              "model": job["model"], "run": state["run"],  # each rank's own clock: their mean
              "elapsed_s": global_mean(engine, state["elapsed"])}
    if state.get("lora") is not None:  # a resume must name the same spec (app/lora.py)
        client["lora"] = state["lora"]
    # the model's config.json lets `outcore consolidate` put it beside the weights for
    # from_pretrained; not for LoRA, whose weights are PEFT's names that it would skip
    files = ({"config.json": Path(job["model"]) / "config.json"}
             if models.is_hf_folder(job["model"]) and state.get("lora") is None else None)
    engine.save_checkpoint(job["out"] / "checkpoints" / f"step-{step:08d}",
                           client_state=client, files=files)
