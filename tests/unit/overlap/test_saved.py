"""A tensor saved for backward and changed in place before backward fails as it does in torch,
also where the engine's saved-tensor hooks are active (overlap/saved.py's note): before, a run
with parameters on NVMe trained on the changed values without a word."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.overlap.saved import Kept


class _ExpHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).exp()  # exp saves its output


@pytest.mark.parametrize("params", ["none", "nvme"])
def test_an_output_changed_in_place_before_backward_raises(params: str, tmp_path: Path) -> None:
    x = torch.randn(4, 8)
    plain = _ExpHead()
    y = plain(x)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

    cfg = outcore.Config.from_dict({"dtype": "fp32", "zero": {"persistence_threshold_bytes": 0},
                                    "offload": {"params": params, "nvme_path": str(tmp_path)}})
    with outcore.init(cfg):
        model = _ExpHead()
    engine = outcore.initialize(model, cfg)
    y = engine(x)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        engine.backward(y.sum())
    engine.close()


def test_kept_hands_back_the_tensor_until_it_changes() -> None:
    t = torch.ones(3)
    kept = Kept(t)
    assert kept.get().data_ptr() == t.data_ptr()
    t.add_(1)
    with pytest.raises(RuntimeError, match="is at version 1; expected version 0"):
        kept.get()


@pytest.mark.parametrize("params", ["none", "nvme"])
def test_a_graph_dropped_without_backward_is_freed(params: str, tmp_path: Path) -> None:
    """An evaluation with gradients on: each forward's activations go with its loss. Under the
    engine's saved-tensor hooks (params on NVMe) an output saved by its own operation (exp)
    held its graph in a loop the collector could not see, and every such forward leaked."""
    cfg = outcore.Config.from_dict({"dtype": "fp32", "zero": {"persistence_threshold_bytes": 0},
                                    "offload": {"params": params, "nvme_path": str(tmp_path)}})
    with outcore.init(cfg):
        model = _ExpHead()
    engine = outcore.initialize(model, cfg)
    outputs = []
    for _ in range(3):
        y = engine(torch.randn(4, 8))
        outputs.append(weakref.ref(y))
        del y
    gc.collect()
    assert all(r() is None for r in outputs)
    engine.close()
