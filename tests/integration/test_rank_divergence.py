"""Ranks whose control flow differs within a step (comm.py's [Note: the ranks' collectives are
compared]): two ranks on different groups of one size exchanged each other's shards, and
trained other weights than DDP, silently. Now refused on every rank, naming the rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.errors import ParamAccessError
from tests.distributed import run_world


class Experts(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, route: list[int]) -> torch.Tensor:
        for i in route:
            x = torch.tanh(self.experts[i](x))
        return self.head(x).pow(2).mean()


def _train(width: int, offload: str, swap: str, diverge_at: int, how: str) -> list[str]:
    """Three steps; from step ``diverge_at`` on each rank routes by its own data."""
    torch.manual_seed(0)
    model = Experts(width)
    engine = outcore.initialize(model, {"dtype": "fp32", "comm": {"timeout_s": 60}, "offload": {
        "params": offload, "optimizer": offload, "nvme_path": swap}})
    rank, said = engine.rank, []
    for step in range(3):
        same = [0, 1, 2, 3]
        route = same if step < diverge_at else {
            "expert": [rank], "order": same[::-1] if rank else same}[how]
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(step + rank))
        try:
            engine.backward(model(x.to(engine.device), route))
            engine.step()
            said.append("trained")
        except ParamAccessError as e:
            said.append(str(e))
            break
    engine.close()
    return said


@pytest.mark.parametrize(("width", "offload", "how"), [
    (160, "none", "expert"), (160, "nvme", "expert"), (160, "none", "order"),
    (8, "none", "expert")])
def test_ranks_running_different_modules_are_refused_on_every_rank(
        tmp_path: Path, width: int, offload: str, how: str) -> None:
    """Width 8 keeps every layer gathered (under zero.persistence_threshold_bytes) after the
    first step: the difference is then in backward's reductions only."""
    for said in run_world(_train, 2, width, offload, str(tmp_path), 1, how):
        assert said[0] == "trained" and len(said) == 2, said
        assert said[1].startswith("the ranks ran different modules in this "), said
        assert "call each expert even with no tokens" in said[1]


def test_the_same_modules_on_every_rank_train_on(tmp_path: Path) -> None:
    for said in run_world(_train, 2, 160, "nvme", str(tmp_path), 3, "expert"):
        assert said == ["trained"] * 3
