"""What a checkpoint's ``client_state`` may hold: JSON, never pickle.

A checkpoint is read back by whoever resumes, maybe another version of the script or another
machine's Python; pickle would run code from the file at load. So ``client_state`` is JSON,
checked before any folder is made, naming the key JSON cannot carry.
"""

from __future__ import annotations

import json
from typing import Any

from outcore.errors import ConfigError

__all__ = ["check_client_state", "jsonable"]


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
