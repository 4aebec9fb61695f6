"""outcore: ZeRO-Infinity for PyTorch.

Train models whose parameters, gradients and optimizer states exceed device and host memory:
every rank keeps 1/W of each, in device memory, host memory or on NVMe, and a layer's full
weights exist only while it runs.
"""

from outcore.checkpoint import consolidate, latest_checkpoint
from outcore.config import Config
from outcore.engine import Engine, initialize
from outcore.errors import ConfigError, DataError, OutcoreError, StorageError
from outcore.gathered import gathered_parameters
from outcore.init import init

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "DataError",
    "Engine",
    "OutcoreError",
    "StorageError",
    "consolidate",
    "gathered_parameters",
    "init",
    "initialize",
    "latest_checkpoint",
]
