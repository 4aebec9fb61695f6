"""``outcore train``: settings precedence, input errors, and the job end to end (tiny preset)."""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import outcore
from outcore.app import data as datamod
from outcore.app import job as jobs
from outcore.app import train
from outcore.app.report import read_metrics
from outcore.config import merge_mappings
from outcore.device.accel import default_device
from outcore.errors import ConfigError
from outcore.offload.storage import Tier

_HAS_ENGINE = hasattr(outcore, "initialize")
_HAS_CHECKPOINTS = _HAS_ENGINE and hasattr(outcore, "latest_checkpoint") and hasattr(
    outcore.Engine, "save_checkpoint")
needs_engine = pytest.mark.skipif(
    not _HAS_CHECKPOINTS, reason="engine with checkpoints (outcore.initialize, "
    "Engine.save_checkpoint, outcore.latest_checkpoint) not in this build yet")


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    """~100 KB of Python source: real text, but far quicker to load than the stdlib corpus."""
    path = tmp_path / "corpus.txt"
    path.write_text(Path(inspect.getsourcefile(argparse)).read_text() * 2)
    return path


def _job(out: Path, data: Path, *extra: str) -> list[str]:
    return ["--model", "tiny", "--data", str(data), "--out", str(out), "--batch", "2",
            "--seq", "32", *extra]


def _file_settings(args: argparse.Namespace) -> dict[str, Any]:
    """--config's settings over the defaults under them, as ``train.run`` merges them."""
    file_cfg, under = jobs.read_config_file(args.config)
    return merge_mappings(under, file_cfg)


# -- settings --------------------------------------------------------------------------------
def test_flags_override_the_config_file(tmp_path: Path) -> None:
    cfg_file = tmp_path / "job.yaml"
    cfg_file.write_text("dtype: fp32\noptimizer: {lr: 0.005}\noffload: {params: cpu, "
                        "optimizer: cpu}\ntrain: {steps: 7, batch: 3, model: tiny}\n")
    args = _parse("--config", str(cfg_file), "--batch", "5", "--out", str(tmp_path / "o"))
    file_cfg = _file_settings(args)
    job = train._job_settings(args, file_cfg.pop("train"))
    assert (job["steps"], job["batch"], job["model"]) == (7, 5, "tiny")
    cfg = train._engine_config(args, file_cfg, job, n_params=1000)
    assert (cfg.dtype, cfg.optimizer.lr, cfg.offload.params) == ("fp32", 0.005, "cpu")
    assert cfg.offload.nvme_path == str(tmp_path / "o" / "swap")

    args = _parse("--config", str(cfg_file), "--offload", "nvme", "--lr", "0.01",
                  "--dtype", "bf16", "--nvme-path", str(tmp_path / "swap"))
    file_cfg = _file_settings(args)
    job = train._job_settings(args, file_cfg.pop("train"))
    cfg = train._engine_config(args, file_cfg, job, n_params=1000)
    assert (cfg.dtype, cfg.optimizer.lr) == ("bf16", 0.01)
    assert (cfg.offload.params, cfg.offload.optimizer) == ("nvme", "nvme")
    assert cfg.offload.nvme_path == str(tmp_path / "swap")


def test_file_placements_win_over_the_default_tier_but_not_the_flag(tmp_path: Path) -> None:
    job = train._job_settings(_parse(), {})
    only_path = {"offload": {"nvme_path": str(tmp_path / "s")}}
    cfg = train._engine_config(_parse(), only_path, job, n_params=1000)
    assert (cfg.offload.params, cfg.offload.optimizer) == ("nvme", "nvme")
    assert cfg.offload.nvme_path == str(tmp_path / "s")
    cfg = train._engine_config(_parse(), {"offload": {"params": "cpu"}}, job, n_params=1000)
    assert (cfg.offload.params, cfg.offload.optimizer) == ("cpu", "nvme")
    args = _parse("--offload", "none")
    cfg = train._engine_config(args, {"offload": {"params": "cpu"}},
                               train._job_settings(args, {}), n_params=1000)
    assert (cfg.offload.params, cfg.offload.optimizer) == ("none", "none")
    with pytest.raises(ConfigError, match="offload"):
        train._engine_config(_parse(), {"offload": {"params": "disk"}}, job, n_params=1000)


