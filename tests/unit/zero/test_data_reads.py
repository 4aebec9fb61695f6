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


@pytest.mark.parametrize(("offload", "dtype"), [("none", "bf16"), ("nvme", "fp32"),
                                               ("nvme", "bf16")])
def test_new_tensors_shaped_like_p_data(offload: str, dtype: str, tmp_path: Path) -> None:
    """``torch.zeros_like(p.data)``, ``full_like`` and ``p.data.new_full(...)`` need only the
    shape, strides and dtype; found by a user-style probe, they were refused where ``p.data``
    is a view of the shards, in words about "a view" the user never made."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    with outcore.initialize(model, {"dtype": dtype, "offload": {
            "params": offload, "optimizer": offload, "nvme_path": str(tmp_path)}}) as engine:
        w = model[0].weight
        want = torch.bfloat16 if dtype == "bf16" else torch.float32
        made = {"zeros_like": torch.zeros_like(w.data), "full_like": torch.full_like(w.data, 3),
                "ones_like of a transpose": torch.ones_like(w.data.t()),
                "empty_like": torch.empty_like(w.data), "randn_like": torch.randn_like(w.data),
                "new_zeros": w.data.new_zeros(5), "new_full": w.data.new_full((2, 3), 1.5)}
        for name, t in made.items():
            assert type(t) is torch.Tensor and t.dtype == want, name
        assert torch.equal(made["zeros_like"], torch.zeros(16, 8, dtype=want))
        assert torch.equal(made["full_like"], torch.full((16, 8), 3, dtype=want))
        assert made["ones_like of a transpose"].stride() == (1, 8)  # as torch keeps a layout
        assert torch.equal(made["new_full"], torch.full((2, 3), 1.5, dtype=want))
        assert torch.zeros_like(w.data, dtype=torch.float64).dtype == torch.float64
        x = torch.randn(4, 8)  # the model still trains after
        engine.backward(model(x).pow(2).mean())
        engine.step()
