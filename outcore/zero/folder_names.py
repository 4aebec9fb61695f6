"""A Hugging Face folder's tensor names as the model has them, through transformers' own
load-time conversions.

[Note: a folder's names are not always the model's]
transformers 5 writes some models' weights under other names than their attributes, and
reverses that in ``from_pretrained``: GPT-NeoX's head is ``embed_out.weight`` on disk and
``lm_head.weight`` in the model; Mixtral's and Qwen2-MoE's experts are one tensor per expert
and projection on disk and one fused parameter per layer in memory. ``outcore.init(cfg,
weights=folder)`` and ``outcore.load_pretrained`` matched names as they are, so a folder the
model's own ``save_pretrained`` wrote, or a hub checkpoint of those families, was refused
as missing half its names (a user's probe). Here each name of the folder goes through the
mapping ``from_pretrained`` uses (``rename_source_key``): a renamed tensor is read as
before, under its name in the file, this rank's slice only; a fused one (many tensors of the
file make one parameter) is made whole in host memory by transformers' converter from its
tensors, in ``from_pretrained``'s order, and this rank's slice is cut from it, so host
memory holds one such parameter at a time. A model that is not a transformers model, or
whose names need no conversion, is matched by name as it always was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Fused:
    """A model parameter made from several tensors of the folder (see the note)."""

    name: str
    model: nn.Module
    converter: Any  # transformers' WeightConverter, one copy per parameter
    sources: list[tuple[str, str]] = field(default_factory=list)  # (file name, its pattern)

    def values(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The whole parameter, from ``read(file name)`` of each of its tensors."""
        from transformers.core_model_loading import dot_natural_key

        conv = deepcopy(self.converter)
        for key, pattern in sorted(self.sources, key=lambda s: dot_natural_key(s[0])):
            conv.add_tensor(self.name, key, pattern, read(key))
        made = conv.convert(self.name, model=self.model, config=getattr(self.model, "config", None))
        out = made[self.name]
        value: torch.Tensor = out[0] if isinstance(out, list) else out
        return value


@dataclass
class FolderNames:
    """How a folder's tensors reach a model's names."""

    renamed: dict[str, str]  # the model's name -> the name in the file (often the same)
    fused: dict[str, Fused]  # the model's name -> how it is made from several

    def uses(self, model_name: str) -> list[str]:
        """The folder's names a model name consumes."""
        if model_name in self.fused:
            return [key for key, _ in self.fused[model_name].sources]
        return [self.renamed[model_name]] if model_name in self.renamed else []


def folder_names(model: nn.Module, keys: Iterable[str]) -> FolderNames:
    """Map the folder's tensor names ``keys`` onto ``model``'s (see the note)."""
    keys = list(keys)
    identity = FolderNames({k: k for k in keys}, {})
    if not hasattr(model, "get_parameter_or_buffer") or not hasattr(model, "config"):
        return identity  # not a transformers model
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:
        return identity
    if not isinstance(model, PreTrainedModel):  # a PEFT wrapper, say: its names as they are
        return identity
    mapping = get_model_conversion_mapping(model) or []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    if not renamings and not converters:
        return identity
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    own = dict.fromkeys(model.state_dict(keep_vars=True), True)  # rename_source_key asks .get
    out = FolderNames({}, {})
    for key in keys:
        name, pattern = rename_source_key(key, renamings, converters,
                                          getattr(model, "base_model_prefix", None), own)
        if name not in own and key in own:  # as from_pretrained: a name the model has wins
            name, pattern = key, None
        if name not in own:  # no place in the model: left under its own name, unexpected
            out.renamed.setdefault(key, key)
        elif pattern is None:
            out.renamed[name] = key
        else:
            fused = out.fused.setdefault(name, Fused(name, model, deepcopy(by_pattern[pattern])))
            fused.sources.append((key, pattern))
    return out