def test_defaults_are_the_documented_job(tmp_path: Path) -> None:
    args = _parse()
    job = train._job_settings(args, {})
    assert (job["model"], job["steps"], job["offload"], job["out"]) == (
        "small", 300, "nvme", Path("./outcore-run"))
    cfg = train._engine_config(args, {}, job, n_params=10_000_000)
    assert (cfg.offload.params, cfg.offload.optimizer) == ("nvme", "nvme")
    assert cfg.offload.nvme_path == str(Path("./outcore-run") / "swap")
    assert cfg.optimizer.lr == 1e-3


def test_bad_settings_raise_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--steps"):
        train._job_settings(_parse("--steps", "0"), {})
    with pytest.raises(ConfigError, match="train.stepz"):
        train._job_settings(_parse(), {"stepz": 3})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json"):
        jobs.read_config_file(str(bad))
    with pytest.raises(ConfigError, match="missing.yaml"):
        jobs.read_config_file(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="--seq"):
        train.run(_parse("--model", "tiny", "--seq", "4096", "--out", str(tmp_path)))


def test_auto_offload_asks_the_placement_planner(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    args = _parse("--offload", "auto", "--out", str(tmp_path))
    job = train._job_settings(args, {})
    cfg = train._engine_config(args, {}, job, n_params=1000)  # fits in memory: no offload
    assert (cfg.offload.params, cfg.offload.optimizer) == ("none", "none")
    assert "placement" in capsys.readouterr().err  # the plan and why, beside progress
    with pytest.raises(ConfigError, match="does not fit"):
        train._engine_config(args, {}, job, n_params=10**15)


def test_deepspeed_config_files_are_mapped(tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.002}}}))
    args = _parse("--config", str(ds))
    file_cfg = _file_settings(args)
    cfg = train._engine_config(args, file_cfg, train._job_settings(args, {}), n_params=1000)
    assert (cfg.offload.params, cfg.offload.optimizer, cfg.optimizer.lr) == ("cpu", "cpu", 0.002)
    # null sections, which DeepSpeed reads as absent, are absent here too
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": None,
                                                    "offload_optimizer": None}, "aio": None}))
    args = _parse("--config", str(ds), "--offload", "none")
    file_cfg = _file_settings(args)
    cfg = train._engine_config(args, file_cfg, train._job_settings(args, {}), n_params=1000)
    assert (cfg.offload.params, cfg.offload.optimizer) == ("none", "none")


def test_a_deepspeed_files_batch_sizes_are_the_jobs(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """outcore train is the data loader: the micro batch is --batch's default and the total
    gives the accumulation (the banner said 8x32 x1 where the file said 2 and a total of 8);
    the scheduler section is named as not read, pointing at --lr-schedule."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                              "scheduler": {"type": "WarmupLR", "params": {}},
                              "zero_optimization": {"stage": 3}}))
    args = _parse("--config", str(ds))
    with pytest.warns(UserWarning, match="scheduler: not read by outcore train, which runs "
                      "--lr-schedule") as said:
        file_cfg = _file_settings(args)
    assert "train_micro_batch_size_per_gpu" not in str(said[0].message)
    job = train._job_settings(args, file_cfg.pop("train"))  # as train.run takes it out
    cfg = train._engine_config(args, file_cfg, job, n_params=1000)
    assert (job["batch"], cfg.gradient_accumulation_steps) == (2, 4)
    job = train._job_settings(_parse("--config", str(ds), "--batch", "3"), {"batch": 2})
    assert job["batch"] == 3  # a flag still wins


def test_a_deepspeed_config_means_what_it_means_to_deepspeed(tmp_path: Path) -> None:
    """What a DeepSpeed file leaves out is DeepSpeed's default, not the job's: a file that
    offloads parameters only keeps the optimizer states in memory, with Adam's betas 0.9,
    0.999 and no clipping; its NVMe tier still takes --nvme-path."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3,
                                                    "offload_param": {"device": "nvme"}}}))
    args = _parse("--config", str(ds), "--nvme-path", str(tmp_path / "swap"))
    file_cfg = _file_settings(args)
    cfg = train._engine_config(args, file_cfg, train._job_settings(args, {}), n_params=1000)
    assert (cfg.offload.params, cfg.offload.optimizer) == ("nvme", "none")
    assert cfg.offload.nvme_path == str(tmp_path / "swap")
    assert (cfg.optimizer.betas, cfg.gradient_clipping) == ((0.9, 0.999), 0.0)
    args = _parse("--config", str(ds), "--offload", "cpu")  # a flag still overrides it
    cfg = train._engine_config(args, file_cfg, train._job_settings(args, {}), n_params=1000)
    assert (cfg.offload.params, cfg.offload.optimizer) == ("cpu", "cpu")


