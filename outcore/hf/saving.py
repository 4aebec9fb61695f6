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

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from outcore.errors import ConfigError
from outcore.io import safetensors_stream as sts
from outcore.io.pretrained import load_pretrained
from outcore.io.safetensors_stream import StreamWriter, TensorSpec
from outcore.zero.registry import managed

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


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


class _Saved(NamedTuple):
    """One tensor of the folder: its name, the model's tensor it comes from, its shape in the
    file, and, where transformers computes it from that tensor on save, the state-dict name
    its conversion is run on (``_plan``'s note)."""

    name: str
    source: torch.Tensor
    shape: tuple[int, ...]
    converted_from: str | None = None


def save_full(model: nn.Module, rank: int, out: str | os.PathLike[str],
              max_shard_size: int | str = "50GB") -> Path | None:
    """Write what ``save_pretrained`` writes (see [Note: the names save_pretrained writes]):
    fp32 parameters and persistent buffers in its files, under its names, and the config
    files; a collective. Returns the folder's first weights file on rank 0."""
    folder = Path(out)
    files, index = _plan(model, _entries(model), max_shard_size)
    for filename, pairs in files:
        writer = None
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            specs = [TensorSpec(e.name, torch.float32 if managed(e.source) is not None
                                else e.source.dtype, e.shape) for e in pairs]
            writer = StreamWriter(folder / filename, specs, {"format": "pt"})
        try:
            converted = _Converted(model, pairs)
            for e, (_, full) in zip(pairs, _full_values([(e.name, e.source) for e in pairs]),
                                    strict=True):
                if writer is not None:
                    value = converted.value(e, full)
                    writer.write(e.name, value.detach().cpu().contiguous())
            if writer is not None:
                writer.finish()
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
    if rank != 0:
        return None
    if index is not None:
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    save_configs(model, folder, dtype=torch.float32)
    sts.fsync_dir(folder)
    return folder / files[0][0]


class _Converted:
    """The tensors transformers computes from one parameter on save, made once per file from
    its gathered values and dropped after their last one is written."""

    def __init__(self, model: nn.Module, pairs: list[_Saved]) -> None:
        self._model = model
        self._left = Counter(id(e.source) for e in pairs if e.converted_from is not None)
        self._made: dict[int, dict[str, torch.Tensor]] = {}

    def value(self, e: _Saved, full: torch.Tensor) -> torch.Tensor:
        if e.converted_from is None:
            return full
        from transformers.modeling_utils import revert_weight_conversion

        key = id(e.source)
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = revert_weight_conversion(
                self._model, {e.converted_from: full})
        self._left[key] -= 1
        if not self._left[key]:
            del self._made[key]
        return made[e.name]


def _plan(model: nn.Module, entries: list[tuple[str, torch.Tensor]], max_shard_size: int | str
          ) -> tuple[list[tuple[str, list[_Saved]]], dict | None]:
    """[Note: the names save_pretrained writes]
    transformers 5 does not write a model's attribute names as they are: it drops tied
    aliases, drops ``_keys_to_ignore_on_save``, reverts its weight conversions (GPT-NeoX's
    ``lm_head`` is written ``embed_out``) and splits files at ``max_shard_size``. Those steps
    run here on meta tensors that stand for the parameters (transformers' own functions), so
    the plan of files and names is save_pretrained's while the values are still only shards;
    then each file is streamed one gathered parameter at a time. A conversion that computes
    tensors from one parameter (Mixtral's and Qwen2-MoE's experts, fused in one parameter in
    memory, are written one tensor per expert) is run again on that parameter's gathered
    values as its file is written: each such name is traced to its parameter by converting
    every parameter on its own, on meta. One that needs several parameters at once cannot be
    streamed, and is refused, naming ``save_checkpoint`` and ``consolidate``, which write the
    model's own names. Returns ([(file name, [_Saved])], the index for a split model).
    """
    stand_in = {name: torch.empty(t.shape, device="meta", dtype=torch.float32
                                  if managed(t) is not None else t.dtype) for name, t in entries}
    by_name = dict(entries)
    source = {id(m): by_name[name] for name, m in stand_in.items()}
    names = stand_in
    if hasattr(model, "get_parameter_or_buffer"):  # a transformers model
        from huggingface_hub import split_torch_state_dict_into_shards
        from transformers.modeling_utils import (
            remove_tied_weights_from_state_dict,
            revert_weight_conversion,
        )

        for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
            names.pop(key, None)
        kept = remove_tied_weights_from_state_dict(names, model)
        names = revert_weight_conversion(model, kept)
        origin = _converted_from(model, kept, {k for k, v in names.items() if id(v) not in source})
        # each a tensor of its own, as save_pretrained's are, so the split into files is its
        names = {k: torch.empty_like(v) if k in origin else v for k, v in names.items()}
        split = split_torch_state_dict_into_shards(
            names, filename_pattern=WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors"),
            max_shard_size=max_shard_size)
        files = [(f, [_Saved(n, source[id(names[n])], tuple(names[n].shape)) if n not in origin
                      else _Saved(n, by_name[origin[n]], tuple(names[n].shape), origin[n])
                      for n in tensors])
                 for f, tensors in split.filename_to_tensors.items()]
        index = None
        if split.is_sharded:
            total = sum(p.numel() for p in model.parameters())  # tied ones once
            index = {"metadata": {"total_parameters": total, **split.metadata},
                     "weight_map": split.tensor_to_filename}
        return files, index
    return [(WEIGHTS_NAME, [_Saved(n, source[id(m)], tuple(m.shape))
                            for n, m in names.items()])], None


def _converted_from(model: nn.Module, kept: dict[str, torch.Tensor], made: set[str]
                    ) -> dict[str, str]:
    """For each name in ``made`` (a tensor transformers computes when saving), the one
    state-dict name whose conversion alone gives it (see ``_plan``'s note)."""
    if not made:
        return {}
    from transformers.modeling_utils import revert_weight_conversion

    origin: dict[str, str] = {}
    for name, meta in kept.items():
        for out in revert_weight_conversion(model, {name: meta}):
            if out in made:
                origin[out] = name
    missing = sorted(made - origin.keys())
    if missing:
        raise ConfigError(
            f"cannot stream {type(model).__name__}'s weights: transformers computes "
            f"{missing[:3]} from several parameters at once when saving. Save with "
            "engine.save_checkpoint and write the folder with outcore consolidate, which keep "
            "the model's own names (from_pretrained reads them)")
    return origin


def save_configs(model: nn.Module, folder: Path, dtype: torch.dtype | None = None) -> None:
    """The model's config files; ``dtype``: the one its ``config.json`` names, that of the
    weights written beside it. The model's own config may name another (transformers'
    ``save_pretrained`` on a bf16 engine's model records bfloat16 there), and
    ``from_pretrained`` loads in the dtype the file names: it would round the fp32 values
    ``save_full`` wrote."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        before = getattr(config, "dtype", None)
        if dtype is not None:
            config.dtype = dtype
        try:
            config.save_pretrained(folder)
        finally:
            if dtype is not None:
                config.dtype = before
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


def holds_weights(folder: Path) -> bool:
    """Whether ``folder`` holds a model's weights as ``save_full`` or ``save_adapters`` write
    them (one file or an index of shards)."""
    return any((folder / name).is_file()
               for name in (WEIGHTS_NAME, INDEX_NAME, "adapter_model.safetensors"))


def load_saved(model: nn.Module, folder: Path) -> None:
    """Load the weights ``save_full`` or ``save_adapters`` wrote in ``folder`` into the model
    (held or not), as ``Trainer._load_best_model`` loads a best checkpoint: the weights and
    nothing else; every rank calls it."""
    if is_peft_model(model):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        adapters = folder / "adapter_model.safetensors"
        if not adapters.is_file():
            raise ConfigError(f"{folder} holds no adapter_model.safetensors to load")
        set_peft_model_state_dict(model, load_file(str(adapters)))
    else:
        single = folder / WEIGHTS_NAME  # not the folder: its outcore shards are there too
        load_pretrained(model, single if single.is_file() else folder)
