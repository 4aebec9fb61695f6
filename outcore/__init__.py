"""outcore: ZeRO-Infinity for PyTorch.

Train models whose parameters, gradients and optimizer states exceed device and host memory:
every rank keeps 1/W of each, in device memory, host memory or on NVMe, and a layer's full
weights exist only while it runs.
"""

import os
from pathlib import Path

from outcore.config import Config
from outcore.engine import Engine, initialize
from outcore.errors import (
    CommError,
    ConfigError,
    DataError,
    EngineClosedError,
    FolderInUseError,
    OutcoreError,
    ParamAccessError,
    StorageError,
)
from outcore.guard.preemption import Preemption, preemption
from outcore.io.pretrained import load_pretrained
from outcore.memory.activations import checkpoint_activations
from outcore.memory.tiling import TiledLinear, tile_linears
from outcore.zero.gathered import gathered_parameters
from outcore.zero.init import init

__version__ = "0.1.0"


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step under ``root``, or None."""
    from outcore.io import checkpoint

    return checkpoint.latest_checkpoint(root)


def consolidate(ckpt: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Stream a checkpoint's full weights into one safetensors file (no pickle)."""
    from outcore.io import full_weights

    return full_weights.consolidate(ckpt, out)

__all__ = [
    "CommError",
    "Config",
    "ConfigError",
    "DataError",
    "Engine",
    "EngineClosedError",
    "FolderInUseError",
    "OutcoreError",
    "ParamAccessError",
    "Preemption",
    "StorageError",
    "TiledLinear",
    "checkpoint_activations",
    "consolidate",
    "gathered_parameters",
    "init",
    "initialize",
    "latest_checkpoint",
    "load_pretrained",
    "preemption",
    "tile_linears",
]
