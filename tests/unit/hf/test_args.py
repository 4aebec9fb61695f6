"""Who decides what under OutcoreTrainer: TrainingArguments, outcore_config, and clashes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import outcore
from outcore.errors import ConfigError

transformers = pytest.importorskip("transformers")

from outcore.hf.args import build_config, check_world  # noqa: E402


def _args(tmp_path: Path, **kw) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], **kw)


def test_trainer_arguments_become_the_engines(tmp_path: Path) -> None:
    args = _args(tmp_path, learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.95,
                 adam_epsilon=1e-7, weight_decay=0.05, gradient_accumulation_steps=4,
                 max_grad_norm=0.7, seed=5)
    cfg = build_config(args, {"offload": {"optimizer": "cpu"}, "zero": {"prefetch_bytes": 1 << 20}})
    assert cfg.optimizer.lr == 3e-4 and cfg.optimizer.betas == (0.8, 0.95)
    assert cfg.optimizer.eps == 1e-7 and cfg.optimizer.weight_decay == 0.05
    assert cfg.gradient_accumulation_steps == 4 and cfg.gradient_clipping == 0.7
    assert cfg.seed == 5 and cfg.track_grad_norm
    assert cfg.offload.optimizer == "cpu" and cfg.zero.prefetch_bytes == 1 << 20
    assert cfg.dtype == "fp32", "Trainer trains in fp32 without bf16/fp16; so does the engine"
    assert build_config(args, {"dtype": "bf16"}).dtype == "bf16"
    assert build_config(args, outcore.Config(dtype="bf16")).dtype == "bf16"


def test_a_key_set_twice_differently_names_both(tmp_path: Path) -> None:
    args = _args(tmp_path, learning_rate=5e-5, max_grad_norm=1.0)
    with pytest.raises(ConfigError) as err:
        build_config(args, {"optimizer": {"lr": 1e-3}, "gradient_clipping": 2.0})
    text = str(err.value)
    assert "optimizer.lr=0.001" in text and "TrainingArguments.learning_rate=5e-05" in text
    assert "gradient_clipping=2.0" in text and "TrainingArguments.max_grad_norm=1.0" in text
    with pytest.raises(ConfigError, match="Config.*optimizer.lr|optimizer.lr"):
        build_config(args, outcore.Config(optimizer={"lr": 1e-3}))
    # the same value given twice is one value
    assert build_config(args, {"optimizer": {"lr": 5e-5}}).optimizer.lr == 5e-5


def test_deepspeed_config_with_auto_values(tmp_path: Path) -> None:
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
          "bf16": {"enabled": "auto"},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                "offload_optimizer": {"device": "cpu"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    cfg = build_config(_args(tmp_path, learning_rate=2e-4, gradient_accumulation_steps=3), path)
    assert cfg.optimizer.lr == 2e-4 and cfg.gradient_accumulation_steps == 3
    assert cfg.offload.params == "cpu" and cfg.offload.optimizer == "cpu"
    ds["optimizer"]["params"]["lr"] = 1e-3
    path.write_text(json.dumps(ds))
    with pytest.raises(ConfigError, match="learning_rate"):
        build_config(_args(tmp_path, learning_rate=2e-4), path)


def test_trainer_optimizer_settings_are_honoured_or_refused_in_words(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from outcore.hf import OutcoreTrainer

    with pytest.raises(ConfigError, match="optim='rmsprop' is not supported"):
        build_config(_args(tmp_path, optim="rmsprop"), None)
    assert build_config(_args(tmp_path, optim="adafactor"), None).optimizer.type == "adafactor"
    with pytest.raises(ConfigError, match="optim_args: 'foo'"):
        build_config(_args(tmp_path, optim="sgd", optim_args="foo=1"), None)
    sgd = build_config(_args(tmp_path, optim="sgd", optim_args="momentum=0.9"), None)
    assert sgd.optimizer.type == "sgd" and sgd.optimizer.momentum == 0.9
    import torch

    model = torch_model()
    with pytest.raises(ConfigError, match="RMSprop cannot run over outcore's shards"):
        OutcoreTrainer(model=model, args=_args(tmp_path),
                       optimizers=(torch.optim.RMSprop(model.parameters()), None))
    trainer = OutcoreTrainer(model=model, args=_args(tmp_path),
                             optimizers=(transformers_optimizer(model), None))
    assert trainer.outcore_engine.optimizer.param_groups[0]["lr"] == 0.25  # the optimizer's
    trainer.close()


def torch_model():
    import torch

    return torch.nn.Linear(4, 4)


def transformers_optimizer(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=0.25)


def test_outcore_imports_without_the_hf_extra() -> None:
    """``import outcore`` works without transformers/peft; asking for outcore.hf names the
    extra to install, in one line."""
    code = ("import sys\n"
            "for m in ('transformers', 'peft', 'accelerate'): sys.modules[m] = None\n"
            "import outcore, outcore.hf\n"
            "try:\n"
            "    outcore.hf.OutcoreTrainer\n"
            "except outcore.ConfigError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "pip install 'outcore[hf]'" in out and "transformers" in out


def test_lora_spec_and_targets() -> None:
    pytest.importorskip("peft")
    from outcore.hf.lora import apply_lora, parse_spec

    assert parse_spec("r=8,alpha=16,dropout=0.05,targets=q_proj,v_proj") == {
        "r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}
    for bad, word in [("r=0,targets=q", "r='0'"), ("r=8,alpha=0,targets=q", "alpha='0'"),
                      ("r=8,foo=1,targets=q", "'foo'"), ("r=8", "targets"),
                      ("r=8,targets=q,r=4", "given twice")]:
        with pytest.raises(ConfigError, match=word):
            parse_spec(bad)
    from transformers import LlamaConfig, LlamaForCausalLM

    def model():
        return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=1, num_attention_heads=2))

    assert apply_lora(model(), "r=2,targets=self_attn.q_proj").peft_config  # a suffix
    wrapped = apply_lora(model(), "r=2,targets=all-linear")  # peft's shorthand
    assert any("lora_A" in n for n, _ in wrapped.named_parameters())
    with pytest.raises(ConfigError, match=r"\['qproj'\] match no module.*q_proj"):
        apply_lora(model(), "r=2,targets=qproj")
    from outcore.app.models import build_model

    preset = apply_lora(build_model("tiny"), "r=2,targets=qkv")  # not a Hugging Face model
    assert any("lora_A" in n for n, p in preset.named_parameters() if p.requires_grad)


def test_a_trainer_that_sees_fewer_processes_than_torchrun_started_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun on a machine without a GPU, TrainingArguments without use_cpu=True
    make every rank a lone rank 0: refused in words (it would silently train W copies)."""
    from types import SimpleNamespace

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="use_cpu=True") as err:
        check_world(SimpleNamespace(world_size=1))
    assert "started 2 processes but the Trainer sees 1" in str(err.value)
    check_world(SimpleNamespace(world_size=2))  # agreeing worlds pass
    monkeypatch.delenv("WORLD_SIZE")
    check_world(SimpleNamespace(world_size=1))  # no torchrun: nothing to compare
