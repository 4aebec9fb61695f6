"""The memory and bandwidth analysis against hand-computed numbers and the paper's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from outcore.errors import ConfigError
from outcore.sizing import efficiency as eff
from outcore.sizing import estimate as est

GPT2_CONFIG = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12,
               "vocab_size": 50257, "n_positions": 1024, "activation_function": "gelu_new"}
LLAMA2_7B_CONFIG = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
                    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                    "intermediate_size": 11008, "max_position_embeddings": 4096,
                    "hidden_act": "silu", "tie_word_embeddings": False}
# A DGX-2 node, the paper's single-node machine: 16 V100s of 32 GB, 1.5 TB CPU memory, 28 TB NVMe.
DGX2 = {"gpus": 16, "gpu_memory": 32 * 10**9, "host_memory": 1_500 * 10**9, "nvme": 28 * 10**12}


def test_parameter_counts_match_published_models() -> None:
    assert est.shape_from_hf_config(GPT2_CONFIG).params == 124_439_808  # GPT-2 small
    assert est.shape_from_hf_config(LLAMA2_7B_CONFIG).params == 6_738_415_616  # Llama-2-7B


def test_preset_shapes_count_what_outcore_models_builds() -> None:
    models = pytest.importorskip("outcore.app.models")
    for name, cfg in models.PRESETS.items():
        assert models.preset_shape(name).params == models.num_params(cfg), name
        assert est.resolve_model(name, models.preset_shape) == models.preset_shape(name)
    with pytest.raises(ConfigError, match="unknown preset 'nope'; choose one of tiny, small"):
        est.resolve_model("nope", models.preset_shape)


def test_planning_never_imports_the_app() -> None:
    """Presets belong to the application (outcore.app.models); the library below knows none."""
    import ast

    sizing = Path(est.__file__).parent
    for path in sizing.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("outcore.app") for n in names), (path.name, names)


def test_one_tier_model_for_estimates_and_placement() -> None:
    """The usable fractions named once (estimate.py) and the tiers in ``Tier``'s order."""
    from outcore.offload.storage import Tier
    from outcore.sizing import placement

    assert tuple(t.value for t in Tier) == est.TIERS
    assert (est.USABLE.device, est.USABLE.host, est.USABLE.nvme) == (0.90, 0.80, 0.95)
    assert est.USABLE.states_only().host == pytest.approx(0.6)  # Config.auto's tested share
    assert placement.USABLE is est.USABLE
    limits = est.max_model(1, 10**9, 10**9, 10**9).assumptions["usable_fraction"]
    assert limits == {"device": 0.90, "host": 0.80, "nvme": 0.95}


def test_hf_config_from_file_and_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(GPT2_CONFIG))
    by_file = est.resolve_model(str(tmp_path / "config.json"))
    by_folder = est.resolve_model(str(tmp_path))
    assert by_file == by_folder
    assert (by_file.layers, by_file.hidden, by_file.heads, by_file.seq_len) == (12, 768, 12, 1024)


def test_bad_model_descriptions_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="n_layer, num_hidden_layers"):
        est.shape_from_hf_config({"n_embd": 8, "n_head": 2, "vocab_size": 10})
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ConfigError, match="broken.json"):
        est.resolve_model(str(tmp_path / "broken.json"))
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        est.resolve_model("nope")
    with pytest.raises(ConfigError, match="hidden"):
        est.shape_from_hf_config({**GPT2_CONFIG, "n_embd": "wide"})
    with pytest.raises(ConfigError, match="params"):
        est.shape_from_params(0)


def test_gpt_shape_from_a_parameter_count_recovers_gpt3() -> None:
    shape = est.shape_from_params(175 * 10**9)
    assert shape.params == 175 * 10**9  # the given count is what model states use
    assert shape.layers == 96  # GPT-3 175B: 96 layers x 12288 hidden
    assert shape.hidden == pytest.approx(12288, rel=0.02)


