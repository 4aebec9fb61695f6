"""Activation checkpointing with offload: gradients equal to no checkpointing, bytes on disk.

The model is transformer-like and has the parts that make recomputation under ZeRO-3 tricky:
a block that owns a parameter directly (only the block's own hook fetches it), a block that
reads a child's weight outside the child, a root parameter passed into every block (a saved
checkpoint input that is parameter storage), a keyword tensor input, and dropout (the RNG
state must be restored for the recomputation).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.memory import saved_disk
from outcore.memory.activations import checkpoint_activations
from tests.common import ACT_BATCH as BATCH
from tests.common import ACT_DIM as DIM
from tests.common import ACT_LAYERS as LAYERS
from tests.common import ACT_SEQ as SEQ
from tests.common import ACT_VOCAB as VOCAB
from tests.common import ActAttention as Attention
from tests.common import ActBlock as Block
from tests.common import ActNet as Net
from tests.distributed import run_world

MODES = ["off", "none", "cpu", "nvme"]


def _input_bytes() -> int:
    """Bytes of the activations every block keeps: hidden state and the keyword tensor."""
    return LAYERS * (BATCH * SEQ * DIM + DIM) * 4


def _run(params: str, swap: str, steps: int) -> dict:
    """Train the same model once per checkpointing mode; return losses, grads, disk counters."""
    out: dict = {}
    for mode in MODES:
        cfg = outcore.Config.from_dict({
            "dtype": "fp32", "optimizer": {"lr": 1e-2, "eps": 1e-6},
            "zero": {"persistence_threshold_bytes": 0, "prefetch_bytes": 0,
                     "overlap_optimizer": False},  # grads must still be there after backward
            "offload": {"params": params, "nvme_path": swap},
        })
        torch.manual_seed(0)
        with outcore.init(cfg):
            model = Net()
        engine = outcore.initialize(model, cfg)
        if mode != "off":
            assert checkpoint_activations(model, Block, mode, engine) == LAYERS
        gen = torch.Generator().manual_seed(1)
        losses, grads, disk = [], [], []
        for _ in range(steps):
            idx = torch.randint(0, VOCAB, (BATCH * engine.world_size, SEQ), generator=gen)
            mine = idx[engine.rank * BATCH : (engine.rank + 1) * BATCH].to(engine.device)
            store = engine.rt.nvme if mode == "nvme" else None
            saved_disk.settle()
            before = (store.bytes_written, store.bytes_allocated) if store else (0, 0)
            loss = engine(mine)
            written = 0
            if store is not None:  # writes complete in the background: wait for them
                deadline = time.monotonic() + 10
                while (store.bytes_written - before[0] < _input_bytes()
                       and time.monotonic() < deadline):
                    time.sleep(0.01)
                written = store.bytes_written - before[0]
            engine.backward(loss)
            saved_disk.settle()  # the extents go on the saver's reaper thread
            allocated_after = store.bytes_allocated - before[1] if store else 0
            disk.append((written, allocated_after))
            grads.append(torch.cat([sp.grad.reshape(-1) for sp in engine.params]))
            losses.append(loss.item())
            engine.step()
        out[mode] = {"losses": losses, "grads": grads, "disk": disk,
                     "report": engine.memory_report()["by_kind"]}
        engine.close()
    return out


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-6) -> bool:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return float((a - b).norm()) <= tol * float(b.norm())


def _run_placements(placements: list[str], swap: str, steps: int) -> list[dict]:
    return [_run(params, swap, steps) for params in placements]  # one process group for all


@pytest.mark.parametrize(("world", "placements"), [(1, ["nvme"]), (2, ["none", "nvme"])])
def test_checkpointed_gradients_equal_no_checkpointing(world: int, placements: list[str],
                                                       tmp_path: Path) -> None:
    results = run_world(_run_placements, world, placements, str(tmp_path), 2)
    for r in (r for rank in results for r in rank):
        base = r["off"]
        for mode in MODES[1:]:
            for a, b in zip(r[mode]["losses"], base["losses"], strict=True):
                assert abs(a - b) <= 1e-6 * abs(b), (mode, r[mode]["losses"], base["losses"])
            for step, (g, ref) in enumerate(zip(r[mode]["grads"], base["grads"], strict=True)):
                assert _close(g, ref), f"{mode}: step {step} gradients differ"
        # offload='nvme' wrote every block's inputs during forward and freed them in backward
        for written, still_allocated in r["nvme"]["disk"]:
            assert written >= _input_bytes(), (written, _input_bytes())
            assert still_allocated == 0
        assert r["nvme"]["report"].get("nvme.activations", 0) == 0


def _count(blocks, model: nn.Module | None = None) -> int:
    return checkpoint_activations(model or Net(), blocks, "none")


def test_selection_by_class_tuple_and_predicate() -> None:
    assert _count(Block) == LAYERS
    assert _count((Block, Attention)) == 2 * LAYERS
    assert _count(lambda name, m: name == "blocks.1") == 1
    assert _count(lambda name, m: isinstance(m, nn.Linear) and m.out_features == VOCAB) == 1
    model = Net()
    assert _count(Block, model) == LAYERS
    assert _count(Block, model) == LAYERS  # again: replaces, does not wrap twice
    assert not hasattr(model.blocks[0].forward.original, "original")
    with pytest.raises(TypeError, match="predicate"):
        checkpoint_activations(Net(), "Block")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="offload"):
        checkpoint_activations(Net(), Block, "disk")  # type: ignore[arg-type]


def _plain_grads(blocks, offload: str) -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Net()
    if blocks is not None:
        checkpoint_activations(model, blocks, offload)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    loss = model(idx)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def test_plain_pytorch_nested_blocks_and_cpu_offload_without_copies() -> None:
    """Without outcore too; a block inside a checkpointed block is not checkpointed again;
    offload='cpu' of CPU tensors keeps the very same tensors (no copy)."""
    loss, grads = _plain_grads(None, "none")
    for blocks, offload in [(Block, "cpu"), ((Block, Attention, nn.Linear), "none")]:
        l2, g2 = _plain_grads(blocks, offload)
        assert l2 == loss
        for a, b in zip(g2, grads, strict=True):
            assert _close(a, b)

    torch.manual_seed(0)
    model = Net()
    checkpoint_activations(model, Block, "cpu")
    seen: list[int] = []
    model.blocks[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].data_ptr()))
    model(torch.randint(0, VOCAB, (BATCH, SEQ))).backward()
    assert len(seen) == 2 and seen[0] == seen[1]  # recomputed from the kept tensor itself


def test_nvme_offload_needs_a_runtime() -> None:
    model = Net()
    checkpoint_activations(model, Block, "nvme")
    with pytest.raises(ValueError, match="runtime"):
        model(torch.randint(0, VOCAB, (BATCH, SEQ)))


def _gpt2(checkpointing: str, swap: str, steps: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    cfg = outcore.Config(dtype="fp32", optimizer={"lr": 1e-3, "eps": 1e-6},
                         zero={"persistence_threshold_bytes": 0},
                         offload={"params": "nvme", "nvme_path": swap})
    torch.manual_seed(0)
    with outcore.init(cfg):
        model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128,
                                           n_positions=64, bos_token_id=0, eos_token_id=0))
    engine = outcore.initialize(model, cfg)
    wrapped = 0
    if checkpointing != "off":
        wrapped = checkpoint_activations(model, GPT2Block, checkpointing, engine)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    ids, losses = ids.to(engine.device), []
    for _ in range(steps):
        # a KV cache would be updated again by the recomputation: train without one
        loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    written = engine.rt.nvme.bytes_written
    engine.close()
    return {"losses": losses, "wrapped": wrapped, "written": written}


def test_hugging_face_gpt2_checkpointed_by_block_class(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    base = _gpt2("off", str(tmp_path), 3)
    ckpt = _gpt2("nvme", str(tmp_path), 3)
    assert ckpt["wrapped"] == 3
    assert ckpt["losses"] == pytest.approx(base["losses"], rel=1e-6)
    assert ckpt["losses"][-1] < ckpt["losses"][0]
    assert ckpt["written"] >= base["written"] + 3 * 2 * 16 * 64 * 4 * 3  # 3 steps x 3 blocks


def _lora_run(folder: Path, swap: Path, checkpointed: bool) -> tuple[list[float], dict, int]:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from outcore.hf.lora import apply_lora

    cfg = {"dtype": "fp32", "zero": {"persistence_threshold_bytes": 0, "prefetch_bytes": 0},
           "offload": {"params": "nvme", "optimizer": "cpu", "nvme_path": str(swap)}}
    torch.manual_seed(0)
    with outcore.init(cfg, frozen=True, weights=folder):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(folder))
    model.config.use_cache = False
    model = apply_lora(model, "r=4,alpha=8,targets=q_proj,v_proj")
    if checkpointed:
        assert checkpoint_activations(model, transformers.models.llama.modeling_llama.
                                      LlamaDecoderLayer) == 4
    engine = outcore.initialize(model, cfg)
    x = torch.arange(64).reshape(2, 32) % 300
    losses = []
    for _ in range(2):
        engine.rt.ledger.reset_peaks()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    peak = engine.memory_report()["by_kind"]["peak.device.unsharded"]
    with engine.gathered_parameters():
        adapters = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    engine.close()
    return losses, adapters, peak


def test_a_frozen_base_recomputed_in_backward_is_released_block_by_block(tmp_path: Path) -> None:
    """Frozen layers a recomputation gathers in backward go once that block's backward is done
    (backward_holds.py's [Note: frozen groups in backward]), not when backward ends; and the
    adapters train exactly as without checkpointing."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    folder = tmp_path / "base"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )).save_pretrained(folder)
    plain = _lora_run(folder, tmp_path / "s1", checkpointed=False)
    ckpt = _lora_run(folder, tmp_path / "s2", checkpointed=True)
    assert ckpt[0] == pytest.approx(plain[0], rel=1e-6)
    for name, t in plain[1].items():
        torch.testing.assert_close(ckpt[1][name], t, msg=name)
    # the gathered bytes peak at about one decoder layer (q, o: 64x64; k, v: 64x32; three MLP
    # matrices 64x160; two norms; fp32) and the embedding and head, where holding every
    # recomputed layer until backward ends holds all four layers
    layer = 4 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 160 + 2 * 64)
    embed = 4 * 300 * 64
    assert ckpt[2] <= 2 * layer + 2 * embed, (ckpt[2], layer, embed)
