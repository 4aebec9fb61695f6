"""Pricing LoRA over a base read in place (``outcore estimate --trainable N``)."""

from __future__ import annotations

import json

import pytest

from outcore.app import cli
from outcore.sizing.estimate import ModelShape
from outcore.sizing.frozen_base import PASSES, PROCESS, READ_BUFFERS, frozen_base

LLAMA_13B = ModelShape(layers=40, hidden=5120, heads=40, vocab=32000, seq_len=4096, ffn=13824,
                       gated_mlp=True, tie_embeddings=False, learned_positions=False)


def test_the_base_costs_no_disk_and_two_reads_per_step() -> None:
    b = frozen_base(LLAMA_13B, 13_107_200, disk_read_GBps=1.6, seq_len=256)
    assert b.base_params == LLAMA_13B.params  # the adapters come on top
    assert b.base_bytes == b.base_params * 2  # the files' bf16, not the compute dtype
    assert b.adapter_state_bytes == 13_107_200 * 16
    assert b.read_per_step == PASSES * b.base_bytes
    assert b.floor_s == pytest.approx(b.read_per_step / 1.6e9)
    # in flight: the embedding and the head (the two largest layers), 2 bytes each
    in_flight = 2 * 32000 * 5120 * 2
    assert b.host_bytes >= PROCESS + in_flight + READ_BUFFERS + b.adapter_state_bytes
    assert b.host_bytes < 4 << 30
    assert frozen_base(LLAMA_13B, 10, base_bytes=123).base_bytes == 123  # the files' size
    assert frozen_base(LLAMA_13B, 10).floor_s is None  # no disk rate, no floor


def test_estimate_prints_it(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824,
        "num_hidden_layers": 40, "num_attention_heads": 40, "vocab_size": 32000,
        "max_position_embeddings": 4096, "tie_word_embeddings": False}))
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"disk_read_GBps": 2.0, "disk_write_GBps": 2.0,
                                 "host_copy_GBps": 8.0, "matmul_bf16_TFLOPs": 1.0}))
    assert cli.main(["estimate", "--model", str(config), "--seq", "256", "--trainable",
                     "13.1M", "--probe", str(probe), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["frozen_base"]
    assert data["trainable"] == 13_100_000 and data["floor_s"] == pytest.approx(
        data["read_per_step"] / 2e9)
    assert cli.main(["estimate", "--params", "1B", "--trainable", "1M"]) == 0
    assert "read per step (forward and backward)" in capsys.readouterr().out
    assert cli.main(["estimate", "--max-model", "--gpu-memory", "8GB", "--trainable", "1M"]) == 2
    assert "--trainable prices adapters over a model" in capsys.readouterr().err