def test_a_deepspeed_file_sets_what_it_names_not_what_deepspeed_defaults(
        tmp_path: Path) -> None:
    """A resume given a DeepSpeed file again keeps the run's flags where the file names
    nothing: its fp32 (no precision section) or "auto" precision was taken as the file's
    own, and the run's --dtype bf16 was dropped without a word; a placement the file names
    wins over the run's --offload."""
    ds = tmp_path / "ds.json"
    client = {"run": {"options": {"dtype": "bf16", "lr": 5e-3, "offload": "cpu"},
                      "config": None}}
    for precision, dtype in (({}, "fp32"), ({"bf16": {"enabled": "auto"}}, "auto")):
        ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, **precision}))
        settings, under = jobs.read_config_file(str(ds))
        assert "dtype" not in settings and under["dtype"] == dtype
        args = _parse("--config", str(ds), "--resume")
        jobs.resumed_settings(args, settings, client)
        assert (args.dtype, args.lr, args.offload) == ("bf16", 5e-3, "cpu")
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme"}}, "bf16": {"enabled": False}}))
    settings, under = jobs.read_config_file(str(ds))
    assert settings["dtype"] == "fp32"
    args = _parse("--config", str(ds), "--resume")
    jobs.resumed_settings(args, settings, client)
    assert (args.dtype, args.lr, args.offload) == (None, 5e-3, None)


def test_empty_sections_keep_the_job_defaults(tmp_path: Path) -> None:
    cfg_file = tmp_path / "job.yaml"
    cfg_file.write_text("train:\noffload:\noptimizer:\n")  # YAML's empty sections are None
    args = _parse("--config", str(cfg_file))
    file_cfg = _file_settings(args)
    job = train._job_settings(args, file_cfg.pop("train") or {})
    cfg = train._engine_config(args, file_cfg, job, n_params=1000)
    assert cfg.optimizer.betas == (0.9, 0.95)  # the job's, not the schema's 0.999


