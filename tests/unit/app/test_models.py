"""GPT presets: sizes, the tied head, deterministic init, and the HF loader's errors."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from outcore.app.models import (
    GPT,
    PRESETS,
    GPTConfig,
    build_model,
    hf_has_weights,
    load_hf_model,
    num_params,
)
from outcore.errors import ConfigError


def _unique_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_param_count_matches_analytic(name: str) -> None:
    with torch.device("meta"):  # shapes only: gpt-3b would need 12 GB of fp32 otherwise
        model = build_model(name)
    assert _unique_params(model) == num_params(PRESETS[name])


def test_untied_head_adds_vocab_times_hidden() -> None:
    cfg = GPTConfig(layers=1, hidden=32, heads=2, vocab=50, seq_len=16, tie_embeddings=False)
    tied = GPTConfig(layers=1, hidden=32, heads=2, vocab=50, seq_len=16)
    assert num_params(cfg) - num_params(tied) == 50 * 32
    assert _unique_params(GPT(cfg)) == num_params(cfg)


def test_preset_sizes_are_what_their_names_say() -> None:
    assert 1e6 <= num_params(PRESETS["tiny"]) < 5e6
    assert num_params(PRESETS["small"]) < 50e6
    assert 320e6 <= num_params(PRESETS["gpt-335m"]) <= 350e6
    assert 1.2e9 <= num_params(PRESETS["gpt-1.3b"]) <= 1.4e9
    assert num_params(PRESETS["gpt-3b"]) >= 3e9
    assert num_params(PRESETS["gpt-6b"]) * 16 >= 96e9  # model states beyond an 80 GB GPU
    assert PRESETS["tiny"].vocab == PRESETS["small"].vocab == 256  # byte-level


def test_tied_head_shares_the_embedding_parameter() -> None:
    model = build_model("tiny")
    assert model.lm_head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # one Parameter, registered once
    idx = torch.randint(0, 256, (2, 16))
    model(idx, idx).backward()
    # The gradient holds both uses: the output head's and the embedding lookup's.
    g = model.tok_emb.weight.grad
    unused_rows = torch.ones(256, dtype=torch.bool)
    unused_rows[idx.unique()] = False
    assert g is not None and g[unused_rows].abs().sum() > 0  # head touches every row


def test_same_seed_same_weights_and_different_seed_differs() -> None:
    def weights(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return build_model("tiny").state_dict()

    a, b, c = weights(1), weights(1), weights(2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])


def test_gpt2_style_init() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(layers=8, hidden=256, heads=4, vocab=256, seq_len=64)
    model = GPT(cfg)
    resid = 0.02 / math.sqrt(2 * cfg.layers)
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(resid, rel=0.05)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(resid, rel=0.05)
    assert model.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert all(m.bias.abs().sum() == 0 for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m.bias is not None)


def test_forward_logits_and_loss() -> None:
    torch.manual_seed(0)
    model = build_model("tiny")
    idx = torch.randint(0, 256, (3, 32))
    assert model(idx).shape == (3, 32, 256)
    loss = model(idx, torch.randint(0, 256, (3, 32)))
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(math.log(256), abs=0.3)  # near-uniform at init


def test_forward_is_causal() -> None:
    torch.manual_seed(0)
    model = build_model("tiny").eval()
    idx = torch.randint(0, 256, (1, 20))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    torch.testing.assert_close(model(idx)[:, :10], model(changed)[:, :10])


def test_too_long_sequence_is_rejected() -> None:
    model = build_model("tiny")
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, PRESETS["tiny"].seq_len + 1, dtype=torch.long))


def test_bad_names_and_shapes_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="tiny"):
        build_model("gpt-9000")
    with pytest.raises(ConfigError, match="heads"):
        GPTConfig(layers=1, hidden=30, heads=4, vocab=10, seq_len=8)
    with pytest.raises(ConfigError, match="layers"):
        GPTConfig(layers=0, hidden=32, heads=4, vocab=10, seq_len=8)


def test_a_path_that_is_no_model_folder_is_told_as_a_path(tmp_path, monkeypatch) -> None:
    """A mistyped folder is named as a folder, not as an unknown preset (which would send the
    user to the preset list), by ``outcore train --model`` and ``outcore estimate --model``."""
    from outcore.app.models import preset_shape, resolve_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"x")
    cases = {"./not/there": "./not/there: no such folder",
             "~/not-there-either": "no such folder",
             "empty": "empty is a folder with no config.json",
             "weights.bin": "weights.bin is a file; give the Hugging Face model folder",
             "gpt-9000": "unknown preset 'gpt-9000'; choose one of tiny"}
    for name, message in cases.items():
        for find in (resolve_config, preset_shape):
            with pytest.raises(ConfigError, match=message.replace(".", r"\.")) as e:
                find(name)
            assert "unknown preset" not in str(e.value) or name == "gpt-9000"


def test_hf_loader_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        load_hf_model(tmp_path)
    if importlib.util.find_spec("transformers") is None:
        (tmp_path / "config.json").write_text("{}")
        with pytest.raises(ConfigError, match="pip install transformers"):
            load_hf_model(tmp_path)


def test_hf_model_from_a_local_config(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300,
                            n_positions=16).save_pretrained(tmp_path)
    model = load_hf_model(tmp_path)  # random init from config.json alone, no download
    assert isinstance(model, transformers.GPT2LMHeadModel)
    assert model.config.vocab_size == 300 and not hf_has_weights(tmp_path)
