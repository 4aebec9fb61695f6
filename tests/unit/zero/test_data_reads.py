"""What is read through ``p.data`` is outside autograd, as in torch, in every tier: with the
parameters on NVMe ``p.data.numpy()`` raised "Can't call numpy() on Tensor that requires
grad" (the read of a ``.data`` view was routed to the parameter's gradient)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import outcore


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_data_reads_are_plain_arrays_outside_autograd(offload: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    plain = {n: p.detach().clone() for n, p in model.named_parameters()}
    with outcore.initialize(model, {"dtype": "fp32", "offload": {
            "params": offload, "optimizer": offload, "nvme_path": str(tmp_path)}}):
        w = model[0].weight
        assert (w.data.numpy() == plain["0.weight"].numpy()).all()
        assert (w.data.cpu().numpy() == plain["0.weight"].numpy()).all()
        doubled = w.data * 2
        assert not doubled.requires_grad and torch.equal(doubled, plain["0.weight"] * 2)
        assert (w * 2).requires_grad  # the parameter itself stays autograd's
