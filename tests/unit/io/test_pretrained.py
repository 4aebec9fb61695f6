"""Pretrained safetensors weights load straight into sharded, offloaded parameters."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import outcore
from tests.common import hf_steps
from tests.distributed import run_world

transformers = pytest.importorskip("transformers")


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=96,
                                      n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _load_and_finetune(folder: str, swap: str, out: str) -> dict:
    cfg = outcore.Config(dtype="fp32", optimizer={"lr": 1e-3},
                         zero={"persistence_threshold_bytes": 0},
                         offload={"params": "nvme", "optimizer": "nvme", "nvme_path": swap})
    torch.manual_seed(123)  # a different init, so the load must overwrite it
    with outcore.init(cfg):
        model = _gpt2()
    outcore.load_pretrained(model, folder)
    engine = outcore.initialize(model, cfg)
    with engine.gathered_parameters():
        loaded = {n: p.data.clone() for n, p in model.named_parameters()}
    ids = (torch.arange(32).reshape(2, 16) % 96).to(engine.device)
    losses = hf_steps(engine, ids, 3)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=ids).logits.clone()
    engine.save_checkpoint(Path(out) / "ckpt")
    engine.close()
    return {"loaded": loaded, "losses": losses, "logits": logits}


@pytest.mark.parametrize("world", [1, 2])
def test_hf_sharded_weights_load_into_nvme_shards_and_finetune(world: int,
                                                               tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = _gpt2()
    folder = tmp_path / "pretrained"
    plain.save_pretrained(folder, max_shard_size="40KB")  # several files + an index
    assert (folder / "model.safetensors.index.json").exists()
    results = run_world(_load_and_finetune, world, str(folder), str(tmp_path),
                        str(tmp_path / "run"))
    for r in results:
        for name, p in plain.named_parameters():
            assert torch.equal(torch.as_tensor(r["loaded"][name]), p.detach()), name
        assert r["losses"][-1] < r["losses"][0]
    # the fine-tuned checkpoint consolidates into a file from_pretrained loads
    out = tmp_path / "export"
    outcore.consolidate(tmp_path / "run" / "ckpt", out / "model.safetensors")
    plain.config.save_pretrained(out)
    again = type(plain).from_pretrained(out).eval()
    ids = torch.arange(32).reshape(2, 16) % 96
    with torch.no_grad():
        expected = torch.as_tensor(results[0]["logits"])
        assert torch.allclose(again(input_ids=ids).logits, expected, atol=1e-5)


def test_name_and_shape_mismatches_are_clear_errors(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    save_file({"0.weight": torch.zeros(3, 4), "0.bias": torch.zeros(3),
               "1.weight": torch.zeros(2, 3), "extra": torch.zeros(1)}, tmp_path / "a.safetensors")
    with pytest.raises(outcore.ConfigError, match=r"missing 1.bias; unexpected extra"):
        outcore.load_pretrained(model, tmp_path / "a.safetensors")
    save_file({"0.weight": torch.zeros(4, 4), "0.bias": torch.zeros(3),
               "1.weight": torch.zeros(2, 3), "1.bias": torch.zeros(2)},
              tmp_path / "b.safetensors")
    before = model[0].weight.detach().clone()
    with pytest.raises(outcore.ConfigError, match=r"0.weight: file \[4, 4\] vs model \[3, 4\]"):
        outcore.load_pretrained(model, tmp_path / "b.safetensors")
    assert torch.equal(model[0].weight, before)  # nothing was written
    with pytest.raises(outcore.ConfigError, match="not found"):
        outcore.load_pretrained(model, tmp_path / "nope")


def test_an_outcore_checkpoint_is_named_with_the_ways_to_load_it(tmp_path: Path) -> None:
    """A DeepSpeed user's load_checkpoint(..., load_module_only=True) habit: the checkpoint
    folder given to load_pretrained was refused as weights that do not match the model
    (its optimizer-state names unexpected); it is named, then consolidated and loaded."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    engine = outcore.initialize(model, {"dtype": "fp32"})
    engine.save_checkpoint(tmp_path / "ckpt")
    want = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    engine.close()
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    with pytest.raises(outcore.ConfigError, match=r"is an outcore checkpoint.*"
                                                  r"engine\.load_checkpoint.*outcore\.consolidate"):
        outcore.load_pretrained(fresh, tmp_path / "ckpt")
    outcore.consolidate(tmp_path / "ckpt", tmp_path / "weights")
    outcore.load_pretrained(fresh, tmp_path / "weights")
    for name, p in fresh.named_parameters():
        assert torch.equal(p.detach(), want[name]), name


def test_one_flat_range_reader_for_weights_and_checkpoints(tmp_path: Path) -> None:
    """``read_flat_range`` (safetensors_stream.py) reads any element range of a flattened
    tensor: one N-d tensor in one file (pretrained weights, read by rows) or a flat tensor cut
    into pieces across files (checkpoints); pretrained.py uses it rather than its own."""
    from safetensors import safe_open

    from outcore.io import pretrained
    from outcore.io import safetensors_stream as sts

    assert pretrained.read_flat_range is sts.read_flat_range
    full = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    save_file({"w": full.to(torch.bfloat16), "s": torch.tensor(7.0)}, tmp_path / "one.safetensors")
    flat = full.reshape(-1)
    for k in range(3):  # a checkpoint's layout: piece k holds elements [20k, 20k + 20)
        save_file({"w": flat[k * 20 : (k + 1) * 20].clone()}, tmp_path / f"p{k}.safetensors")
    with contextlib.ExitStack() as stack:
        h = stack.enter_context(safe_open(tmp_path / "one.safetensors", "pt"))
        handles = {k: stack.enter_context(safe_open(tmp_path / f"p{k}.safetensors", "pt"))
                   for k in range(3)}
        for a, b in [(0, 60), (7, 8), (13, 47), (20, 40), (59, 60), (5, 5)]:
            out = torch.full((b - a + 2,), -1.0)
            sts.read_flat_range({0: h}, 1, "w", 60, a, b, out)  # one 3-d tensor, by rows
            assert torch.equal(out[: b - a], flat[a:b]) and (out[b - a :] == -1).all(), (a, b)
            out = torch.full((b - a,), -1.0, dtype=torch.float64)
            sts.read_flat_range(handles, 3, "w", 60, a, b, out)  # three flat pieces
            assert torch.equal(out, flat[a:b].double()), (a, b)
        scalar = torch.zeros(1)
        sts.read_flat_range({0: h}, 1, "s", 1, 0, 1, scalar)
        assert scalar.item() == 7.0
