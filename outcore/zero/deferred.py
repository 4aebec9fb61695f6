"""``outcore.init(cfg, weights=folder)``: a model built without values, bound to its files.

[Note: build empty, then bind by name]
A model whose weights come from a folder needs no values while it is built: whatever its
constructor and ``_init_weights`` compute would be overwritten, and for a large model that
work (and writing it into the swap file) is most of the start-up. So under ``weights=`` each
parameter is swapped, as it is registered, for a parameter on PyTorch's ``meta`` device:
shape and dtype, no storage, and init code runs on it at no cost. Buffers are built as usual
(rotary tables and the like are computed, not loaded).

When the context ends, the names are known: the model's root modules (those no other module
holds) name every parameter, tied ones under each of their names. Each is looked up in the
folder's headers (source_file.py), its shape checked, and it becomes a sharded parameter
whose shards come from the file: a frozen one on NVMe reads its bytes in place
(file_shard.py), any other gets this rank's slice read once into its home tier. The meta
parameter is then replaced in every module that holds it, so ties stay ties. Anything that
does not match (a missing name, a shape, a tensor the model has no place for) is refused
before a shard exists, naming what differs. Names go through transformers' load-time
conversions first (folder_names.py's [Note: a folder's names are not always the model's]):
a parameter fused from several of the folder's tensors is made whole once, in host memory,
and its shards cut from it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from torch import nn

from outcore.errors import ConfigError
from outcore.offload.file_shard import FileShard
from outcore.offload.ledger import Kind
from outcore.offload.source_file import TensorEntry, read_header
from outcore.offload.storage import StoredShard
from outcore.offload.tier import Tier
from outcore.runtime import Runtime
from outcore.zero.folder_names import FolderNames, Fused, folder_names
from outcore.zero.param import ShardedParam
from outcore.zero.registry import register
from outcore.zero.sharding import ShardLayout

_INDEX = "model.safetensors.index.json"


def folder_tensors(path: str | os.PathLike[str]) -> dict[str, TensorEntry]:
    """Every tensor of a ``.safetensors`` file or a Hugging Face folder, from the headers; a
    name in two files is refused."""
    p = Path(path).resolve()
    if p.is_file():
        files = [p]
    elif (p / _INDEX).is_file():
        try:
            weight_map = json.loads((p / _INDEX).read_text())["weight_map"]
            files = sorted({p / str(f) for f in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{p / _INDEX} is not a readable weight index: {e!r}") from None
    elif p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"no *.safetensors files in {p}")
    else:
        raise ConfigError(f"pretrained weights not found: {p}")
    out: dict[str, TensorEntry] = {}
    for f in files:
        if not f.is_file():
            raise ConfigError(f"{p / _INDEX} names {f.name}, which is not in {p}")
        for name, entry in read_header(f).items():
            if name in out:
                raise ConfigError(f"tensor {name!r} is in both {out[name].path.name} and "
                                  f"{f.name} in {p}: which one the model gets is unclear")
            out[name] = entry
    return out


class DeferredBuild:
    """The build side of [Note: build empty, then bind by name]."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.tensors = folder_tensors(folder)  # a wrong folder fails before the build
        self.folder = Path(folder).resolve()

    def on_param(self, module: nn.Module, name: str, param: nn.Parameter
                 ) -> nn.Parameter | None:
        """The registration hook's part: the meta stand-in ``module.name`` gets instead."""
        if param.is_meta:  # a stand-in already (a tie), or a model built on meta by itself
            return None
        meta = nn.Parameter(torch.empty_like(param, device="meta"),
                            requires_grad=param.requires_grad)
        meta.__dict__.update(param.__dict__)  # attributes code set on it (_no_weight_decay)
        return meta

    def bind(self, rt: Runtime, built: list[nn.Module]) -> None:
        """Give every meta parameter the live roots ``built`` (the modules no other built
        module holds: init.py's ``roots``) hold its shards from the folder: those the hook
        replaced and copies of them (``copy.deepcopy`` registers nothing)."""
        slots = {root: _meta_slots(root) for root in built}
        names_of = {root: folder_names(root, self.tensors) for root in slots}
        # a root none of whose names the files hold is no model of theirs (a template layer
        # still in a variable): left alone, unless no root matches at all
        roots = [r for r, found in slots.items() if any(names_of[r].uses(n) for n, *_ in found)]
        roots = roots or list(slots)[:1]
        folder = names_of[roots[0]] if len(roots) == 1 else FolderNames(
            {k: k for k in self.tensors}, {})  # several models of one folder: names as they are
        metas: dict[int, tuple[nn.Parameter, list[str], list[tuple[nn.Module, str]]]] = {}
        for root in roots:
            for name, module, key, p in slots[root]:
                _, names, holders = metas.setdefault(id(p), (p, [], []))
                if name not in names:
                    names.append(name)
                holders.append((module, key))
        if not metas:  # nothing built here is alive (or every value came another way)
            return
        plan: list[tuple[nn.Parameter, TensorEntry | Fused, list[tuple[nn.Module, str]]]] = []
        missing, bad = [], []
        for p, held_as, holders in metas.values():
            found = next((n for n in held_as if folder.uses(n)), None)
            source: TensorEntry | Fused | None = (
                None if found is None else folder.fused.get(found)
                or self.tensors[folder.renamed[found]])
            shape = (None if source is None else source.shape if isinstance(source, TensorEntry)
                     else tuple(source.values(self._stand_in).shape))
            if source is None:
                missing.append(held_as[0])
            elif shape != tuple(p.shape):
                bad.append(f"{found}: file {list(shape or ())} vs model {list(p.shape)}")
            else:
                plan.append((p, source, holders))
        used = {k for _, held_as, _ in metas.values() for n in held_as for k in folder.uses(n)}
        used |= {k for r in roots for n, _ in r.named_buffers() for k in folder.uses(n)}
        unexpected = sorted(n for n in self.tensors if n not in used)
        if missing or unexpected:
            hint = ("; a weight file of the folder may be missing, or, in a Python script, "
                    "parameters the files do not hold (LoRA adapters) are made after the "
                    "outcore.init block" if missing else "")
            raise ConfigError(f"weights in {self.folder} do not match the model: missing "
                              f"{few_names(missing)}; unexpected {few_names(unexpected)}{hint}")
        if bad:
            raise ConfigError(f"shape mismatch in {self.folder}: " + "; ".join(bad[:10]))
        with torch.no_grad():
            for meta, source, holders in plan:
                _bind_one(rt, meta, source.values(lambda key: self._read(rt, key))
                          if isinstance(source, Fused) else source,  # made whole, one at a time
                          holders)
            for root in roots:
                _load_buffers(rt, root, self.tensors, folder)

    def _stand_in(self, key: str) -> torch.Tensor:
        """A tensor of the folder as its shape only (a fused parameter's shape check)."""
        return torch.empty(self.tensors[key].shape, device="meta")

    def _read(self, rt: Runtime, key: str) -> torch.Tensor:
        """A tensor of the folder, whole, in fp32."""
        out = torch.empty(self.tensors[key].shape, dtype=torch.float32)
        rt.reader.read_now(self.tensors[key], 0, out.view(-1))
        return out


