"""Pretrained weights straight into the tiers: safetensors in, shards out, one slice at a time.

[Note: read only this rank's slice]
A model built under ``outcore.init`` has no full parameters to ``load_state_dict`` into, and
a model larger than host memory could not take one anyway. So each parameter is loaded on its
own: this rank's shard covers elements ``[start, start + valid)`` of the flattened tensor, the
rows of the file's tensor that hold them are read with safetensors' lazy ``get_slice`` (the
rest of the file is never touched), the shard is cut out, cast to fp32 and written to the
master and training-dtype shards in their home tiers. Host memory holds at most the rows of
one tensor that overlap this rank's shard, and never a whole model.

Names and shapes are checked for every tensor before anything is written, so a mismatch
leaves the model as it was and the error lists every offending name. Names go through
transformers' load-time conversions first (zero/folder_names.py's [Note: a folder's names
are not always the model's]).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from outcore.errors import ConfigError
from outcore.io.publish import MANIFEST
from outcore.io.safetensors_stream import read_flat_range
from outcore.zero.deferred import few_names, folder_tensors
from outcore.zero.folder_names import folder_names
from outcore.zero.registry import managed


def weight_files(path: str | os.PathLike[str]) -> dict[str, Path]:
    """Map tensor name -> file for a ``.safetensors`` file or a Hugging Face style folder."""
    return {name: entry.path for name, entry in folder_tensors(path).items()}


def load_pretrained(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Load weights (and persistent buffers) from ``path`` into ``model``.

    ``model`` may be plain, built under ``outcore.init``, or already wrapped by
    ``outcore.initialize`` (gathered copies are refreshed). Tied parameters may appear under
    any of their names. Every rank must call this (collective only in that each rank reads
    its own slices; no communication is needed).
    """
    folder = Path(path).expanduser()
    if (folder / MANIFEST).is_file():  # a checkpoint's files hold slices and optimizer state
        raise ConfigError(f"{path} is an outcore checkpoint (it holds {MANIFEST}): load it "
                          f"with engine.load_checkpoint({str(path)!r}), or write its weights "
                          f"with outcore.consolidate({str(path)!r}, out) and load those")
    where = weight_files(folder)
    params: list[tuple[list[str], nn.Parameter]] = []
    by_id: dict[int, int] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in by_id:
            params[by_id[id(p)]][0].append(name)
        else:
            by_id[id(p)] = len(params)
            params.append(([name], p))
    buffers = dict(_persistent_buffers(model))
    names_of = folder_names(model, where)
    plan, missing, used = [], [], set()
    for names, p in params:
        key = next((n for n in names if names_of.uses(n)), None)
        if key is None:
            missing.append(names[0])
            continue
        plan.append((key, p))
        used.update(k for n in names for k in names_of.uses(n))
    for name in buffers:
        used.update(names_of.uses(name))
    unexpected = sorted(set(where) - used)
    if missing or unexpected:
        raise ConfigError(f"weights in {path} do not match the model: missing "
                          f"{few_names(missing)}; unexpected {few_names(unexpected)}")
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}

        def handle(f: Path):
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(f, framework="pt"))
            return handles[f]

        def read(key: str) -> torch.Tensor:
            return handle(where[key]).get_tensor(key)

        def stand_in(key: str) -> torch.Tensor:  # its shape, no values: the check reads none
            return torch.empty(handle(where[key]).get_slice(key).get_shape(), device="meta")

        bad = []
        for key, p in plan:
            label = key
            if key in names_of.fused:  # the converter run on stand-ins gives its shape
                shape = tuple(names_of.fused[key].values(stand_in).shape)
                label = f"{key} (from {names_of.uses(key)[0]}, ...)"
            else:
                file_key = names_of.renamed[key]
                shape = tuple(handle(where[file_key]).get_slice(file_key).get_shape())
            if shape != tuple(p.shape):
                bad.append(f"{label}: file {list(shape)} vs model {list(p.shape)}")
        if bad:
            raise ConfigError(f"shape mismatch in {path}: " + "; ".join(bad[:10]))
        with torch.no_grad():
            for key, p in plan:
                if key in names_of.fused:  # one parameter's tensors in memory at a time
                    _load_values(names_of.fused[key].values(read), p)
                else:
                    _load_one(handle(where[names_of.renamed[key]]), names_of.renamed[key], p)
            for name, buf in buffers.items():
                if name in names_of.renamed:
                    buf.copy_(read(names_of.renamed[name]))


def _load_one(h, key: str, p: nn.Parameter) -> None:
    sp = managed(p)
    if sp is None:
        p.copy_(h.get_tensor(key))
        return
    lay = sp.layout
    shard = torch.zeros(lay.shard_numel, dtype=torch.float32)
    if lay.valid_numel:
        read_flat_range({0: h}, 1, key, sp.numel, lay.start, lay.start + lay.valid_numel, shard)
    sp.overwrite(shard.to(sp.rt.device))  # past running updates and in-flight reads


def _load_values(full: torch.Tensor, p: nn.Parameter) -> None:
    """A parameter from its whole values in memory (made from several tensors of the file)."""
    sp = managed(p)
    if sp is None:
        p.copy_(full)
        return
    lay = sp.layout
    shard = torch.zeros(lay.shard_numel, dtype=torch.float32)
    shard[: lay.valid_numel] = full.reshape(-1)[lay.start : lay.start + lay.valid_numel]
    sp.overwrite(shard.to(sp.rt.device))


def _persistent_buffers(model: nn.Module):
    for mod_name, mod in model.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf
