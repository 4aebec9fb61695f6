"""Config validation: every bad key is a ConfigError naming the key and what is allowed."""

from __future__ import annotations

import json

import pytest
import torch

import outcore


def test_defaults_and_dict_round_trip() -> None:
    cfg = outcore.Config()
    assert cfg.dtype == "auto" and cfg.offload.params == "none"
    again = outcore.Config.from_dict(cfg.model_dump())
    assert again == cfg


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"gradient_cliping": 1.0}, r"unknown config key 'gradient_cliping'.*gradient_clipping"),
        ({"offload": {"param": "cpu"}}, r"unknown config key 'offload.param'.*params"),
        ({"dtype": "fp8"}, r"dtype: got 'fp8'; allowed: 'auto', 'bf16', 'fp16' or 'fp32'"),
        ({"offload": {"params": "disk"}}, r"offload.params: got 'disk'; allowed: 'none'"),
        ({"offload": {"params": "nvme"}}, r"offload.nvme_path"),
        ({"optimizer": {"lr": -1}}, r"optimizer.lr: .*greater than 0"),
        ({"optimizer": {"betas": [0.9, 1.5]}}, r"betas\[1\]=1.5 must be in \[0, 1\)"),
        ({"gradient_accumulation_steps": 0}, r"gradient_accumulation_steps"),
        ({"optimizer": {"type": "sgd", "nesterov": True}}, r"nesterov=true needs momentum"),
        ({"offload": {"io_block_bytes": 5000}}, r"multiple of 4096"),
        ({"zero": {"prefetch_bytes": "lots"}}, r"zero.prefetch_bytes"),
    ],
)
def test_bad_values_name_the_key(data: dict, pattern: str) -> None:
    with pytest.raises(outcore.ConfigError, match=pattern):
        outcore.Config.from_dict(data)


def test_config_error_is_a_value_error_and_constructor_validates() -> None:
    with pytest.raises(ValueError, match="dtype"):
        outcore.Config(dtype="half")


def test_from_file_json_and_yaml(tmp_path) -> None:
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"dtype": "fp32", "optimizer": {"lr": 0.5}}))
    assert outcore.Config.from_file(j).optimizer.lr == 0.5
    y = tmp_path / "c.yaml"
    y.write_text("dtype: fp16\noffload:\n  params: cpu\n")
    cfg = outcore.Config.from_file(y)
    assert cfg.dtype == "fp16" and cfg.offload.params == "cpu"
    with pytest.raises(outcore.ConfigError, match="cannot read config file .*missing.yaml"):
        outcore.Config.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(outcore.ConfigError, match="bad.json is not valid"):
        outcore.Config.from_file(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(outcore.ConfigError, match="mapping"):
        outcore.Config.from_file(lst)


def test_with_overrides_deep_merges_and_revalidates() -> None:
    cfg = outcore.Config(optimizer={"lr": 0.1, "weight_decay": 0.2})
    new = cfg.with_overrides({"optimizer": {"lr": 0.3}})
    assert new.optimizer.lr == 0.3 and new.optimizer.weight_decay == 0.2
    with pytest.raises(outcore.ConfigError, match="optimizer.lr"):
        cfg.with_overrides({"optimizer": {"lr": 0}})


def test_merge_mappings_is_the_one_deep_merge() -> None:
    """Nested dicts merge key by key; anything else (a list, None) replaces whole; the inputs
    are left as they were. The training job merges its config layers with this function."""
    from outcore.app import train
    from outcore.config import merge_mappings

    base = {"a": {"x": 1, "y": [1, 2], "z": {"deep": 1}}, "b": 2, "c": {"k": 1}}
    over = {"a": {"y": [3], "z": {"other": 2}}, "b": None, "c": 5, "d": {"new": 1}}
    before = repr((base, over))
    assert merge_mappings(base, over) == {
        "a": {"x": 1, "y": [3], "z": {"deep": 1, "other": 2}}, "b": None, "c": 5,
        "d": {"new": 1}}
    assert repr((base, over)) == before
    assert merge_mappings({"a": 1}, {"a": {"b": 1}}) == {"a": {"b": 1}}  # a dict replaces a value
    assert train.merge_mappings is merge_mappings
    assert not hasattr(train, "_merge")


def test_every_config_placement_names_a_tier_and_tiers_iterate_fastest_first() -> None:
    from typing import get_args

    from outcore.config import Placement
    from outcore.offload.storage import Tier

    assert [Tier.for_placement(p) for p in get_args(Placement)] == list(Tier)
    assert [t.value for t in Tier] == ["device", "host", "nvme"]


def test_initialize_moves_an_init_built_model_to_its_own_placement(tmp_path) -> None:
    """outcore.init placed the shards one way, initialize asks another: the shards move
    (engine/lifetime.py's [Note: a second engine on the same model]), values unchanged."""
    from torch import nn

    torch.manual_seed(0)
    with outcore.init({"dtype": "fp32"}):
        model = nn.Linear(3, 3)
    with outcore.gathered_parameters(model):
        before = model.weight.data.clone()
    engine = outcore.initialize(model, {"dtype": "fp32", "offload": {"params": "cpu"}})
    assert engine.memory_report()["host"] > 0
    assert torch.equal(model.weight.detach(), before)
    engine.close()


def test_nvme_path_is_read_as_a_shell_reads_it(tmp_path, monkeypatch) -> None:
    """``~`` expanded, a path object taken, a blank name refused (found by a probe: a
    ``pathlib.Path`` was refused as "not a valid string", and ``" "`` made a folder of
    spaces)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    nvme = {"params": "nvme", "optimizer": "nvme"}
    assert outcore.Config.from_dict({"offload": {**nvme, "nvme_path": "~/swap"}}
                                    ).offload.nvme_path == str(tmp_path / "swap")
    assert outcore.Config.from_dict({"offload": {**nvme, "nvme_path": tmp_path / "s"}}
                                    ).offload.nvme_path == str(tmp_path / "s")
    with pytest.raises(outcore.ConfigError, match="offload.nvme_path: a blank name"):
        outcore.Config.from_dict({"offload": {**nvme, "nvme_path": "  "}})


def test_setting_a_key_of_a_frozen_config_is_outcores_error() -> None:
    """It raised pydantic's ValidationError, no OutcoreError (found by a docs probe)."""
    cfg = outcore.Config()
    for what in (lambda: setattr(cfg, "dtype", "fp32"),
                 lambda: setattr(cfg.optimizer, "lr", 1.0)):
        with pytest.raises(outcore.ConfigError, match="a config is frozen: .* cannot be set; "
                                                      r"make another with cfg.with_overrides"):
            what()
    assert cfg.with_overrides({"optimizer": {"lr": 1e-3}}).optimizer.lr == 1e-3
