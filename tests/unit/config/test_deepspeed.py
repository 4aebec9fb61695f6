"""DeepSpeed ZeRO-3 configs as people write them, read by outcore (config/deepspeed.py).

The configs below are written here in the shapes of public recipes (LLaMA-Factory, axolotl,
accelerate, transformers' tests and docs, TRL, DeepSpeed's ZeRO-Infinity tutorial and its
examples): ``"auto"`` wherever those put it, their older spellings, their optimizer extras.
Each must be read without an error, keep every key that means something to outcore, and list
every other key in one warning; under ``OutcoreTrainer`` its ``"auto"`` values come from the
``TrainingArguments`` and the model.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

import outcore
from outcore.config.deepspeed import OUTCORE_ONLY, Auto, is_deepspeed, translate
from outcore.errors import ConfigError

Z3_AUTO = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
           "sub_group_size": 1e9, "reduce_bucket_size": "auto",
           "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
           "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
           "stage3_gather_16bit_weights_on_model_save": True}
TRAINER_AUTO = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
FP16_AUTO = {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1}
OPT_AUTO = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                        "weight_decay": "auto"}}
SCHED_AUTO = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto",
                                                  "warmup_max_lr": "auto",
                                                  "warmup_num_steps": "auto",
                                                  "total_num_steps": "auto"}}


def _cpu(pin: bool = True) -> dict:
    return {"device": "cpu", "pin_memory": pin}


def _nvme(path: str, count: int, size: float | None = None) -> dict:
    out = {"device": "nvme", "nvme_path": path, "pin_memory": True, "buffer_count": count}
    if size:
        out["buffer_size"] = size
    return out


# name -> (config with "{nvme}" for the swap folder, what outcore must make of it)
RECIPES = {
    "factory-z3": ({**TRAINER_AUTO, "zero_allow_untested_optimizer": True, "fp16": FP16_AUTO,
                    "bf16": {"enabled": "auto"}, "zero_optimization": {**Z3_AUTO}},
                   {"offload": ("none", "none")}),
    "factory-z3-offload": ({**TRAINER_AUTO, "fp16": FP16_AUTO, "bf16": {"enabled": "auto"},
                            "zero_optimization": {**Z3_AUTO, "offload_optimizer": _cpu(),
                                                  "offload_param": _cpu()}},
                           {"offload": ("cpu", "cpu")}),
    "axolotl-z3-bf16": ({**TRAINER_AUTO, "bf16": {"enabled": True}, "wall_clock_breakdown": False,
                         "zero_optimization": {**Z3_AUTO, "offload_optimizer": {"device": "none"},
                                               "offload_param": {"device": "none"}}},
                        {"offload": ("none", "none"), "dtype": "bf16"}),
    "axolotl-z3-offload-all": ({**TRAINER_AUTO, "bf16": {"enabled": "auto"},
                                "zero_optimization": {**Z3_AUTO, "offload_optimizer": _cpu(),
                                                      "offload_param": _cpu()}},
                               {"offload": ("cpu", "cpu")}),
    "accelerate-z3": ({**TRAINER_AUTO, "steps_per_print": 2000, "wall_clock_breakdown": False,
                       "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
                       "optimizer": {"type": "AdamW", "params": {
                           "lr": "auto", "weight_decay": "auto", "torch_adam": True,
                           "adam_w_mode": True}},
                       "scheduler": SCHED_AUTO, "zero_optimization": {**Z3_AUTO}},
                      {"dtype": "fp16", "ignored": ["torch_adam", "steps_per_print"]}),
    "transformers-test-z3": ({**TRAINER_AUTO, "steps_per_print": 2000, "fp16": FP16_AUTO,
                              "optimizer": OPT_AUTO,
                              "scheduler": {"type": "WarmupLR", "params": {
                                  "warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                  "warmup_num_steps": "auto"}},
                              "zero_optimization": {**Z3_AUTO, "offload_optimizer": _cpu(),
                                                    "offload_param": _cpu()}},
                             {"offload": ("cpu", "cpu")}),
    "transformers-docs-infinity": ({**TRAINER_AUTO, "fp16": FP16_AUTO, "optimizer": OPT_AUTO,
                                    "zero_optimization": {
                                        **Z3_AUTO, "offload_optimizer": {
                                            **_nvme("{nvme}", 4), "fast_init": False},
                                        "offload_param": {**_nvme("{nvme}", 5, 1e8),
                                                          "max_in_cpu": 1e9}},
                                    "aio": {"block_size": 262144, "queue_depth": 32,
                                            "thread_count": 1, "single_submit": False,
                                            "overlap_events": True}},
                                   {"offload": ("nvme", "nvme"), "io_threads": 1,
                                    "host_buffer_bytes": 5 * 10**8 * 2}),
    "trl-z3": ({**TRAINER_AUTO, "bf16": {"enabled": "auto"},
                "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save":
                                      True, "offload_optimizer": {"device": "none"},
                                      "offload_param": {"device": "none"}}},
               {"offload": ("none", "none")}),
    "deepspeed-tutorial-infinity": ({"train_batch_size": 16, "gradient_clipping": 1.0,
                                     "fp16": {"enabled": True, "loss_scale": 0,
                                              "initial_scale_power": 12},
                                     "optimizer": {"type": "Adam", "params": {
                                         "lr": 1e-3, "betas": [0.8, 0.999], "eps": 1e-8,
                                         "weight_decay": 3e-7}},
                                     "zero_optimization": {
                                         "stage": 3, "offload_param": _nvme("{nvme}", 5, 1e8),
                                         "offload_optimizer": _nvme("{nvme}", 4),
                                         "stage3_max_live_parameters": 1e9,
                                         "stage3_max_reuse_distance": 1e9,
                                         "stage3_prefetch_bucket_size": 5e8,
                                         "stage3_param_persistence_threshold": 1e6,
                                         "sub_group_size": 1e9},
                                     "aio": {"block_size": 1048576, "queue_depth": 8,
                                             "thread_count": 2, "single_submit": False,
                                             "overlap_events": True}},
                                    {"offload": ("nvme", "nvme"), "dtype": "fp16",
                                     "lr": 1e-3, "prefetch_bytes": 10**9, "clip": 1.0}),
    "deepspeed-examples-legacy": ({"train_batch_size": 8, "bfloat16": {"enabled": True},
                                   "optimizer": {"type": "Adam", "params": {
                                       "lr": 1e-4, "amsgrad": False, "bias_correction": True}},
                                   "zero_optimization": {
                                       "stage": 3, "cpu_offload": True,
                                       "cpu_offload_params": True,
                                       "cpu_offload_use_pin_memory": True,
                                       "stage3_prefetch_bucket_size": 1e7,
                                       "stage3_param_persistence_threshold": 1e5}},
                                  {"offload": ("cpu", "cpu"), "dtype": "bf16",
                                   "prefetch_bytes": 2 * 10**7}),
    "deepspeed-field-names": ({"zero_optimization": {
                                   "stage": 3, "prefetch_bucket_size": 5e7,
                                   "param_persistence_threshold": 1e5,
                                   "max_live_parameters": 1e9, "max_reuse_distance": 1e9}},
                              {"prefetch_bytes": 10**8, "persistence": 2 * 10**5}),
    "fp16-auto-extras": ({**TRAINER_AUTO, "fp16": {"enabled": "auto", "loss_scale": 0,
                                                   "initial_scale_power": "auto",
                                                   "loss_scale_window": 500},
                          "zero_optimization": {"stage": 3}},
                         {"growth_interval": 500}),
    "sgd": ({**TRAINER_AUTO, "optimizer": {"type": "SGD", "params": {"lr": "auto",
                                                                     "momentum": 0.9}},
             "zero_optimization": {"stage": 3, "offload_optimizer": _cpu()}},
            {"offload": ("none", "cpu"), "optimizer": "sgd"}),
    "adam-l2": ({"optimizer": {"type": "Adam", "params": {"lr": 2e-4, "adam_w_mode": False,
                                                          "weight_decay": 0.01}},
                 "zero_optimization": {"stage": 3}},
                {"optimizer": "adam", "lr": 2e-4}),
}


def _write(tmp: Path, name: str) -> Path:
    text = json.dumps(RECIPES[name][0]).replace("{nvme}", str(tmp / "swap"))
    (tmp / "swap").mkdir(exist_ok=True)
    path = tmp / f"{name}.json"
    path.write_text(text)
    return path


def _check(cfg: outcore.Config, want: dict) -> None:
    if "offload" in want:
        assert (cfg.offload.params, cfg.offload.optimizer) == want["offload"]
    for key, value in {"dtype": cfg.dtype, "lr": cfg.optimizer.lr,
                       "optimizer": cfg.optimizer.type, "io_threads": cfg.offload.io_threads,
                       "host_buffer_bytes": cfg.offload.host_buffer_bytes,
                       "prefetch_bytes": cfg.zero.prefetch_bytes,
                       "persistence": cfg.zero.persistence_threshold_bytes,
                       "clip": cfg.gradient_clipping,
                       "growth_interval": cfg.loss_scale.growth_interval}.items():
        if key in want:
            assert value == want[key], key


@pytest.mark.parametrize("name", list(RECIPES))
def test_from_deepspeed_reads_the_recipe(tmp_path: Path, name: str) -> None:
    """Outside the Trainer: no error, one warning that lists what is not used (every
    ``"auto"`` among it), and the keys that mean something kept."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = outcore.Config.from_deepspeed(_write(tmp_path, name))
    assert len(caught) <= 1
    text = str(caught[0].message) if caught else ""
    config = RECIPES[name][0]
    for key, value in config.items():
        if value == "auto":  # listed, with "auto" or with why the key means nothing here
            assert f"\n  {key}: " in text, key
    for key in RECIPES[name][1].get("ignored", []):
        assert key in text
    _check(cfg, RECIPES[name][1])
    # a DeepSpeed file works wherever a config is taken
    assert outcore.Config.load(_write(tmp_path, name)).offload == cfg.offload


