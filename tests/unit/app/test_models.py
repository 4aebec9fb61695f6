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


def test_checkpointed_blocks_give_the_same_gradients_and_auto_picks_by_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from outcore.app import models as app_models
    from outcore.app.models import checkpoint_blocks

    torch.manual_seed(0)
    plain = build_model("tiny")
    torch.manual_seed(0)
    ckpt = build_model("tiny")
    assert checkpoint_blocks(ckpt, "auto", 2, 32) == 0  # a few KB of activations: left alone
    assert checkpoint_blocks(ckpt, "off", 2, 32) == 0
    assert checkpoint_blocks(ckpt, "on", 2, 32) == len(ckpt.blocks)
    x = torch.randint(0, 256, (2, 33))
    for m in (plain, ckpt):
        m(x[:, :-1], x[:, 1:]).backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    # a 30B Llama at 256 tokens keeps ~4.5 GB of activations (75 MB a layer): where that
    # passes 1/8 of the memory, auto checkpoints the fewest of its 60 layers that bring it
    # under (19 at 3 GiB: a 24 GiB host; 34 at 16 GiB), all of them where nothing would do
    for memory, blocks in ((1 << 30, 60), (16 << 30, 34), (24 << 30, 19), (64 << 30, 0)):
        monkeypatch.setattr(app_models, "_device_memory", lambda m=memory: m)
        config = transformers.LlamaConfig(hidden_size=6656, intermediate_size=17920,
                                          num_hidden_layers=60, num_attention_heads=52,
                                          vocab_size=32000)
        with torch.device("meta"):
            llama = transformers.LlamaForCausalLM(config)
        assert checkpoint_blocks(llama, "auto", 1, 256) == blocks, memory
        assert llama.config.use_cache is (blocks == 0)


def test_a_part_of_the_blocks_is_the_first_ones_and_gives_the_same_gradients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A number of blocks checkpoints that many, the model's first (backward reaches them
    after the others' activations are freed), with the gradients of no checkpointing;
    ``auto`` takes as few as bring the estimate under its share."""
    from outcore.app import models as app_models
    from outcore.app.models import checkpoint_blocks

    cfg = GPTConfig(layers=6, hidden=32, heads=2, vocab=256, seq_len=32)
    torch.manual_seed(0)
    plain = GPT(cfg)
    torch.manual_seed(0)
    part = GPT(cfg)
    assert checkpoint_blocks(part, 2, 2, 32) == 2
    assert [i for i, b in enumerate(part.blocks) if "forward" in b.__dict__] == [0, 1]
    x = torch.randint(0, 256, (2, 33))
    for m in (plain, part):
        m(x[:, :-1], x[:, 1:]).backward()
    for (name, a), b in zip(plain.named_parameters(), part.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    assert checkpoint_blocks(GPT(cfg), 99, 2, 32) == 6  # more than there are: all of them
    for bad in (-1, True, 2.0):
        with pytest.raises(ConfigError, match="allowed: auto, on, off, or a number"):
            checkpoint_blocks(GPT(cfg), bad, 2, 32)  # type: ignore[arg-type]
    # a memory where the estimate passes the share by 2.5 blocks' savings: 3 blocks
    est = app_models._activation_estimate(GPT(cfg), 2, 32)
    assert est is not None
    saved = (est.activations_full - 4 * 2 * 32 * 256 - est.activation_checkpoints) / 6
    share = est.activations_full - 2.5 * saved
    monkeypatch.setattr(app_models, "_device_memory",
                        lambda: int(share / app_models.ACTIVATIONS_SHARE) + 1)
    assert checkpoint_blocks(GPT(cfg), "auto", 2, 32) == 3


class _Inner(torch.nn.Linear):
    pass


class _Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).relu()


class _Nested(torch.nn.Module):
    """A model whose split modules nest, as Mamba's layer and the mixer inside it."""

    _no_split_modules = ["_Outer", "_Inner"]

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Outer() for _ in range(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_block_nested_in_another_counts_as_part_of_it() -> None:
    from outcore.app.models import checkpoint_blocks

    model = _Nested()
    assert checkpoint_blocks(model, "on", 1, 1) == 12
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == [
        f"layers.{i}" for i in range(12)]
    model = _Nested()  # "layers.10" is not inside "layers.1"
    assert checkpoint_blocks(model, 11, 1, 1) == 11
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == [
        f"layers.{i}" for i in range(11)]


def _auto_on_a_rank(memory_by_rank: list[int]) -> tuple[int, list[int], float]:
    """One rank: join the world, let ``auto`` choose with this rank's free memory, train a
    step. Returns the count, the checkpointed blocks and the loss."""
    import torch.distributed as dist

    import outcore
    from outcore.app import models as app_models
    from outcore.device.accel import Accelerator
    from outcore.runtime.bootstrap import join_world

    join_world(Accelerator.detect().backend, 60)
    app_models._device_memory = lambda: memory_by_rank[dist.get_rank()]
    cfg = GPTConfig(layers=6, hidden=32, heads=2, vocab=256, seq_len=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    count = app_models.checkpoint_blocks(model, "auto", 2, 32)
    engine = outcore.initialize(model, {"dtype": "fp32", "optimizer": {"lr": 1e-3}})
    x = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    loss = engine(x[:, :-1], x[:, 1:])
    engine.backward(loss)
    engine.step()
    engine.close()
    return count, [i for i, b in enumerate(model.blocks) if "forward" in b.__dict__], loss.item()


def test_every_rank_checkpoints_the_blocks_the_most_pressed_rank_needs() -> None:
    """Each rank's free memory differs; recomputing a block gathers its parameters (a
    collective), so ``auto`` takes the largest count any rank asks for, on every rank."""
    from outcore.app import models as app_models
    from tests.distributed import run_world

    est = app_models._activation_estimate(
        GPT(GPTConfig(layers=6, hidden=32, heads=2, vocab=256, seq_len=32)), 2, 32)
    assert est is not None
    saved = (est.activations_full - 4 * 2 * 32 * 256 - est.activation_checkpoints) / 6
    memory = [int((est.activations_full - k * saved) / app_models.ACTIVATIONS_SHARE) + 1
              for k in (0.5, 3.5)]  # rank 0 needs 1 block, rank 1 needs 4
    results = run_world(_auto_on_a_rank, 2, memory)
    assert [r[0] for r in results] == [4, 4]
    assert [r[1] for r in results] == [[0, 1, 2, 3]] * 2
