"""A folder the model's own ``save_pretrained`` wrote loads through ``outcore.init(cfg,
weights=folder)`` and ``outcore.load_pretrained`` where transformers renames or fuses its
tensors on load (zero/folder_names.py's note): GPT-NeoX's ``embed_out``, Mixtral's and Qwen2-MoE's
experts one tensor per expert on disk and one fused parameter in memory. Both were refused
("missing lm_head.weight; unexpected embed_out.weight"), found by a user's probe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import outcore
from tests.distributed import run_world

transformers = pytest.importorskip("transformers")

_SMALL = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def _make(kind: str) -> Any:
    t = transformers
    if kind == "gpt_neox":
        return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4))
    if kind == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(**_SMALL, num_local_experts=3))
    return t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(
        **_SMALL, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=32))


def _logits(model: Any, engine: outcore.Engine | None = None) -> torch.Tensor:
    ids = torch.arange(12).view(1, 12) % 128
    with torch.no_grad():
        return (engine or model)(input_ids=ids).logits


def _load(kind: str, folder: str, how: str, params: str, swap: str) -> torch.Tensor:
    cfg = {"dtype": "fp32", "offload": {"params": params, "optimizer": params,
                                        "nvme_path": swap}}
    torch.manual_seed(1)  # other values than the folder's, where anything is not loaded
    if how == "init":
        with outcore.init(cfg, weights=folder):
            model = _make(kind)
    else:
        model = _make(kind)
        outcore.load_pretrained(model, folder)
    engine = outcore.initialize(model, cfg)
    out = _logits(model, engine)
    engine.close()
    return out


@pytest.mark.parametrize("kind", ["gpt_neox", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("how", ["init", "load_pretrained"])
@pytest.mark.parametrize("params", ["none", "nvme"])
def test_a_folder_save_pretrained_wrote_loads_its_values(tmp_path: Path, kind: str, how: str,
                                                         params: str) -> None:
    torch.manual_seed(0)
    plain = _make(kind).eval()
    plain.save_pretrained(tmp_path / "folder")
    want = _logits(plain)
    got = _load(kind, str(tmp_path / "folder"), how, params, str(tmp_path / "swap"))
    assert torch.equal(got, want)


def test_fused_experts_load_at_two_ranks(tmp_path: Path) -> None:
    """Each rank cuts its own slice of a fused parameter made from the folder's tensors."""
    torch.manual_seed(0)
    plain = _make("mixtral").eval()
    plain.save_pretrained(tmp_path / "folder")
    want = _logits(plain)
    for how in ("init", "load_pretrained"):
        got = run_world(_load, 2, "mixtral", str(tmp_path / "folder"), how, "nvme",
                        str(tmp_path / "swap"))
        assert all(torch.equal(torch.as_tensor(g), want) for g in got), how


def test_a_folder_that_does_not_match_is_still_refused_by_name(tmp_path: Path) -> None:
    torch.manual_seed(0)
    _make("gpt_neox").save_pretrained(tmp_path / "folder")
    with pytest.raises(outcore.ConfigError, match="missing .*mlp.experts"):
        outcore.load_pretrained(_make("mixtral"), tmp_path / "folder")