@pytest.mark.parametrize("name", list(RECIPES))
def test_under_the_trainer_auto_comes_from_the_arguments(tmp_path: Path, name: str) -> None:
    """``"auto"``: the Trainer's values, the buckets from the model's hidden size; the
    precision flag the recipe expects raises no clash."""
    transformers = pytest.importorskip("transformers")
    from outcore.hf.args import build_config

    config = RECIPES[name][0]
    flags = {}
    for key in ("bf16", "bfloat16", "fp16"):
        if isinstance(config.get(key), dict) and config[key].get("enabled") is not False:
            flags = {"bf16" if key != "fp16" else "fp16": True}
    if "bf16" in config and "fp16" in config:
        flags = {"bf16": True}  # both "auto": the user picks one, as with DeepSpeed
    if config.get("fp16", {}).get("enabled") is True:
        flags = {"fp16": True}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), learning_rate=3e-4, gradient_accumulation_steps=4,
        max_grad_norm=0.5, report_to=[], use_cpu=True, **flags)
    model = type("M", (), {"config": type("C", (), {"hidden_size": 64})()})()
    explicit = config.get("optimizer", {}).get("params", {})
    if "lr" in explicit and explicit["lr"] != "auto":
        with pytest.raises(outcore.ConfigError, match="learning_rate"):
            build_config(args, _write(tmp_path, name), model)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = build_config(args, _write(tmp_path, name), model)
    assert cfg.optimizer.lr == 3e-4
    assert cfg.gradient_accumulation_steps == 4
    if config.get("gradient_clipping") in ("auto", None):
        assert cfg.gradient_clipping == 0.5
    zero = config.get("zero_optimization", {})
    if zero.get("stage3_prefetch_bucket_size") == "auto":
        # DeepSpeed's bucket of single parameters would hold no h x h projection: outcore's
        # budget counts whole modules, so its default stays (deepspeed.py's note)
        assert cfg.zero.prefetch_bytes == outcore.Config().zero.prefetch_bytes
        assert cfg.zero.persistence_threshold_bytes == 10 * 64 * 2
    want = {k: v for k, v in RECIPES[name][1].items() if k not in ("lr", "dtype")}
    _check(cfg, want)
    if flags:
        assert cfg.dtype == next(iter(flags))


