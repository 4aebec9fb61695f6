"""A tied parameter is one tensor in ``model.state_dict()``, as in torch (shared_reads.py's
note). Found by a user-style probe: each name got a copy of its own, so
``model.save_pretrained`` wrote a tied head twice."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(x))))


@pytest.mark.parametrize(("offload", "dtype"), [("nvme", "fp32"), ("none", "bf16"),
                                               ("nvme", "bf16")])
def test_a_tied_weight_is_one_tensor_in_the_state_dict(tmp_path: Path, offload: str,
                                                        dtype: str) -> None:
    torch.manual_seed(0)
    model = Tied()
    masters = {k: v.clone() for k, v in model.state_dict().items()}
    engine = outcore.initialize(model, {"dtype": dtype, "offload": {
        "params": offload, "optimizer": offload, "nvme_path": str(tmp_path)}})
    sd = model.state_dict()
    assert sd["embed.weight"].untyped_storage().data_ptr() == (
        sd["head.weight"].untyped_storage().data_ptr())
    assert sd["mid.weight"].untyped_storage().data_ptr() != (
        sd["embed.weight"].untyped_storage().data_ptr())
    model.load_state_dict(sd)  # a write back of the very reads keeps the fp32 masters
    with engine.gathered_parameters():
        assert torch.equal(model.embed.weight.data, masters["embed.weight"])
    x = torch.randint(0, 32, (4, 6))
    engine.backward(model(x).float().logsumexp(-1).mean())
    engine.step()
    after = model.state_dict()  # a new state dict reads the new values
    assert not torch.equal(after["head.weight"].float(), sd["head.weight"].float())
    assert after["embed.weight"].untyped_storage().data_ptr() == (
        after["head.weight"].untyped_storage().data_ptr())
    # a submodule's own state_dict, and a deep copy's, are as before
    assert model.mid.state_dict()["weight"].shape == (16, 16)
    plain = copy.deepcopy(model)
    assert plain.state_dict()["head.weight"].shape == (32, 16)
    engine.close()
    assert "state_dict" not in model.__dict__  # handed back plain
