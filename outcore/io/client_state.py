"""What a checkpoint's ``client_state`` may hold: JSON, never pickle.

A checkpoint is read back by whoever resumes, maybe another version of the script or another
machine's Python; pickle would run code from the file at load. So ``client_state`` is JSON,
checked before any folder is made, naming the key JSON cannot carry.
"""

from __future__ import annotations

import json
import numbers
from typing import Any

import torch

from outcore.errors import ConfigError

__all__ = ["check_client_state", "json_value", "jsonable"]


def check_client_state(client_state: dict[str, Any]) -> None:
    """Checkpoints hold JSON, never pickle: reject what JSON cannot carry, naming the key."""
    if not isinstance(client_state, dict):
        raise ConfigError(f"client_state must be a dict, got {type(client_state).__name__}")
    for key, value in client_state.items():
        if not isinstance(key, str):
            raise ConfigError(f"client_state key {key!r} is not a string (JSON keys are strings)")
        if not jsonable(value):
            raise ConfigError(f"client_state[{key!r}] ({type(value).__name__}) is not "
                              "JSON-serializable; checkpoints store JSON only, never pickle")


def jsonable(value: Any) -> bool:
    """Whether ``json.dumps`` takes ``value`` (the manifest keeps only such group settings)."""
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def json_value(value: Any) -> Any:
    """``value`` as JSON can hold it: a real number of any kind (NumPy's ``float32``, which
    ``json.dumps`` refuses) as a float or an int, a tensor (torch takes a tensor ``lr``) as
    its numbers (a small one: a setting, not a weight someone keeps in a group), a tuple as a
    list; anything else unchanged. A param group's settings go through it into a manifest:
    one left out there is silently the loader's config value."""
    if isinstance(value, torch.Tensor) and value.numel() <= 16:
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (tuple, list)):
        return [json_value(v) for v in value]
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a NumPy scalar, bool_
        value = value.item()  # included (not a numbers.Real), as its Python counterpart
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)
