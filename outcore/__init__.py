"""outcore: ZeRO-Infinity for PyTorch.

Train models whose parameters, gradients and optimizer states exceed device and host memory:
every rank keeps 1/W of each, in device memory, host memory or on NVMe, and a layer's full
weights exist only while it runs.
"""

from outcore.config import Config
from outcore.engine import Engine, initialize
from outcore.errors import (
    CommError,
    ConfigError,
    CorruptCheckpointError,
    DataError,
    EngineClosedError,
    FolderInUseError,
    GradReadWarning,
    OutcoreError,
    ParamAccessError,
    StorageError,
)
from outcore.guard.preemption import Preemption, preemption
from outcore.io.full_weights import consolidate
from outcore.io.manifest import latest_checkpoint
from outcore.io.pretrained import load_pretrained
from outcore.memory.activations import checkpoint_activations, offload_activations
from outcore.memory.tiling import TiledLinear, tile_linears
from outcore.optim.deepspeed_schedule import deepspeed_scheduler
from outcore.sizing import placement as _placement  # noqa: F401 - answers Config.auto
from outcore.zero.gathered import gathered_parameters
from outcore.zero.init import init

__version__ = "0.1.0"


__all__ = [
    "CommError",
    "Config",
    "ConfigError",
    "CorruptCheckpointError",
    "DataError",
    "Engine",
    "EngineClosedError",
    "FolderInUseError",
    "GradReadWarning",
    "OutcoreError",
    "ParamAccessError",
    "Preemption",
    "StorageError",
    "TiledLinear",
    "checkpoint_activations",
    "consolidate",
    "deepspeed_scheduler",
    "gathered_parameters",
    "init",
    "initialize",
    "latest_checkpoint",
    "load_pretrained",
    "offload_activations",
    "preemption",
    "tile_linears",
]
