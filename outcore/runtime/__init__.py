"""What one rank's engine runs on: the process group (``bootstrap``, ``comm``), the execution
plan decided once per run (``plan``), the training phase (``phase``) and the per-model
services every shard points at (``context.Runtime``). Below ``zero``, above ``offload``."""

from outcore.runtime.context import Runtime

__all__ = ["Runtime"]
