"""Checkpoints: per-rank safetensors shards plus a JSON manifest (being written)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def save(engine: Any, path: Path, client_state: dict[str, Any]) -> Path:
    raise NotImplementedError("checkpoint.save is being written")


def load(engine: Any, path: Path) -> dict[str, Any]:
    raise NotImplementedError("checkpoint.load is being written")


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    raise NotImplementedError("latest_checkpoint is being written")


def consolidate(ckpt: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    raise NotImplementedError("consolidate is being written")
