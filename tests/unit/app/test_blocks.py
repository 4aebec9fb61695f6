"""Which blocks ``outcore train`` checkpoints: the same gradients, the first blocks, the count
``auto`` picks from the memory, and one count on every rank."""

from __future__ import annotations

import pytest
import torch

from outcore.app.blocks import checkpoint_blocks
from outcore.app.models import GPT, GPTConfig, build_model
from outcore.errors import ConfigError


def test_checkpointed_blocks_give_the_same_gradients_and_auto_picks_by_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from outcore.app import blocks as app_blocks

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
        monkeypatch.setattr(app_blocks, "_device_memory", lambda m=memory: m)
        config = transformers.LlamaConfig(hidden_size=6656, intermediate_size=17920,
                                          num_hidden_layers=60, num_attention_heads=52,
                                          vocab_size=32000)
        with torch.device("meta"):
            llama = transformers.LlamaForCausalLM(config)
        assert checkpoint_blocks(llama, "auto", 1, 256) == blocks, memory
        assert llama.config.use_cache is (blocks == 0)


def test_a_long_context_that_trains_is_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal counts what must be held whatever the attention kernel: at 32,768 tokens
    the attention scores a plain kernel would keep (5·a·s²·b, 21 GB a layer here) are never
    kept by SDPA, and this tiny Llama trains in under 1 GiB. A batch whose logits alone pass
    the memory is still refused, naming the memory it would need."""
    import transformers

    from outcore.app import blocks as app_blocks

    monkeypatch.setattr(app_blocks, "_device_memory", lambda: 4 << 30)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      vocab_size=256, max_position_embeddings=32768)
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(config)
    assert checkpoint_blocks(llama, "auto", 1, 32768) == 2  # the upper bound: checkpoint
    with pytest.raises(ConfigError, match=r"--batch 1000 x --seq 32768: the activations "
                       r"need at least 113 GB .* and 4\.29 GB of host memory is free"):
        checkpoint_blocks(llama, "auto", 1000, 32768)


def test_a_part_of_the_blocks_is_the_first_ones_and_gives_the_same_gradients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A number of blocks checkpoints that many, the model's first (backward reaches them
    after the others' activations are freed), with the gradients of no checkpointing;
    ``auto`` takes as few as bring the estimate under its share."""
    from outcore.app import blocks as app_blocks

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
    with pytest.warns(UserWarning, match="99 blocks asked for, the model has 6"):
        assert checkpoint_blocks(GPT(cfg), 99, 2, 32) == 6  # more than there are: all
    for bad in (-1, True, 2.0):
        with pytest.raises(ConfigError, match="allowed: auto, on, off, or a number"):
            checkpoint_blocks(GPT(cfg), bad, 2, 32)  # type: ignore[arg-type]
    # a memory where the estimate passes the share by 2.5 blocks' savings: 3 blocks
    est = app_blocks._activation_estimate(GPT(cfg), 2, 32)
    assert est is not None
    saved = (est.activations_full - 4 * 2 * 32 * 256 - est.activation_checkpoints) / 6
    share = est.activations_full - 2.5 * saved
    monkeypatch.setattr(app_blocks, "_device_memory",
                        lambda: int(share / app_blocks.ACTIVATIONS_SHARE) + 1)
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


def test_more_blocks_than_the_model_has_checkpoints_all_and_says_so() -> None:
    """``--checkpoint-activations 5`` on a 2-block model was taken as 2 without a word."""
    model = build_model("tiny")
    with pytest.warns(UserWarning, match=r"5 blocks asked for, the model has 2; all are "):
        assert checkpoint_blocks(model, 5, 2, 32) == 2


