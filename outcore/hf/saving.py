"""Hugging Face folders from a live engine: full weights for ``from_pretrained``, adapters for
``PeftModel.from_pretrained``.

[Note: saving without a whole model anywhere]
Under ZeRO-3, ``model.state_dict()`` holds empty placeholders (the bytes live in shards), which
is how PEFT adapters end up saved as ``[0]``-shaped tensors elsewhere. Here each parameter is
all-gathered on its own (a collective: every rank calls), rank 0 writes it to the open
safetensors stream and drops it, so memory holds one full parameter at a time and the file is
the model's full fp32 values, renamed into place only when complete. Adapters are small, so
they are gathered into one state dict that PEFT's own ``save_pretrained`` writes: the files
are exactly PEFT's format, with full-shaped tensors.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from outcore.io import safetensors_stream as sts
from outcore.io.safetensors_stream import StreamWriter, TensorSpec
from outcore.zero.registry import managed

WEIGHTS_NAME = "model.safetensors"


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _entries(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the model's state dict, parameters as their Parameter objects."""
    return list(model.state_dict(keep_vars=True).items())


def _full_values(entries: list[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full values) in order: managed parameters all-gathered in fp32 (a collective),
    the rest as they are. A parameter under several names (tied) is gathered once and kept
    only until its last name is written."""
    left = Counter(id(t) for _, t in entries)
    kept: dict[int, torch.Tensor] = {}
    for name, t in entries:
        full = kept.get(id(t))
        if full is None:
            sp = managed(t)
            full = sp.gather_values() if sp is not None else t.detach()
        left[id(t)] -= 1
        if left[id(t)]:
            kept[id(t)] = full
        else:
            kept.pop(id(t), None)
        yield name, full


def save_full(model: nn.Module, rank: int, out: str | os.PathLike[str]) -> Path | None:
    """Write ``out/model.safetensors`` (fp32 parameters, persistent buffers as they are) and the
    model's config files; a collective. Returns the weights path on rank 0."""
    folder = Path(out)
    entries = _entries(model)
    writer = None
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        specs = []
        for name, t in entries:
            dtype = torch.float32 if managed(t) is not None else t.dtype
            specs.append(TensorSpec(name, dtype, tuple(t.shape)))
        writer = StreamWriter(folder / WEIGHTS_NAME, specs, {"format": "pt"})
    try:
        for name, full in _full_values(entries):
            if writer is not None:
                writer.write(name, full.detach().cpu().contiguous())
        if writer is not None:
            writer.finish()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if rank != 0:
        return None
    save_configs(model, folder)
    sts.fsync_dir(folder)
    return folder / WEIGHTS_NAME


def save_configs(model: nn.Module, folder: Path) -> None:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(folder)


def gather_trainable(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Full fp32 copies of the trainable parameters, by state-dict name, on rank 0 (every
    rank gets an empty dict otherwise); a collective."""
    trainable = [(n, t) for n, t in _entries(model)
                 if isinstance(t, nn.Parameter) and t.requires_grad]
    return {name: full.detach().cpu().clone() for name, full in _full_values(trainable)
            if rank == 0}


def save_adapters(model: nn.Module, rank: int, out: str | os.PathLike[str],
                  **peft_kwargs: Any) -> None:
    """PEFT's adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) with
    full-shaped tensors; a collective."""
    state = gather_trainable(model, rank)
    if rank == 0:
        model.save_pretrained(str(out), state_dict=state, **peft_kwargs)
