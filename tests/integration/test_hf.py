"""Hugging Face models, unchanged, train with outcore exactly like plain PyTorch."""

from __future__ import annotations

import pytest
import torch

import outcore
from tests.common import ranks_mean
from tests.distributed import run_world

transformers = pytest.importorskip("transformers")

SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64}


def build(name: str) -> torch.nn.Module:
    """Random-init models from configs (no download); dropout off so runs are comparable."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
                                          n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**SMALL))
    return Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=True))


def _train(name: str, steps: int) -> dict:
    cfg = outcore.Config(dtype="fp32", optimizer={"lr": 1e-3, "eps": 1e-6},
                         zero={"persistence_threshold_bytes": 0})
    torch.manual_seed(0)
    ref = build(name)
    torch.manual_seed(0)
    with outcore.init(cfg):
        model = build(name)
    engine = outcore.initialize(model, cfg)
    rank, world = engine.rank, engine.world_size
    ref.to(engine.device)  # plain PyTorch on the same compute device
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    ids = torch.randint(0, 128, (2 * world, 16), generator=gen).to(engine.device)  # learned
    for _ in range(steps):
        loss = engine(input_ids=ids[2 * rank : 2 * rank + 2],
                      labels=ids[2 * rank : 2 * rank + 2]).loss
        engine.backward(loss)
        engine.step()
        losses.append(ranks_mean(loss, world))
        # the reference sees each rank's half separately, as HF's loss is a per-batch mean
        opt.zero_grad()
        parts = [ref(input_ids=ids[2 * r : 2 * r + 2], labels=ids[2 * r : 2 * r + 2]).loss
                 for r in range(world)]
        (sum(parts) / world).backward()
        opt.step()
        ref_losses.append(sum(p.item() for p in parts) / world)
    engine.close()
    return {"losses": losses, "ref_losses": ref_losses}


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("world", [1, 2])
def test_hf_model_matches_plain_pytorch(name: str, world: int) -> None:
    for r in run_world(_train, world, name, 4):
        for a, b in zip(r["losses"], r["ref_losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (name, r["losses"], r["ref_losses"])
        assert r["losses"][-1] < r["losses"][0]