def test_sixteen_bytes_per_parameter_by_hand() -> None:
    # 2 blocks x 64 wide, 2 heads, vocab 100, context 8: 12h²+13h per block, tied embedding,
    # learned positions, final LayerNorm.
    shape = est.ModelShape(layers=2, hidden=64, heads=2, vocab=100, seq_len=8)
    params = 2 * (12 * 64**2 + 13 * 64) + 100 * 64 + 8 * 64 + 2 * 64
    assert shape.params == params == 107_008
    m = est.memory_estimate(shape, batch=1, devices=2)
    states = 16 * params
    ckpt = 2 * 1 * 8 * 64 * 2  # 2·b·s·h per block
    awm = 1 * 8 * 1 * (16 * 64 + 2 * 2 * 8)  # b·s·c·(16h + 2as) > logits 4·b·s·V = 3200
    mswm = 4 * (64 * 256)  # params + grads (2 + 2 bytes) of the 64 -> 256 MLP linear
    assert (m.bytes_per_param, m.model_states, m.activation_checkpoints) == (16, states, ckpt)
    assert (m.awm, m.mswm) == (awm, mswm)
    full = 2 * (34 * 8 * 1 * 64 + 5 * 2 * 8**2 * 1) + 4 * 8 * 100  # Korthikanti + logits
    assert m.activations_full == full
    tiers = {s: (t.device, t.host, t.nvme) for s, t in m.strategies.items()}
    assert tiers == {
        "data_parallel": (states + ckpt + awm, 0, 0),
        "zero3": (states // 2 + mswm + ckpt + awm, 0, 0),
        "zero3_cpu": (mswm + awm, states // 2 + ckpt, 0),
        "zero3_nvme": (mswm + awm, ckpt, states // 2),
    }
    assert m.strategies["zero3_nvme"].holds["model_states"] == "nvme"


def test_paper_accounting_and_no_checkpointing() -> None:
    shape = est.ModelShape(layers=2, hidden=64, heads=2, vocab=100, seq_len=8)
    paper = est.memory_estimate(shape, state_bytes=est.StateBytes(fp32_grads=4))
    assert paper.model_states == 20 * shape.params  # ZeRO-Infinity sec. 3 counts 20
    full = est.memory_estimate(shape, checkpointing=False)
    assert full.awm == 0
    dp = full.strategies["data_parallel"]
    assert dp.device == 16 * shape.params + full.activations_full
    assert full.strategies["zero3_nvme"].host == 0  # full activations stay on the device


def test_tiling_shrinks_model_state_working_memory() -> None:
    shape = est.ModelShape(layers=4, hidden=4096, heads=32, vocab=2000)
    assert est.memory_estimate(shape).mswm == 4 * 4 * 4096**2  # 2+2 bytes x the 4h² linear
    assert est.memory_estimate(shape, tiles=2).mswm == 4 * 2 * 4096**2
    # Beyond that the (untiled) embedding is the largest operator.
    assert est.memory_estimate(shape, tiles=64).mswm == 4 * 2000 * 4096
    big_vocab = est.ModelShape(layers=4, hidden=4096, heads=32, vocab=32000)
    assert est.memory_estimate(big_vocab).mswm == 4 * 32000 * 4096


def test_a_trillion_parameters_need_16_tb_of_model_states() -> None:
    m = est.memory_estimate(est.shape_from_params(10**12), devices=16)
    assert m.model_states == 16 * 10**12
    assert m.strategies["zero3_nvme"].nvme == 10**12  # a DGX-2's 16 GPUs, 1 TB of NVMe each
    assert m.strategies["data_parallel"].device > 16 * 10**12


def test_dgx2_max_model_matches_the_papers_scale() -> None:
    # The paper (fig. 1 / sec. 8) trains at most ~1.4B parameters with data parallelism on a
    # DGX-2, and ~1T with ZeRO-Infinity offloading to NVMe. Its 1.4B follows from its 20-byte
    # accounting; with 16 bytes the same memory holds a quarter more.
    paper = est.max_model(**DGX2, state_bytes=est.StateBytes(fp32_grads=4)).max_params
    assert paper["data_parallel"] == pytest.approx(1.4e9, rel=0.1)
    assert 0.7e12 < paper["zero3_nvme"] < 2e12
    ours = est.max_model(**DGX2)
    p = ours.max_params
    assert 1e9 < p["data_parallel"] < 2.5e9
    assert 0.7e12 < p["zero3_nvme"] < 2.5e12
    assert p["data_parallel"] < p["zero3"] < p["zero3_cpu"] < p["zero3_nvme"]
    assert 10 < p["zero3"] / p["data_parallel"] < 16  # ZeRO-3 divides states by 16 devices
    assert ours.limited_by == {"data_parallel": "device", "zero3": "device",
                               "zero3_cpu": "host", "zero3_nvme": "nvme"}
    assert set(ours.to_json()["max_params"]) == set(est.STRATEGIES)


def test_max_model_answer_fits_by_memory_estimate() -> None:
    """The two halves of the module agree: the max model's estimate fits the usable memory."""
    result = est.max_model(**DGX2)
    usable = {"device": 0.9 * DGX2["gpu_memory"], "host": 0.8 * DGX2["host_memory"] / 16,
              "nvme": 0.95 * DGX2["nvme"] / 16}
    for strategy, params in result.max_params.items():
        tiers = est.memory_estimate(est.shape_from_params(params), devices=16).strategies
        for tier in est.TIERS:
            assert getattr(tiers[strategy], tier) <= usable[tier] * 1.02, (strategy, tier)
        limit = result.limited_by[strategy]
        assert getattr(tiers[strategy], limit) >= usable[limit] * 0.95, strategy


def test_max_model_is_monotone_in_memory() -> None:
    def best(**over: int) -> dict[str, int]:
        return est.max_model(**{**DGX2, **over}).max_params

    for key, values in (("gpu_memory", [8e9, 16e9, 32e9, 80e9]),
                        ("host_memory", [0, 1e11, 1.5e12, 4e12]),
                        ("nvme", [0, 1e12, 28e12, 100e12])):
        results = [best(**{key: int(v)}) for v in values]
        for small, large in zip(results, results[1:], strict=False):
            assert all(small[s] <= large[s] for s in est.STRATEGIES), (key, small, large)
    assert best(host_memory=0)["zero3_cpu"] == 0
    assert best(nvme=0)["zero3_nvme"] == 0
    assert best(nvme=100 * 10**12)["data_parallel"] == best()["data_parallel"]


def test_more_devices_help_zero3_but_not_data_parallel() -> None:
    by_gpus = [est.max_model(**{**DGX2, "gpus": g}).max_params for g in (1, 2, 4, 16)]
    assert len({r["data_parallel"] for r in by_gpus}) == 1  # replicated: no gain
    zero3 = [r["zero3"] for r in by_gpus]
    assert zero3 == sorted(zero3) and zero3[-1] > 8 * zero3[0]
    # Devices of one node share its host memory, and each adds activation checkpoints there,
    # so the host-bound strategy does not grow with devices on one node.
    assert by_gpus[-1]["zero3_cpu"] <= by_gpus[0]["zero3_cpu"]


def test_max_model_rejects_impossible_hardware() -> None:
    with pytest.raises(ConfigError, match="multiple of nodes"):
        est.max_model(3, 10**9, 0, 0, nodes=2)
    with pytest.raises(ConfigError, match="gpu_memory"):
        est.max_model(1, -1, 0, 0)
    with pytest.raises(ConfigError, match="batch"):
        est.memory_estimate(est.shape_from_params(10**6), batch=0)


def test_efficiency_is_the_papers_formula() -> None:
    assert eff.efficiency(ait=1000, bandwidth_GBps=70, peak_TFLOPs=70) == pytest.approx(0.5)
    assert eff.efficiency(ait=1000, bandwidth_GBps=0, peak_TFLOPs=70) == 0.0
    for target in (0.5, 0.9):
        bw = eff.required_bandwidth(1024, 70, target)
        assert eff.efficiency(1024, bw, 70) == pytest.approx(target)
    with pytest.raises(ConfigError):
        eff.required_bandwidth(1024, 70, 1.0)


def test_paper_bandwidth_requirements() -> None:
    # Sec. 4 / fig. 3 at 70 TFLOP/s: params and grads need ~70 GB/s for 50% efficiency at
    # seq x bsz = 1024 (ait = seq x bsz); activation checkpoints need 1-4 GB/s for 90% at a
    # hidden size of 8K (ait = 24·hd).
    assert eff.required_bandwidth(1024, 70, 0.5) == pytest.approx(70, rel=0.05)
    assert 1 <= eff.required_bandwidth(24 * 8192, 70, 0.9) <= 4


def test_predict_efficiency_per_data_type() -> None:
    e = eff.predict_efficiency(1024, 70, 70)
    assert e.params_grads == pytest.approx(eff.efficiency(1024, 70, 70))
    assert e.optimizer_states == pytest.approx(eff.efficiency(256, 70, 70))  # ait = T/4
    slowdown = 1 + 70e12 / (1024 * 70e9) + 70e12 / (256 * 70e9)
    assert e.combined == pytest.approx(1 / slowdown)
    assert e.combined < e.optimizer_states < e.params_grads
    # A disk that writes 3x faster than it reads: params/grads move 3 reads per write.
    disk = eff.predict_efficiency(2048, 2.0, 1.6, write_GBps=6.0, hidden=768)
    assert disk.params_grads == pytest.approx(eff.efficiency(2048, 4 / (3 / 2 + 1 / 6), 1.6))
    assert disk.optimizer_states == pytest.approx(eff.efficiency(512, 2 / (1 / 2 + 1 / 6), 1.6))
    assert disk.activation_checkpoints == pytest.approx(eff.efficiency(24 * 768, 3.0, 1.6))
    more = eff.predict_efficiency(8192, 2.0, 1.6, write_GBps=6.0)
    assert more.combined > disk.combined  # more tokens per step, more compute per byte


def test_efficiency_from_probe_splits_bandwidth_between_devices() -> None:
    probe = {"disk_read_GBps": 2.0, "disk_write_GBps": 2.0, "host_copy_GBps": 20.0,
             "matmul_bf16_TFLOPs": 1.6, "matmul_fp32_TFLOPs": 0.3}
    one = eff.efficiency_from_probe(probe, 2048)
    two = eff.efficiency_from_probe(probe, 2048, devices_per_node=2)
    assert one["nvme"].params_grads == pytest.approx(eff.efficiency(2048, 2.0, 1.6))
    assert two["nvme"].params_grads == pytest.approx(eff.efficiency(2048, 1.0, 1.6))
    assert one["host"].params_grads > one["nvme"].params_grads
    with pytest.raises(ConfigError, match="matmul_bf16_TFLOPs"):
        eff.efficiency_from_probe({**probe, "matmul_bf16_TFLOPs": None}, 2048)


def test_efficiency_from_probe_takes_the_rate_of_the_dtype_auto_trains_in() -> None:
    """On a CPU without native bf16 the probe says auto_dtype fp32: its peak is fp32's rate."""
    probe = {"disk_read_GBps": 2.0, "disk_write_GBps": 2.0, "host_copy_GBps": 20.0,
             "matmul_bf16_TFLOPs": 0.001, "matmul_fp32_TFLOPs": 0.12, "auto_dtype": "fp32"}
    got = eff.efficiency_from_probe(probe, 2048)["nvme"]
    assert got.peak_TFLOPs == 0.12
    assert got.params_grads == pytest.approx(eff.efficiency(2048, 2.0, 0.12))
    with pytest.raises(ConfigError, match="matmul_fp16_TFLOPs"):
        eff.efficiency_from_probe({**probe, "auto_dtype": "fp16"}, 2048)
    with pytest.raises(ConfigError, match="auto_dtype is 'int8'"):
        eff.efficiency_from_probe({**probe, "auto_dtype": "int8"}, 2048)
