"""The plain-data side of configs: files read into mappings, mappings merged, and the value
types the schema and the DeepSpeed translation share (so neither imports the other's module
for them)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml

from outcore.errors import ConfigError

Dtype = Literal["auto", "bf16", "fp16", "fp32"]
Placement = Literal["none", "cpu", "nvme"]


def read_mapping(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping in a JSON or YAML file (empty for an empty file); errors name the path."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config file {p}: {err.strerror or err}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"config file {p} is not valid {p.suffix or 'YAML'}: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of keys to values, "
                          f"not {type(data).__name__}")
    return data


def merge_mappings(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` deep-merged into ``base``: the one merge of config layers (defaults < file <
    flags, a config and its overrides); neither argument is changed.

    Where both hold a dict under a key, the two are merged the same way, key by key. Anything
    else in ``over`` replaces what ``base`` holds, whole: a list is not concatenated, and
    ``None`` is a value like any other (it replaces; it does not mean "keep the base's").
    Sub-dicts that ``over`` does not touch are shared with ``base``, not copied.
    """
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_mappings(out[key], value)
        else:
            out[key] = value
    return out
