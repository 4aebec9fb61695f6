"""Buffers at more ranks are each rank's own, as under FSDP; averaged by the user's own
all-reduce, they agree (docs/python.md, "Coming from DDP, FSDP or accelerate")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from tests.distributed import run_world


def _running_means(sync: bool, swap: str) -> list[float]:
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    engine = outcore.initialize(model, {"dtype": "fp32", "offload": {
        "params": "nvme", "nvme_path": f"{swap}/{rank}"}})
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own data
    for _ in range(3):
        x = torch.randn(8, 3, generator=g) + 3 * rank
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    if sync:  # what the docs say to do: average them over the ranks
        import torch.distributed as dist

        for buf in (model[1].running_mean, model[1].running_var):
            dist.all_reduce(buf)
            buf /= dist.get_world_size()
    engine.close()
    return model[1].running_mean.tolist()


@pytest.mark.parametrize("sync", [False, True])
def test_batchnorm_statistics_are_each_ranks_until_averaged(tmp_path: Path, sync: bool) -> None:
    first, second = run_world(_running_means, 2, sync, str(tmp_path))
    assert (first == second) == sync, (first, second)