def _bind_one(rt: Runtime, meta: nn.Parameter, entry: TensorEntry | torch.Tensor,
              holders: list[tuple[nn.Module, str]]) -> None:
    """A real parameter with shards from ``entry`` (or its whole values) in place of ``meta``
    wherever it is held."""
    param = nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype),
                         requires_grad=meta.requires_grad)
    param.__dict__.update(meta.__dict__)
    register(param, ShardedParam(param, rt, shards=_shards(rt, entry, meta.requires_grad)))
    for module, key in holders:
        module._parameters[key] = param


def _meta_slots(root: nn.Module) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """(full name, module, key, parameter) for every meta parameter under ``root``."""
    return [(f"{mod_name}.{key}" if mod_name else key, mod, key, p)
            for mod_name, mod in root.named_modules(remove_duplicate=False)
            for key, p in mod._parameters.items() if p is not None and p.is_meta]


def _shards(rt: Runtime, entry: TensorEntry | torch.Tensor, trainable: bool
            ) -> tuple[StoredShard | None, StoredShard | None]:
    """(master, compute) for one parameter from its tensor in the file, or from its values."""
    lay = ShardLayout(math.prod(entry.shape), rt.world_size, rt.rank)
    if isinstance(entry, torch.Tensor):
        values = entry.reshape(-1)[lay.start : lay.start + lay.valid_numel]
    elif not trainable and rt.param_tier is Tier.NVME:  # read in place, every step
        return None, FileShard(rt.reader, entry, lay.start, lay.valid_numel, lay.shard_numel,
                               verify=rt.cfg.offload.verify_swap)
    dtype = torch.float32 if trainable or rt.plan.compute_is_master else rt.compute_dtype
    shard = torch.zeros(lay.shard_numel, dtype=dtype)
    if isinstance(entry, torch.Tensor):
        shard[: lay.valid_numel] = values
    elif lay.valid_numel:
        rt.reader.read_now(entry, lay.start, shard[: lay.valid_numel])
    if trainable or rt.plan.compute_is_master:
        return rt.store(shard.to(rt.device), rt.state_tier, Kind.MASTER), None
    return None, rt.store(shard.to(rt.device), rt.param_tier, Kind.PARAMS)


def _load_buffers(rt: Runtime, root: nn.Module, tensors: dict[str, TensorEntry],
                  names: FolderNames) -> None:
    """Persistent buffers the folder holds are loaded (non-persistent ones are computed)."""
    for mod_name, mod in root.named_modules():
        for name, buf in mod._buffers.items():
            full = f"{mod_name}.{name}" if mod_name else name
            if (buf is None or name in mod._non_persistent_buffers_set
                    or full not in names.renamed):
                continue
            entry = tensors[names.renamed[full]]
            if entry.shape != tuple(buf.shape):
                raise ConfigError(f"shape mismatch in {entry.path}: buffer {full}: file "
                                  f"{list(entry.shape)} vs model {list(buf.shape)}")
            staged = torch.empty(entry.shape, dtype=buf.dtype)
            rt.reader.read_now(entry, 0, staged)
            buf.copy_(staged)


def few_names(names: list[str]) -> str:
    """Up to ten names for a message, and how many more."""
    if not names:
        return "none"
    more = f" and {len(names) - 10} more" if len(names) > 10 else ""
    return ", ".join(names[:10]) + more
