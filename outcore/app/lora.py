"""``outcore train --lora SPEC``: LoRA adapters over a frozen, sharded, offloaded base model.

The mechanics live in ``outcore.hf`` (``lora.parse_spec``/``apply_lora``, ``saving.
save_adapters``); this module is the job's side of them: check the spec before anything is
built, refuse a resume that would mix runs, wrap the model, say what the base costs, and write
the adapters at the end.

[Note: a LoRA spec is checked before the build]
A typo in ``--lora`` must not cost the minutes a large model takes to build and load, nor
leave swap files behind. So the spec is parsed first (``r=0``, ``foo=1``), then the ``hf``
extra is looked for, then the targets are matched against the model's architecture built on
PyTorch's ``meta`` device: modules with shapes and no storage, built in seconds at any size.
Only then is the real model built under ``outcore.init``.

[Note: a LoRA checkpoint resumes only the same LoRA run]
A checkpoint of a LoRA run holds the PEFT-wrapped model (``base_model.model...`` names, the
``lora_A``/``lora_B`` matrices); its client state records the spec. Resuming it without
``--lora``, with another spec, or resuming a full fine-tune with ``--lora`` would meet the
checkpoint loader's list of every mismatched parameter name; the spec in the client state is
compared first, and the refusal says which ``--lora`` the checkpoint needs. (``outcore train
--resume`` without ``--lora`` takes the run's own spec from the checkpoint: job.py's [Note: a
resume is started as its run was]; the refusal of none is for checkpoints older than that.)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from outcore.app import models
from outcore.errors import ConfigError
from outcore.hf import require
from outcore.hf.lora import apply_lora, parse_spec
from outcore.hf.saving import save_adapters
from outcore.io.manifest import read_client_state
from outcore.units import format_bytes, format_count
from outcore.zero.registry import parameter_counts

__all__ = ["LoraJob", "adapter_dir", "check_resume", "describe", "footprint", "memory_line",
           "prepare", "save", "wrap"]

ADAPTER_DIR = "adapter"
"""The adapters' folder inside ``--out``."""

_DEFAULTS = {"lora_alpha": 8.0, "lora_dropout": 0.0}  # peft's LoraConfig defaults


@dataclass(frozen=True)
class LoraJob:
    """A checked ``--lora`` spec: the text as given and ``LoraConfig`` keywords (peft's names)."""

    spec: str
    kwargs: dict[str, Any]
    trainable: int = 0  # adapter parameters, counted on the meta-device model

    def client_state(self) -> dict[str, Any]:
        """What a checkpoint records, so a resume can be compared (JSON only)."""
        return {"spec": self.spec, **self.canonical()}

    def canonical(self) -> dict[str, Any]:
        """The spec's meaning, independent of key order, target order and spelled defaults."""
        kw = {**_DEFAULTS, **self.kwargs}
        return {"r": int(kw["r"]), "lora_alpha": float(kw["lora_alpha"]),
                "lora_dropout": float(kw["lora_dropout"]),
                "target_modules": _targets(kw["target_modules"])}


def _targets(targets: str | list[str]) -> list[str]:
    """Target names in a fixed order; peft's ``all-linear`` shorthand is one string."""
    return [targets] if isinstance(targets, str) else sorted(set(targets))


def prepare(spec: Any, model: str) -> LoraJob | None:
    """Check ``--lora`` before anything is built (see [Note: a LoRA spec is checked before the
    build]); None when no spec is given. Every mistake is a one-line ConfigError."""
    if spec is None:
        return None
    if not isinstance(spec, str):
        raise ConfigError(f"train.lora: expected a spec like 'r=8,alpha=16,targets=q_proj,"
                          f"v_proj', got {spec!r}")
    kwargs = parse_spec(spec)
    if not models.is_hf_folder(model):
        gone = isinstance(model, str) and os.sep in model and not os.path.exists(model)
        raise ConfigError(f"--lora adapts pretrained weights, so it needs --model HF_FOLDER (a "
                          f"local Hugging Face folder with *.safetensors weights); {model!r} "
                          + ("does not exist (moved? give --model where it is now: its files "
                             "are checked against the run's record)" if gone else "is not one"))
    if not models.hf_has_weights(model):
        raise ConfigError(f"--lora: {model} holds no *.safetensors weights; adapters over a "
                          "random base could not be loaded onto anything later")
    require("peft", "transformers")
    job = LoraJob(spec, kwargs)
    return LoraJob(spec, kwargs, _check_targets(job, model))


def _check_targets(job: LoraJob, folder: str) -> int:
    """Apply the spec to the architecture on the meta device: names that match no module, and
    modules peft cannot adapt, fail here with the names the model has. Returns the number of
    adapter parameters (what trains: placement prices only those with optimizer state)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(folder, local_files_only=True))
        try:
            wrapped = apply_lora(model, job.kwargs)
            return parameter_counts(wrapped)[1]
        except ConfigError:  # names that match no module: apply_lora's own message
            raise
        except ValueError as e:  # peft: a target that is no layer it can adapt
            raise ConfigError(_unsupported(job, model, e)) from None


def _unsupported(job: LoraJob, model: nn.Module, error: Exception) -> str:
    kinds = {n.rsplit(".", 1)[-1]: type(m).__name__ for n, m in model.named_modules()}
    found = [f"{t} (a {kinds[t]})" for t in job.kwargs["target_modules"] if t in kinds
             and not re.search(r"Linear|Conv1D|Embedding|Conv\dd", kinds[t])]
    linear = sorted(n for n, k in kinds.items() if k in ("Linear", "Conv1D"))
    if not found:
        return f"--lora {job.spec}: peft refused it: {' '.join(str(error).split())[:300]}"
    return (f"--lora targets: peft cannot put an adapter on {', '.join(found)}; target layers "
            f"by their names, e.g. {linear}")


def check_resume(job: LoraJob | None, checkpoint: Path | None) -> None:
    """Refuse to resume ``checkpoint`` with another ``--lora`` than it was trained with (see
    [Note: a LoRA checkpoint resumes only the same LoRA run]); reads only its manifest."""
    if checkpoint is None:
        return
    saved = read_client_state(checkpoint).get("lora")
    if saved is None and job is None:
        return
    if saved is None:
        raise ConfigError(f"--resume: {checkpoint} is a checkpoint of a run without --lora; "
                          "drop --lora to continue it, or give another --out")
    if job is None:
        raise ConfigError(f"--resume: {checkpoint} is a checkpoint of a LoRA run; add --lora "
                          f"{saved.get('spec')} to continue it")
    if {k: v for k, v in saved.items() if k != "spec"} != job.canonical():
        raise ConfigError(f"--resume: {checkpoint} was trained with --lora {saved.get('spec')}, "
                          f"not --lora {job.spec}; give the same spec to continue it, or "
                          "another --out")


def wrap(model: nn.Module, job: LoraJob, folder: str) -> nn.Module:
    """The PEFT model over ``model`` (built, its weights loaded, not yet given to the engine):
    the base frozen, the adapters the only trainable parameters, so the only ones the engine's
    optimizer gets. The adapter config names ``folder`` as its base model."""
    peft_model = apply_lora(model, job.kwargs)
    for config in peft_model.peft_config.values():
        config.base_model_name_or_path = str(Path(folder).resolve())
    return peft_model


def describe(model: nn.Module, job: LoraJob) -> str:
    """The banner's line: the spec and the trainable share of the parameters."""
    total, trainable = parameter_counts(model)
    c = job.canonical()
    return (f"lora: r={c['r']}, alpha={c['lora_alpha']:g}, dropout {c['lora_dropout']:g} on "
            f"{', '.join(c['target_modules'])}: {trainable:,} trainable params "
            f"({trainable / max(total, 1):.2%} of {total:,}); the base is frozen")


def footprint(engine: Any) -> dict[str, Any]:
    """Bytes this rank keeps for frozen and trainable parameters, from the shards themselves:
    per tier for the base, and whether any frozen parameter has a master or optimizer state."""
    base: dict[str, int] = {}
    out = {"base_params": 0, "base_bytes": base, "base_extra": 0, "adapter_params": 0,
           "adapter_bytes": 0, "dtype": str(engine.rt.compute_dtype).removeprefix("torch."),
           "base_shard": 0, "adapter_shard": 0}  # this rank's elements of each
    for sp in engine.params:
        stored = sp.stored_shards()
        state = engine.sharded_optimizer.state.get(sp)
        moments = list(state.moments.values()) if state is not None else []
        if sp.trainable:
            out["adapter_params"] += sp.numel
            out["adapter_shard"] += sp.shard_numel
            out["adapter_bytes"] += sum(s.nbytes for s in stored + moments)
            continue
        out["base_params"] += sp.numel
        out["base_shard"] += sp.shard_numel
        for s in stored:
            if s is sp.compute_shard:
                where = "place" if s.read_only else s.tier.value  # read from its own file
                base[where] = base.get(where, 0) + s.nbytes
                if s.read_only:
                    out["base_folder"] = str(s.path.parent)
                    out["base_dtype"] = str(s.dtype).removeprefix("torch.")
            else:  # an fp32 master beside a 16-bit shard: should not exist for frozen params
                out["base_extra"] += s.nbytes
        out["base_extra"] += sum(s.nbytes for s in moments)
    return out


def memory_line(engine: Any) -> str:
    """The summary's line on what the frozen base and the adapters cost (this rank's shards)."""
    f = footprint(engine)
    where = ", ".join(
        f"{format_bytes(b)} of {f['base_dtype']} read in place from {f['base_folder']}"
        if t == "place" else f"{format_bytes(b)} in {t}"
        for t, b in f["base_bytes"].items()) or "none"
    per = sum(f["base_bytes"].values()) / max(f["base_shard"], 1)  # this rank's bytes
    extra = ("no master, gradient or optimizer state" if not f["base_extra"]
             else f"plus {format_bytes(f['base_extra'])} of master/optimizer state")
    several = engine.world_size > 1
    rank = f" (rank {engine.rank}'s shards)" if several else ""
    mine = (f" for this rank's {format_count(f['adapter_shard'])}" if several else "")
    return (f"  memory{rank}: frozen base {format_count(f['base_params'])} params, {where} "
            f"({per:.3g} B/param; computed in {f['dtype']}; {extra}); adapters "
            f"{format_count(f['adapter_params'])} params, "
            f"{format_bytes(f['adapter_bytes'])}{mine} with master and optimizer state")


def adapter_dir(out: Path) -> Path:
    return Path(out) / ADAPTER_DIR


def save(engine: Any, model: nn.Module, out: Path) -> str:
    """Write the adapters in PEFT's format to ``out/adapter`` (a collective: every rank calls)
    and return the summary's line saying where and how to load them."""
    folder = adapter_dir(out)
    save_adapters(model, engine.rank, folder)
    return (f"  adapter: {folder} (PEFT format; load with "
            f"PeftModel.from_pretrained(base, \"{folder}\"))")