def test_a_block_nested_in_another_counts_as_part_of_it() -> None:

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
    from outcore.app import blocks as app_blocks
    from outcore.device.accel import Accelerator
    from outcore.runtime.bootstrap import join_world

    join_world(Accelerator.detect().backend, 60)
    app_blocks._device_memory = lambda: memory_by_rank[dist.get_rank()]
    cfg = GPTConfig(layers=6, hidden=32, heads=2, vocab=256, seq_len=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    count = app_blocks.checkpoint_blocks(model, "auto", 2, 32)
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
    from outcore.app import blocks as app_blocks
    from tests.distributed import run_world

    est = app_blocks._activation_estimate(
        GPT(GPTConfig(layers=6, hidden=32, heads=2, vocab=256, seq_len=32)), 2, 32)
    assert est is not None
    saved = (est.activations_full - 4 * 2 * 32 * 256 - est.activation_checkpoints) / 6
    memory = [int((est.activations_full - k * saved) / app_blocks.ACTIVATIONS_SHARE) + 1
              for k in (0.5, 3.5)]  # rank 0 needs 1 block, rank 1 needs 4
    results = run_world(_auto_on_a_rank, 2, memory)
    assert [r[0] for r in results] == [4, 4]
    assert [r[1] for r in results] == [[0, 1, 2, 3]] * 2


def _refused_on_a_rank(memory_by_rank: list[int]) -> str:
    """One rank: join the world, check a batch against this rank's free memory."""
    import torch.distributed as dist

    from outcore.app import blocks as app_blocks
    from outcore.device.accel import Accelerator
    from outcore.runtime.bootstrap import join_world

    join_world(Accelerator.detect().backend, 60)
    app_blocks._device_memory = lambda: memory_by_rank[dist.get_rank()]
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=32, heads=2, vocab=256, seq_len=32))
    try:
        app_blocks.checkpoint_blocks(model, "on", 64, 32)
    except ConfigError as e:
        return str(e)
    return "taken"


def test_a_batch_one_rank_cannot_hold_is_refused_on_every_rank() -> None:
    """Only the rank short of memory refused; the other went on into ``initialize`` and
    waited there for it until the process group's timeout."""
    from tests.distributed import run_world

    said = run_world(_refused_on_a_rank, 2, [1 << 40, 1 << 20])
    assert said[1].startswith("--batch 64 x --seq 32: the activations need at least "), said
    assert "more than another rank's memory holds" in said[0], said


def _warned_on_a_rank(mode: str | int) -> list[str]:
    """One rank: join the world, checkpoint a 2-block preset's blocks; what it warned."""
    import warnings

    from outcore.device.accel import Accelerator
    from outcore.runtime.bootstrap import join_world

    join_world(Accelerator.detect().backend, 60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint_blocks(build_model("tiny"), mode, 2, 32)
    return [str(w.message) for w in caught]


def test_a_count_slip_is_said_once_by_rank_0_and_a_model_without_blocks_is_named() -> None:
    """Every rank of a job printed the same warning; a model without repeated blocks given
    ``on`` checkpointed nothing without a word, and given a count read "the model has 0"."""
    from tests.distributed import run_world

    said = run_world(_warned_on_a_rank, 2, 5)
    assert len(said[0]) == 1 and "5 blocks asked for" in said[0][0], said
    assert said[1] == [], said
    for mode in ("on", 3):
        with pytest.warns(UserWarning, match="the model has no repeated blocks .*none is "
                          "checkpointed"):
            assert checkpoint_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)), mode, 1,
                                     1) == 0


def test_on_a_gpu_the_checkpoints_do_not_count_against_its_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpointed block's input waits in host memory on a GPU; the refusal counted it
    against the GPU's memory and refused a batch that trains there."""
    from outcore.app import blocks as app_blocks

    model = GPT(GPTConfig(layers=24, hidden=64, heads=2, vocab=256, seq_len=32))
    est = app_blocks._activation_estimate(model, 64, 32)
    assert est is not None
    held = 34 * 32 * 64 * 64 + 4 * 64 * 32 * 256  # one block's least and the logits
    monkeypatch.setattr(app_blocks, "_device_memory",
                        lambda: int(held + est.activation_checkpoints / 2))
    with pytest.raises(ConfigError, match="of host memory is free"):  # on the host: all there
        checkpoint_blocks(model, "on", 64, 32)
    monkeypatch.setattr(app_blocks, "default_device", lambda: torch.device("cuda"))
    assert checkpoint_blocks(model, "on", 64, 32) == 24
