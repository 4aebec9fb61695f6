"""A checkpoint of a model whose frozen base is read in place names the base's files (size,
time, content hash) instead of storing them, and a resume over another base is refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import outcore
from outcore.errors import ConfigError

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")


def _config():
    return transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    out = tmp_path / "base"
    transformers.LlamaForCausalLM(_config()).to(torch.bfloat16).save_pretrained(
        out, max_shard_size="100KB")
    return out


def _engine(folder: Path, swap: Path, weights: bool = True):
    from outcore.hf.lora import apply_lora

    cfg = {"dtype": "fp32", "offload": {"params": "nvme", "optimizer": "cpu",
                                        "nvme_path": str(swap)}}
    torch.manual_seed(0)
    with outcore.init(cfg, frozen=True, weights=folder if weights else None):
        model = transformers.AutoModelForCausalLM.from_config(_config())
    torch.manual_seed(1)
    model = apply_lora(model, "r=4,alpha=8,targets=q_proj,v_proj")
    engine = outcore.initialize(model, cfg)
    x = torch.arange(32).reshape(2, 16) % 300
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    return engine


def _touch(path: Path, flip: bool) -> None:
    raw = bytearray(path.read_bytes())
    if flip:
        raw[-3] ^= 0x01
    path.write_bytes(bytes(raw))  # a new modification time either way
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


def test_the_checkpoint_names_the_base_and_refuses_another(folder: Path, tmp_path: Path) -> None:
    engine = _engine(folder, tmp_path / "swap")
    ckpt = engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    man = json.loads((ckpt / "manifest.json").read_text())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert sorted(man["base"]["files"]) == files and man["base"]["folder"] == str(folder)
    for name, rec in man["base"]["files"].items():
        assert rec["bytes"] == (folder / name).stat().st_size
    base_entries = [e for e in man["params"].values() if "base" in e]
    assert len(base_entries) == 21 and not any(e["trainable"] for e in base_entries)
    stored = sum(f["bytes"] for f in man["files"].values())
    assert stored < sum((folder / f).stat().st_size for f in files)  # adapters, not the base

    # same content under a new modification time: hashed again and accepted
    _touch(folder / files[0], flip=False)
    engine = _engine(folder, tmp_path / "swap")
    engine.load_checkpoint(ckpt)
    engine.close()
    # one byte changed: refused in words, naming the file
    _touch(folder / files[-1], flip=True)
    engine = _engine(folder, tmp_path / "swap")
    with pytest.raises(ConfigError, match=f"base file .*{files[-1]} changed since"):
        engine.load_checkpoint(ckpt)
    engine.close()


def test_another_placement_reads_the_base_values_from_the_named_files(folder: Path,
                                                                      tmp_path: Path) -> None:
    """A model whose base is not read in place now (built without ``weights=``, or with its
    parameters in memory) gets the base's values from the files the checkpoint names."""
    from safetensors.torch import load_file

    engine = _engine(folder, tmp_path / "swap")
    ckpt = engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    engine = _engine(folder, tmp_path / "swap", weights=False)  # a random base
    engine.load_checkpoint(ckpt)
    base = {}
    for f in folder.glob("*.safetensors"):
        base.update(load_file(f))
    w = engine.module.base_model.model.model.layers[1].mlp.up_proj.weight
    with engine.gathered_parameters([w]):
        torch.testing.assert_close(w.detach().cpu(),
                                   base["model.layers.1.mlp.up_proj.weight"].float())
    engine.close()
    moved = folder.rename(tmp_path / "moved")  # the same files elsewhere: accepted
    engine = _engine(moved, tmp_path / "swap")
    engine.load_checkpoint(ckpt)
    engine.close()
    engine = _engine(moved, tmp_path / "swap", weights=False)  # the named base is gone
    with pytest.raises(ConfigError, match=f"read from the base model in {folder}, which "
                                          "cannot be read now"):
        engine.load_checkpoint(ckpt)
    engine.close()


def test_consolidated_weights_read_the_base_from_its_files(folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    engine = _engine(folder, tmp_path / "swap")
    ckpt = engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    full = load_file(outcore.consolidate(ckpt, tmp_path / "full"))
    base = {}
    for f in folder.glob("*.safetensors"):
        base.update(load_file(f))
    q = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert torch.equal(full[q], base["model.layers.0.self_attn.q_proj.weight"].float())
    assert torch.equal(full["base_model.model.lm_head.weight"], base["lm_head.weight"].float())
    assert any(".lora_A." in k for k in full) and len(full) == 21 + 8


@pytest.mark.parametrize("how", ["replaced", "removed"])
def test_a_base_replaced_or_removed_under_the_run_is_recorded_as_the_run_read_it(
        folder: Path, tmp_path: Path, how: str) -> None:
    """Found by a user's probe: a base file replaced under a run (a new file renamed over
    it) was recorded as the new file, so a resume over it was accepted, and one removed
    failed the save in words about the checkpoint, the run's steps lost. The record is of
    the file the run holds open, said in a warning, and a resume over the new one refused."""
    engine = _engine(folder, tmp_path / "swap")
    files = sorted(folder.glob("*.safetensors"))
    kept = {f.name: f.read_bytes() for f in files}
    for f in files:  # what a tool writing a new file and renaming it over the old does
        if how == "replaced":
            new = f.with_suffix(".tmp")
            raw = bytearray(kept[f.name])
            raw[-3] ^= 0x01
            new.write_bytes(bytes(raw))
            os.replace(new, f)
        else:
            f.unlink()
    with pytest.warns(UserWarning, match="was replaced or removed since this run "
                                         "opened it; the checkpoint records the file the run"):
        ckpt = engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    if how == "removed":
        for name, raw in kept.items():
            (folder / name).write_bytes(raw)  # the same bytes back: the resume is accepted
        engine = _engine(folder, tmp_path / "swap")
        engine.load_checkpoint(ckpt)
    else:
        engine = _engine(folder, tmp_path / "swap2", weights=False)
        with pytest.raises(ConfigError, match="changed since"):
            engine.load_checkpoint(ckpt)
    engine.close()


def test_a_base_file_touched_only_is_not_called_replaced(folder: Path, tmp_path: Path) -> None:
    """A new modification time alone (same file, same bytes) warned that a resume would be
    refused; it is accepted (found by a reviewer)."""
    import warnings

    engine = _engine(folder, tmp_path / "swap")
    _touch(sorted(folder.glob("*.safetensors"))[0], flip=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*replaced or removed")
        engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