def test_auto_outside_the_trainer_is_outcores_default() -> None:
    data, ignored = translate({"gradient_clipping": "auto", "zero_optimization": {
        "stage": 3, "stage3_prefetch_bucket_size": "auto"}})
    assert "gradient_clipping" not in data and "zero" not in data
    assert any("stage3_prefetch_bucket_size: \"auto\"" in line for line in ignored)
    data, ignored = translate({"gradient_clipping": "auto"}, Auto(trainer=True))
    assert not ignored  # the Trainer gives it


def test_a_value_that_is_no_number_names_its_key() -> None:
    with pytest.raises(outcore.ConfigError, match="stage3_prefetch_bucket_size"):
        outcore.Config.from_deepspeed({"zero_optimization": {
            "stage": 3, "stage3_prefetch_bucket_size": "lots"}})


def test_a_config_with_keys_of_both_forms_is_refused() -> None:
    """An outcore config holding one DeepSpeed key (``steps_per_print``) was read as
    DeepSpeed's: its offload, dtype and lr were dropped under "no outcore equivalent"."""
    mixed = {"dtype": "bf16", "steps_per_print": 1,
             "offload": {"params": "cpu", "optimizer": "cpu"}}
    with pytest.raises(outcore.ConfigError, match=r"mixes DeepSpeed's keys \(steps_per_print\) "
                                                  r"with outcore's \(dtype, offload\)"):
        outcore.Config.load(mixed)
    shared = {"optimizer", "gradient_accumulation_steps", "gradient_clipping", "seed"}
    assert set(OUTCORE_ONLY) == set(outcore.Config.model_fields) - shared


