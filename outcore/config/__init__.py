"""The configuration layer: the validated schema (``schema``), the plain mappings it is read
from (``mappings``) and DeepSpeed's config translated into it (``deepspeed``). It sits at the
bottom of the layer order: it imports nothing of outcore but ``errors``."""

from outcore.config.mappings import Dtype, Placement, merge_mappings, read_mapping
from outcore.config.schema import (
    CommConfig,
    Config,
    LossScaleConfig,
    OffloadConfig,
    OptimizerConfig,
    ZeroConfig,
    answer_auto_with,
)

__all__ = ["CommConfig", "Config", "Dtype", "LossScaleConfig", "OffloadConfig",
           "OptimizerConfig", "Placement", "ZeroConfig", "answer_auto_with", "merge_mappings",
           "read_mapping"]
