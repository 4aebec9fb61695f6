"""What ``outcore train`` does once for all its ranks: print on rank 0, average a number."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist


def say(text: str) -> None:
    """Print on rank 0 only; before the process group exists, torchrun's RANK tells."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(text, file=sys.stderr, flush=True)


def global_mean(engine: Any, value: float) -> float:
    """The mean of ``value`` over ranks (each rank's loss, for the log)."""
    if engine.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    return float(engine.rt.comm.all_reduce_sum(t)) / engine.world_size