@pytest.mark.parametrize(("section", "path", "meant"), [
    ({"offload_parm": {"device": "cpu"}}, "zero_optimization.offload_parm", "offload_param"),
    ({"offload_param": {"device": "cpu", "buffer_cont": 4}},
     "zero_optimization.offload_param.buffer_cont", "buffer_count"),
    ({"stage3_prefetch_bucket_sise": 10}, "zero_optimization.stage3_prefetch_bucket_sise",
     "stage3_prefetch_bucket_size")])
def test_a_misspelt_deepspeed_key_is_refused_as_deepspeed_refuses_it(section, path,
                                                                     meant) -> None:
    """It was "no outcore equivalent", and the offload it meant silently none."""
    with pytest.raises(outcore.ConfigError, match=f"{path}: DeepSpeed has no key .*did you "
                                                  f"mean '{meant}'"):
        translate({"zero_optimization": {"stage": 3, **section}})


def test_a_key_close_to_none_of_deepspeeds_stays_a_warning() -> None:
    _, ignored = translate({"zero_optimization": {"stage": 3, "a_future_setting": 1}})
    assert ignored == ["zero_optimization.a_future_setting: no outcore equivalent"]


@pytest.mark.parametrize("first", ["offload_param", "offload_optimizer"])
def test_two_swap_folders_keep_the_optimizers_and_say_so(first: str) -> None:
    """outcore has one swap folder; the other was dropped without a word (the last read)."""
    second = "offload_optimizer" if first == "offload_param" else "offload_param"
    out, ignored = translate({"zero_optimization": {
        "stage": 3, first: {"device": "nvme", "nvme_path": f"/{first}"},
        second: {"device": "nvme", "nvme_path": f"/{second}"}}})
    assert out["offload"]["nvme_path"] == "/offload_optimizer"
    assert ignored == ["zero_optimization.offload_param.nvme_path: outcore keeps parameters "
                       "and optimizer state in one swap folder, the optimizer's "
                       "/offload_optimizer; /offload_param is not used"]


