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


def test_a_hooks_read_during_the_state_dict_is_its_own_copy(tmp_path: Path) -> None:
    """Found by a reviewer: a state-dict hook's ``p.detach().mul_(0)`` wrote into the copy the
    state dict holds (torch would write the parameter; here a copy changes, and the state
    dict must not show it)."""
    torch.manual_seed(0)
    model = Tied()
    want = model.embed.weight.detach().clone()
    engine = outcore.initialize(model, {"dtype": "fp32", "offload": {
        "params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)}})
    model.head.register_state_dict_pre_hook(
        lambda *_: model.embed.weight.detach().mul_(0))
    sd = model.state_dict()
    assert torch.equal(sd["embed.weight"], want) and torch.equal(sd["head.weight"], want)
    engine.close()


def test_a_peft_models_base_model_shares_its_tied_weight(tmp_path: Path) -> None:
    """``pm.get_base_model().save_pretrained()`` still wrote the tied head twice: only the
    root's ``state_dict`` shared reads (found by a reviewer)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from outcore.hf import apply_lora

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    pm = apply_lora(transformers.LlamaForCausalLM(cfg), "r=2,targets=q_proj")
    engine = outcore.initialize(pm, {"dtype": "fp32", "offload": {
        "params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)}})
    sd = pm.get_base_model().state_dict()
    assert sd["lm_head.weight"].untyped_storage().data_ptr() == (
        sd["model.embed_tokens.weight"].untyped_storage().data_ptr())
    engine.close()
