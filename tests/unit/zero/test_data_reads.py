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


@pytest.mark.parametrize(("offload", "dtype"), [("none", "fp32"), ("nvme", "fp32"),
                                               ("none", "bf16")])
def test_autograd_grad_of_a_parameter(offload: str, dtype: str, tmp_path: Path) -> None:
    """In memory at one rank the parameter is the tensor computed with: torch's gradient.
    Gathered per use (here, on NVMe) it is not in the graph: refused by name (it was torch's
    "appears to not have been used in the graph")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    want = torch.autograd.grad(ref(x).pow(2).mean(), list(ref.parameters()))
    with outcore.initialize(model, {"dtype": dtype, "offload": {
            "params": offload, "optimizer": offload, "nvme_path": str(tmp_path)}}):
        loss = model(x).pow(2).mean()
        if (offload, dtype) == ("none", "fp32"):  # the parameter is what the model computes with
            got = torch.autograd.grad(loss, list(model.parameters()))
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        else:
            with pytest.raises(outcore.ParamAccessError, match="autograd.grad with respect "
                                                               "to parameter 0.weight"):
                torch.autograd.grad(loss, list(model.parameters()))