def test_lr_schedule_warms_up_then_decays_to_a_tenth() -> None:
    lrs = [train._lr_at(s, 100, 1.0, "cosine") for s in range(1, 101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert lrs[-1] == pytest.approx(0.1)
    assert train._lr_at(55, 100, 3e-4, "constant") == 3e-4


def test_bad_data_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from outcore.app.cli import main

    missing = tmp_path / "nothing.txt"
    assert main(["train", "--model", "tiny", "--data", str(missing),
                 "--out", str(tmp_path / "new" / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(missing) in err
    assert not (tmp_path / "new").exists()  # the folders this run made, left empty, go
    kept = tmp_path / "mine"  # a folder the user made is kept, with what is in it
    (kept / "notes.txt").parent.mkdir()
    (kept / "notes.txt").write_text("keep")
    assert main(["train", "--model", "tiny", "--data", str(missing), "--out", str(kept)]) == 2
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]


def test_an_out_that_is_a_file_is_named_as_a_file(tmp_path: Path, text_file: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    """It read "cannot use OUT: File exists" (and "Not a directory" under a file)."""
    from outcore.app.cli import main

    afile = tmp_path / "afile"
    afile.write_text("mine")
    for out, why in ((afile, "it is a file, not a folder"),
                     (afile / "sub", f"{afile} in its path is a file, not a folder")):
        assert main(["train", "--model", "tiny", "--data", str(text_file), "--steps", "1",
                     "--out", str(out)]) == 1
        assert capsys.readouterr().err == f"outcore train: error: cannot use {out}: {why}\n"
    assert afile.read_text() == "mine"


_GPT2_KEYS = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 300, "n_positions": 64}


@pytest.mark.parametrize(("config", "argv", "words"), [
    ("train: 5\n", [], ["train:", "mapping"]),
    ("train: {model: 5}\n", [], ["--model", "5"]),
    ("train: {data: [a, b]}\n", [], ["--data"]),
    ("train: {lr_schedule: linear}\n", [], ["lr_schedule", "linear", "cosine"]),
    ("train: {steps: true}\n", [], ["train.steps", "True"]),
    ("offload: cpu\n", [], ["offload:", "mapping"]),  # was run with the job's own tiers
    ("optimizer: 3\n", [], ["optimizer:", "mapping"]),  # was dropped
    ("optimizer: 3\n", ["--lr", "0.001"], ["optimizer:", "mapping"]),  # with --lr too
    (None, ["--lr", "inf"], ["lr", "finite"]),  # ran to a NaN loss and saved it
    ('{"zero_optimization": 5}', [], ["zero_optimization", "JSON object"]),
    (None, ["--model", "{hf_broken}"], ["config.json"]),
    (None, ["--model", "{hf_unknown}"], ["config.json", "nonsense"]),
    (None, ["--model", "{hf_invalid}"], ["config.json"]),  # transformers' own validation
    (None, ["--model", "{hf_vit}"], ["not a causal language model"]),  # found at the build
], ids=["train-int", "model-int", "data-list", "lr-schedule", "steps-bool", "offload-str",
        "optimizer-int", "optimizer-int-lr", "lr-inf", "deepspeed-section", "hf-broken-json",
        "hf-unknown-type", "hf-invalid", "hf-no-causal-lm"])
def test_bad_job_settings_are_one_line_and_leave_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture, text_file: Path, config: str | None,
        argv: list[str], words: list[str]) -> None:
    from outcore.app.cli import main

    broken, unknown, invalid, vit = (tmp_path / f"hf-{k}"
                                     for k in ("broken", "unknown", "invalid", "vit"))
    for folder, text in ((broken, "{"), (unknown, json.dumps(
            {"model_type": "nonsense", **_GPT2_KEYS})), (invalid, json.dumps(
            {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5,
             "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 300,
             "max_position_embeddings": 64})),  # 64 is not a multiple of 5 heads
            (vit, json.dumps({"model_type": "vit", "hidden_size": 32, "num_hidden_layers": 1,
                              "num_attention_heads": 2, "intermediate_size": 64,
                              "vocab_size": 300}))):  # known, but no causal LM: after --out
        folder.mkdir()
        (folder / "config.json").write_text(text)
    args = [a.format(hf_broken=broken, hf_unknown=unknown, hf_invalid=invalid, hf_vit=vit)
            for a in argv]
    if config is not None:
        cfg = tmp_path / ("ds.json" if config.startswith("{") else "job.yaml")
        cfg.write_text(config)
        args += ["--config", str(cfg)]
    out = tmp_path / "run"
    for flag, value in (("model", "tiny"), ("data", str(text_file)), ("steps", "2")):
        if f"{flag}:" not in (config or "") and f"--{flag}" not in args:  # a flag would win
            args += [f"--{flag}", value]
    assert main(["train", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert all(w in err for w in words), err
    assert not out.exists()


# -- the job end to end ------------------------------------------------------------------------
def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl")}


@needs_engine
@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_job_writes_metrics_checkpoints_and_report(tmp_path: Path, text_file: Path,
                                                   offload: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    assert train.run(_parse(*_job(out, text_file, "--steps", "4", "--save-every", "2",
                                  "--offload", offload))) == 0
    assert "held-out loss: " in capsys.readouterr().err  # the last 1% of the data, measured
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["tokens_per_s"] > 0 and r["loss"] > 0 for r in records)
    assert (records[-1]["bytes_nvme"] > 0) == (offload == "nvme")
    assert [k for k in records[0] if k.startswith("bytes_")] == [f"bytes_{t.value}" for t in Tier]
    latest = outcore.latest_checkpoint(out / "checkpoints")
    assert latest is not None and latest.name == "step-00000004"
    assert (out / "checkpoints" / "step-00000002").is_dir()
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    swap = out / "swap"
    assert not swap.exists() or not [p for p in swap.rglob("*") if p.is_file()]


@needs_engine
def test_resume_reproduces_the_uninterrupted_losses(tmp_path: Path, text_file: Path) -> None:
    out = tmp_path / "run"
    argv = _job(out, text_file, "--steps", "6", "--save-every", "3", "--dtype", "fp32",
                "--offload", "nvme")
    assert train.run(_parse(*argv)) == 0
    uninterrupted = _losses(out)
    # As if killed after step 5: the step-6 checkpoint never completed.
    shutil.rmtree(out / "checkpoints" / "step-00000006")
    assert train.run(_parse(*argv, "--resume")) == 0
    resumed = _losses(out)
    assert list(resumed) == [1, 2, 3, 4, 5, 6]
    assert resumed == uninterrupted  # bit-identical floats after the resume point too
    assert outcore.latest_checkpoint(out / "checkpoints").name == "step-00000006"
    assert train.run(_parse(*argv, "--resume")) == 0  # nothing left to do: a no-op
    assert _losses(out) == uninterrupted


@needs_engine
def test_a_damaged_newest_checkpoint_names_the_one_before_it(tmp_path: Path,
                                                             text_file: Path) -> None:
    """A bit flipped in the newest checkpoint (sizes intact, so latest_checkpoint takes it)
    stopped every --resume with a line that named the file and no way on."""
    out = tmp_path / "run"
    argv = _job(out, text_file, "--steps", "4", "--save-every", "2", "--dtype", "fp32")
    assert train.run(_parse(*argv)) == 0
    newest = out / "checkpoints" / "step-00000004"
    rank_file = newest / "rank00000-of-00001.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 1
    rank_file.write_bytes(bytes(data))
    with pytest.raises(outcore.CorruptCheckpointError, match=r"is corrupt: .*\. To resume from "
                       r"step-00000002, move .*step-00000004 out of .*checkpoints"):
        train.run(_parse(*argv, "--resume", "--steps", "6"))
    shutil.move(newest, tmp_path / "aside")  # as the message says
    assert train.run(_parse(*argv, "--resume", "--steps", "6")) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")][-1] == 6


@needs_engine
def test_resume_over_edited_text_is_named(tmp_path: Path, text_file: Path) -> None:
    """The checkpoint keeps its text's digest: a resume over an edited file says so."""
    out = tmp_path / "run"
    argv = _job(out, text_file, "--steps", "3", "--save-every", "2", "--dtype", "fp32")
    assert train.run(_parse(*argv)) == 0
    shutil.rmtree(out / "checkpoints" / "step-00000003")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert train.run(_parse(*argv, "--resume", "--steps", "4")) == 0
    assert not [w for w in seen if "training text" in str(w.message)]
    text_file.write_text(text_file.read_text() + "one more line\n")
    with pytest.warns(UserWarning, match="the training text differs from the checkpoint's"):
        assert train.run(_parse(*argv, "--resume", "--steps", "5")) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")][-1] == 5


@needs_engine
def test_resume_with_out_alone_continues_the_run_as_it_was_started(
        tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``outcore train --out run1 --resume``, as the docs show it: the model, data, steps,
    learning rate and schedule come from the run (it trained the defaults' 300-step cosine
    on the default data before), from another working folder too; a flag given again wins
    and is named."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    argv = ["--model", "tiny", "--data", text_file.name, "--out", str(out), "--batch", "2",
            "--seq", "32", "--steps", "4", "--save-every", "2", "--dtype", "fp32",
            "--lr", "0.002", "--lr-schedule", "constant"]  # data: relative to tmp_path
    assert train.run(_parse(*argv)) == 0
    uninterrupted = read_metrics(out / "metrics.jsonl")
    shutil.rmtree(out / "checkpoints" / "step-00000004")  # as if killed after step 3
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    assert train.run(_parse("--out", str(out), "--resume")) == 0
    assert "--resume:" not in capsys.readouterr().err  # nothing changed
    resumed = read_metrics(out / "metrics.jsonl")
    assert [(r["step"], r["loss"], r["lr"]) for r in resumed] == [
        (r["step"], r["loss"], r["lr"]) for r in uninterrupted]
    assert train.run(_parse("--out", str(out), "--resume", "--steps", "5")) == 0
    assert "--resume: --steps 5 (the run had 4)\n" in capsys.readouterr().err
    assert [r["lr"] for r in read_metrics(out / "metrics.jsonl")] == [0.002] * 5
    (tmp_path / "elsewhere" / "tiny").mkdir()  # a folder named as the preset: still the preset
    assert train.run(_parse("--out", str(out), "--resume", "--steps", "6")) == 0
    assert train.run(_parse("--out", str(out), "--resume", "--steps", "7")) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")][-1] == 7


@needs_engine
def test_resume_takes_a_config_files_job_and_names_what_a_flag_changes(
        tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's config file is recorded with its paths resolved (its relative data path
    works from another folder); a flag against a value that came from the file is named; a
    --config given again wins over the run's recorded flags where it sets the key."""
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"train: {{model: tiny, data: {text_file.name}, steps: 3, batch: 2, seq: 32, "
                   "save_every: 1, lr_schedule: constant}\ndtype: fp32\n")
    out = tmp_path / "run"
    assert train.run(_parse("--config", str(cfg), "--out", str(out), "--lr", "0.002")) == 0
    shutil.rmtree(out / "checkpoints" / "step-00000003")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    assert train.run(_parse("--out", str(out), "--resume", "--steps", "4")) == 0
    err = capsys.readouterr().err
    assert "--resume: --steps 4 (the run had 3)\n" in err  # 3 came from the file
    assert [r["lr"] for r in read_metrics(out / "metrics.jsonl")] == [0.002] * 4
    new = tmp_path / "new.yaml"  # its optimizer.lr replaces the run's recorded --lr
    new.write_text(f"train: {{model: tiny, data: {text_file}, steps: 5, batch: 2, seq: 32, "
                   "lr_schedule: constant}\ndtype: fp32\noptimizer: {lr: 0.001}\n")
    assert train.run(_parse("--out", str(out), "--resume", "--config", str(new))) == 0
    assert [r["lr"] for r in read_metrics(out / "metrics.jsonl")][-1] == 0.001


@needs_engine
def test_resume_names_what_it_passes_over_and_refuses_another_model(
        tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture) -> None:
    from outcore.app.cli import main

    out = tmp_path / "run"
    argv = _job(out, text_file, "--steps", "4", "--save-every", "2")
    assert train.run(_parse(*argv)) == 0
    rank_file = out / "checkpoints" / "step-00000004" / "rank00000-of-00001.safetensors"
    rank_file.write_bytes(rank_file.read_bytes()[:1000])  # a save cut short
    capsys.readouterr()
    assert train.run(_parse(*argv, "--resume")) == 0
    err = capsys.readouterr().err
    assert "passing over step-00000004" in err and "resuming from step-00000002" in err
    # a checkpoint of tiny, resumed as small: one line naming both, before any build
    argv[argv.index("tiny")] = "small"
    assert main(["train", *argv, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "model 'tiny', not 'small'" in err
    # --steps is the total: below the step reached, one line (it drew "1/1 ... done: 4 steps")
    argv[argv.index("small")] = "tiny"
    argv[argv.index("--steps") + 1] = "1"
    assert main(["train", *argv, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("outcore train: error: --steps 1: the run is at step 4 already "
                   "(step-00000004); --steps is the total to reach, so give more than 4"), err


@needs_engine
def test_a_fresh_run_into_an_earlier_runs_folder_is_refused(tmp_path: Path,
                                                             text_file: Path) -> None:
    """Without ``--resume`` its checkpoints would mix with the earlier run's, and a later
    resume would continue the wrong run; the refusal names the folder and the checkpoint, and
    gives the folder back (a second attempt meets the same refusal, not a lock)."""
    out = tmp_path / "run"
    argv = _job(out, text_file, "--steps", "2", "--save-every", "2", "--dtype", "fp32")
    assert train.run(_parse(*argv)) == 0
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"holds the checkpoints of an earlier run "
                                               r"\(latest: step-00000002\); add --resume"):
            train.run(_parse(*argv, "--steps", "4"))
    assert train.run(_parse(*argv, "--steps", "3", "--resume")) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    assert not (out / ".outcore-lock").exists()


@needs_engine
def test_resume_without_a_checkpoint_starts_fresh(tmp_path: Path, text_file: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    assert train.run(_parse(*_job(out, text_file, "--steps", "2", "--offload", "none",
                                  "--resume"))) == 0
    assert "no complete checkpoint" in capsys.readouterr().err
    assert list(_losses(out)) == [1, 2]


def _failing_rank_job(out: str, data: str, model: str) -> str:
    """One rank of a job whose model fails at the build, after rank 0 made ``--out``."""
    try:
        train.run(_parse("--model", model, "--data", data, "--out", out, "--steps", "1"))
    except ConfigError as e:
        return str(e)
    return "ran"


@needs_engine
def test_a_failed_run_of_two_ranks_removes_the_out_rank_0_made(tmp_path: Path,
                                                               text_file: Path) -> None:
    """Only rank 0 makes ``--out`` (and parents), so only it removes them: the other rank
    neither races it nor removes a folder it did not make."""
    from tests.distributed import run_world

    vit = tmp_path / "vit"  # transformers knows it, but not as a causal LM: fails at the build
    vit.mkdir()
    (vit / "config.json").write_text(json.dumps(
        {"model_type": "vit", "hidden_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 300}))
    out = tmp_path / "new" / "run"
    errors = run_world(_failing_rank_job, 2, str(out), str(text_file), str(vit))
    assert all("not a causal language model" in e for e in errors), errors
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["vit", text_file.name])


def _rank_job(out: str, data: str, batch: str) -> list[float]:
    train.run(_parse("--model", "tiny", "--data", data, "--out", out, "--batch", batch,
                     "--seq", "32", "--steps", "3", "--dtype", "fp32", "--offload", "nvme"))
    return list(_losses(Path(out)).values())


@needs_engine
@pytest.mark.slow
def test_two_ranks_match_one_rank_with_the_same_global_batch(tmp_path: Path,
                                                             text_file: Path) -> None:
    from tests.distributed import run_world

    two = run_world(_rank_job, 2, str(tmp_path / "w2"), str(text_file), "2")
    one = _rank_job(str(tmp_path / "w1"), str(text_file), "4")
    assert two[0] == pytest.approx(one, rel=1e-4)  # rank 0 reports the global mean loss
    assert (tmp_path / "w2" / "report.png").is_file()
    assert outcore.latest_checkpoint(tmp_path / "w2" / "checkpoints") is not None


def _gpt2_folder(folder: Path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=260, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0)).eval()
    hf.save_pretrained(folder)  # config.json + model.safetensors
    return hf


@needs_engine
def test_hf_folder_fine_tunes_from_its_own_weights(tmp_path: Path, text_file: Path) -> None:
    from outcore.app.data import BatchSampler, load_tokens, split_tokens

    folder = tmp_path / "gpt2"
    hf = _gpt2_folder(folder)
    out = tmp_path / "run"
    assert train.run(_parse("--model", str(folder), "--data", str(text_file), "--out", str(out),
                            "--batch", "2", "--seq", "32", "--steps", "2", "--dtype", "fp32",
                            "--offload", "nvme")) == 0
    # Step 1's loss is the saved model's loss on the first batch: its weights were loaded.
    x, _ = BatchSampler(split_tokens(load_tokens(text_file))[0], 2, 32, seed=0).next()
    with torch.no_grad():
        expected = hf(input_ids=x, labels=x).loss.item()
    assert _losses(out)[1] == pytest.approx(expected, rel=1e-4)
    assert outcore.latest_checkpoint(out / "checkpoints") is not None


def test_hf_folder_tokens_use_its_tokenizer_else_bytes(tmp_path: Path, text_file: Path) -> None:
    from tests.common import char_tokenizer as _char_tokenizer

    folder = tmp_path / "gpt2"
    _gpt2_folder(folder)
    job = train._job_settings(_parse("--model", str(folder), "--data", str(text_file)), {})
    tokens, how = datamod.job_tokens(job, vocab=260)
    assert how == "bytes" and tokens.dtype == torch.uint8
    _char_tokenizer(folder)
    tokens, how = datamod.job_tokens(job, vocab=260)
    assert "Tokenizer" in how and tokens.dtype == torch.int32 and int(tokens.max()) < 29
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match="256"):
        datamod.job_tokens(job, vocab=100)


@needs_engine
def test_checkpointed_activations_train_the_same(tmp_path: Path, text_file: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    """``--checkpoint-activations on`` or a number of blocks as a user passes it: the banner
    says how many, the losses are those of the run without it; a bad value is refused in one
    line; ``auto`` leaves the tiny preset alone."""
    losses = {}
    for mode, banner in (("off", ""), ("on", "2 blocks"), ("1", "1 block"), ("auto", "")):
        out = tmp_path / mode
        assert train.run(_parse(*_job(out, text_file, "--steps", "2", "--dtype", "fp32",
                                      "--checkpoint-activations", mode))) == 0
        losses[mode] = _losses(out)
        err = capsys.readouterr().err
        assert ("checkpointed (inputs kept" in err) == bool(banner), mode
        assert f"activations: {banner} checkpointed" in err or not banner, mode
    assert losses["on"] == pytest.approx(losses["off"], rel=1e-6)
    assert losses["1"] == pytest.approx(losses["off"], rel=1e-6)
    assert losses["auto"] == losses["off"]
    with pytest.raises(ConfigError, match="train.checkpoint_activations: got 'yes'"):
        train._job_settings(_parse(), {"checkpoint_activations": "yes"})
    for given, taken in (("3", 3), (True, "on"), (False, "off")):  # YAML: on / off are bools
        assert train._job_settings(_parse(), {"checkpoint_activations": given}
                                   )["checkpoint_activations"] == taken, given
    with pytest.raises(ConfigError, match="got '²'; allowed"):
        train._job_settings(_parse(), {"checkpoint_activations": "²"})
    with pytest.raises(ConfigError, match="got -2; allowed: auto, on, off, or a number"):
        train._job_settings(_parse(), {"checkpoint_activations": -2})
    with pytest.raises(SystemExit):  # argparse's one line: "... got 'some'; allowed: ..."
        _parse("--checkpoint-activations", "some")
    assert "got 'some'; allowed: auto, on, off, or a number" in capsys.readouterr().err


@needs_engine
def test_offloaded_activations_train_the_same(tmp_path: Path, text_file: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    """``--offload-activations nvme``: the banner says how many blocks, the losses are those
    of the run without it, bit for bit; with ``--checkpoint-activations 1`` the first block is
    checkpointed instead; a bad value is refused in one line naming the key."""
    losses = {}
    for name, extra, banner in (
            ("off", (), ""),
            ("nvme", ("--offload-activations", "nvme"), "2 blocks offloaded to NVMe"),
            ("both", ("--offload-activations", "nvme", "--checkpoint-activations", "1"),
             "1 block checkpointed (inputs kept, the rest recomputed in backward); 1 block "
             "offloaded to NVMe"),
            *([("cpu", ("--offload-activations", "cpu"),
                "in host memory already on a CPU device")]
              if default_device().type == "cpu" else [])):
        out = tmp_path / name
        assert train.run(_parse(*_job(out, text_file, "--steps", "2", "--dtype", "fp32",
                                      *extra))) == 0
        losses[name] = _losses(out)
        err = capsys.readouterr().err
        assert (f"activations: {banner}" in err) if banner else "activations:" not in err, err
    assert losses["nvme"] == losses.get("cpu", losses["off"]) == losses["off"]
    assert losses["both"] == pytest.approx(losses["off"], rel=1e-6)
    assert train._job_settings(_parse(), {"offload_activations": False}
                               )["offload_activations"] == "off"  # YAML's unquoted off
    with pytest.raises(ConfigError, match="train.offload_activations: got 'disk'; allowed: off"):
        train._job_settings(_parse(), {"offload_activations": "disk"})