@pytest.mark.parametrize("section", ["offload_param", "offload_optimizer"])
def test_an_nvme_tier_without_a_folder_is_named_in_deepspeeds_words(section: str) -> None:
    """It read "offload: offload to nvme needs offload.nvme_path", a key the file has not."""
    ds = {"zero_optimization": {"stage": 3, section: {"device": "nvme"}}}
    for load in (outcore.Config.load, outcore.Config.from_deepspeed):
        with pytest.raises(outcore.ConfigError, match=f"zero_optimization.{section}.device is "
                                                      "'nvme' but no nvme_path"):
            load(ds)


def test_a_swap_folder_of_a_tier_not_on_nvme_is_not_the_one_used() -> None:
    """DeepSpeed reads ``nvme_path`` only where ``device`` is nvme; and one folder spelled
    two ways is one folder (a reviewer's cases), and a top-level ``seed`` is DeepSpeed's."""
    out, ignored = translate({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local/A"},
        "offload_optimizer": {"device": "cpu", "nvme_path": "/unused/B"}}})
    assert out["offload"]["nvme_path"] == "/local/A" and ignored == []
    out, ignored = translate({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "./swap"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "swap"}}})
    assert ignored == []
    home = {"device": "nvme", "nvme_path": os.path.expanduser("~/swap")}
    _, ignored = translate({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "~/swap"},
        "offload_optimizer": home}})
    assert ignored == []
    assert is_deepspeed({"zero_optimization": {"stage": 3}, "seed": 4})



@pytest.mark.parametrize(("world", "ds", "gas"), [
    ("1", {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, 4),
    ("2", {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8}, 2),
    ("2", {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8,
           "gradient_accumulation_steps": 2}, 2),
    ("1", {"train_batch_size": 16}, None),
])
def test_the_accumulation_follows_deepspeeds_batch_sizes(monkeypatch: pytest.MonkeyPatch,
                                                         world: str, ds: dict,
                                                         gas: int | None) -> None:
    """train_batch_size = micro batch x accumulation x ranks: the total and the micro batch
    alone had trained with no accumulation (DeepSpeed derives it), with one warning line."""
    monkeypatch.setenv("WORLD_SIZE", world)
    out, ignored = translate(ds)
    assert out.get("gradient_accumulation_steps") == gas
    if gas is not None and "gradient_accumulation_steps" not in ds:
        assert any(f"gives gradient_accumulation_steps {gas}" in line for line in ignored)


@pytest.mark.parametrize("ds", [
    {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 8},
    {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8,
     "gradient_accumulation_steps": 2}])
def test_batch_sizes_that_disagree_are_refused_as_deepspeed_refuses(
        monkeypatch: pytest.MonkeyPatch, ds: dict) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="train_batch_size .* is not "
                       "train_micro_batch_size_per_gpu 8 x gradient_accumulation_steps"):
        translate(ds)


@pytest.mark.parametrize(("ds", "said"), [
    ({"fp16": {"enabled": True, "initial_scale_powr": 8}}, "initial_scale_power"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decya": 0.1}}},
     "weight_decay")])
def test_a_misspelt_precision_or_optimizer_key_is_refused(ds: dict, said: str) -> None:
    """They were warned as "no outcore equivalent" and trained with the default (scale
    power 16, weight decay 0); DeepSpeed refuses them."""
    with pytest.raises(ConfigError, match=f"did you mean '{said}'"):
        translate(ds)


def test_the_ranks_are_the_joined_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job launched by mp.spawn sets no WORLD_SIZE: the group it joined says how many."""
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "2")  # another launcher's, not this group's
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out, _ = translate({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4})
    finally:
        dist.destroy_process_group()
    assert out["gradient_accumulation_steps"] == 4
