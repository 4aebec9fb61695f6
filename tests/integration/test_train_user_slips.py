"""``outcore train`` given what users get wrong (a probe's findings): a damaged checkpoint in
the way of a resume's saves, ``--out`` naming a checkpoint or the checkpoints folder, a seed
torch cannot take, an empty ``--nvme-path``, a config file's mistake named as a flag, a
DeepSpeed config whose NVMe tier needs ``--nvme-path``, the shortest text that holds one
window, a resume whose config was edited, and one given its DeepSpeed config again."""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import pytest

from outcore.app.cli import main
from outcore.app.report import read_metrics


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(Path(inspect.getsourcefile(argparse)).read_text())
    return path


def _job(out: Path, data: Path, *extra: str) -> list[str]:
    return ["train", "--model", "tiny", "--dtype", "fp32", "--data", str(data), "--out",
            str(out), "--batch", "2", "--seq", "32", *extra]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_checkpoint_without_its_manifest_in_the_way_is_refused_before_training(
        tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The resume passed over the damaged folder, trained the steps since the last
    checkpoint again, then failed at that step's save, on every retry."""
    out = tmp_path / "run"
    assert main(_job(out, text_file, "--steps", "4", "--save-every", "2")) == 0
    damaged = out / "checkpoints" / "step-00000004"
    (damaged / "manifest.json").unlink()
    trained = read_metrics(out / "metrics.jsonl")
    err = _error(capsys, _job(out, text_file, "--steps", "6", "--save-every", "2",
                              "--resume"))
    assert err == (f"outcore train: error: --resume: {damaged} is in the way of this run's "
                   "saves: it holds no manifest.json, so it is no checkpoint outcore may "
                   "replace. Move it out of the checkpoints folder (or delete it), then resume")
    assert read_metrics(out / "metrics.jsonl") == trained  # no step trained again
    damaged.rename(tmp_path / "kept-aside")
    assert main(_job(out, text_file, "--steps", "6", "--save-every", "2", "--resume")) == 0
    assert max(r["step"] for r in read_metrics(out / "metrics.jsonl")) == 6


def test_out_naming_a_checkpoint_or_the_checkpoints_folder_is_refused(
        tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Given either, ``--resume`` found no checkpoint under it and trained a new run from
    step 0 inside the old run's checkpoints."""
    out = tmp_path / "run"
    assert main(_job(out, text_file, "--steps", "2")) == 0
    ckpts = out / "checkpoints"
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    err = _error(capsys, _job(ckpts, text_file, "--steps", "4", "--resume"))
    assert err == (f"outcore train: error: --out {ckpts} is a run's checkpoints folder; give "
                   f"the run's folder ({out})")
    step = ckpts / "step-00000002"
    err = _error(capsys, _job(step, text_file, "--steps", "4", "--resume"))
    assert err == (f"outcore train: error: --out {step} is a checkpoint, not a run's folder; "
                   f"give the run's folder ({out}), which holds checkpoints/")
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


@pytest.mark.parametrize(("extra", "words"), [
    (["--seed", "99999999999999999999"], "seed: Input should be less than or equal to "
                                         "9223372036854775807"),
    (["--nvme-path", ""], "--nvme-path: expected a folder for swap files, got ''"),
])
def test_values_torch_or_the_disk_cannot_take_are_one_line(
        tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str],
        extra: list[str], words: str) -> None:
    """A seed past 2**63 - 1 ended in torch's traceback ("Overflow when unpacking long
    long"); an empty swap path was taken as the default."""
    err = _error(capsys, _job(tmp_path / "run", text_file, "--steps", "1", *extra))
    assert words in err, err
    assert not (tmp_path / "run").exists()


def test_a_config_files_mistake_is_named_as_the_files(
        tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("train:\n  steps: -3\n")
    err = _error(capsys, _job(tmp_path / "run", text_file, "--config", str(config)))
    assert err == "outcore train: error: train.steps: must be a whole number >= 1, got -3"
    err = _error(capsys, _job(tmp_path / "run", text_file, "--config", str(config),
                              "--steps", "0"))
    assert err == "outcore train: error: --steps: must be a whole number >= 1, got 0"


def test_a_deepspeed_config_on_nvme_takes_nvme_path(tmp_path: Path, text_file: Path) -> None:
    """Its NVMe tier without a path was refused before ``--nvme-path`` (or OUT/swap) could
    give one, as an outcore config's is not."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme"},
        "offload_optimizer": {"device": "nvme"}}}))
    out, swap = tmp_path / "run", tmp_path / "swap"
    assert main(_job(out, text_file, "--steps", "1", "--config", str(config),
                     "--nvme-path", str(swap))) == 0
    run = json.loads((out / "checkpoints" / "step-00000001" / "manifest.json").read_text())
    assert run["config"]["offload"]["nvme_path"] == str(swap)
    assert run["config"]["offload"]["params"] == "nvme"


def test_the_shortest_text_is_one_window(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """33 tokens hold one window of 32 inputs and their 32 targets; they were refused."""
    data = tmp_path / "short.txt"
    data.write_bytes(bytes(range(97, 97 + 26)) + b"abcdefg")  # 33 bytes: 33 byte tokens
    assert main(_job(tmp_path / "run", data, "--steps", "1")) == 0


def test_the_progress_bar_says_when_it_saves(tmp_path: Path, text_file: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A save (minutes for a large model) stood the bar still with no word of why."""
    capsys.readouterr()
    assert main(_job(tmp_path / "run", text_file, "--steps", "2", "--save-every", "1")) == 0
    err = capsys.readouterr().err
    assert "saving step-00000001" in err and "saving step-00000002" in err, err


def test_a_batch_no_memory_holds_is_one_line_and_leaves_nothing(
        tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It ran until the kernel killed the process for memory (the swap file and the lock
    left behind), or torch failed to allocate in a traceback."""
    out = tmp_path / "run"
    err = _error(capsys, _job(out, text_file, "--steps", "1", "--batch", "10000000"))
    assert err.startswith("outcore train: error: --batch 10000000 x --seq 32: the activations "
                          "need at least "), err
    assert "even with every block checkpointed" in err and "give a smaller --batch" in err
    assert not out.exists()


def test_a_resume_takes_the_edited_configs_optimizer_settings(
        tmp_path: Path, text_file: Path, recwarn: pytest.WarningsRecorder) -> None:
    """The checkpoint's settings replaced the config's on resume, with a warning that also
    named the learning rate, which the job's schedule sets at every step anyway: a weight
    decay edited before the resume was dropped. Now the config's apply, without a word."""
    out, first, edited = tmp_path / "run", tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("optimizer:\n  weight_decay: 0.0\n")
    edited.write_text("optimizer:\n  weight_decay: 0.1\n")
    assert main(_job(out, text_file, "--steps", "2", "--save-every", "2", "--config",
                     str(first))) == 0
    assert main(_job(out, text_file, "--steps", "3", "--save-every", "2", "--config",
                     str(edited), "--resume")) == 0
    assert not [w for w in recwarn if "optimizer settings replace" in str(w.message)]
    saved = json.loads((out / "checkpoints" / "step-00000003" / "manifest.json").read_text())
    assert [g["weight_decay"] for g in saved["param_groups"]] == [0.1]


def test_a_deepspeed_config_given_again_on_resume_keeps_the_runs_flags(
        tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A DeepSpeed file's defaults were merged into it as it was read, so a resume given the
    file again took its defaults as settings of the file: the run's --lr was dropped (1e-4,
    Config's, in place of 5e-3), without a word. A file without a learning rate trained at
    Config's 1e-4, not the job's default for the model; and the resume line named the job's
    default tier (nvme) for a run the file kept in memory."""
    ds, out = tmp_path / "ds.json", tmp_path / "run"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    common = ("--config", str(ds), "--lr-schedule", "constant", "--save-every", "2")
    assert main(_job(out, text_file, *common, "--steps", "2", "--lr", "5e-3")) == 0
    assert main(["train", "--out", str(out), "--resume", "--steps", "3", "--config",
                 str(ds)]) == 0
    assert [r["lr"] for r in read_metrics(out / "metrics.jsonl")] == [5e-3] * 3
    saved = json.loads((out / "checkpoints" / "step-00000003" / "manifest.json").read_text())
    assert (saved["config"]["dtype"], saved["config"]["offload"]["params"]) == ("fp32", "none")
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--steps", "4", "--offload", "nvme"]) == 0
    assert "--resume: --offload nvme (the run had none)\n" in capsys.readouterr().err

    other = tmp_path / "other"  # no learning rate in the file: the job's default for tiny
    assert main(_job(other, text_file, *common, "--steps", "1")) == 0
    assert [r["lr"] for r in read_metrics(other / "metrics.jsonl")] == [1e-3]


def test_a_resume_names_what_a_config_given_again_changes(
        tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config given again on resume changed the learning rate or the tiers without a
    word (and a run's recorded --offload overrode the placements the new file names)."""
    out, first, second = tmp_path / "run", tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("optimizer:\n  lr: 0.004\n")
    second.write_text("optimizer:\n  lr: 0.002\noffload:\n  params: none\n  optimizer: none\n")
    assert main(_job(out, text_file, "--steps", "2", "--save-every", "2", "--lr-schedule",
                     "constant", "--offload", "cpu", "--config", str(first))) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--steps", "3", "--config",
                 str(second)]) == 0
    err = capsys.readouterr().err
    assert "--resume: lr 0.002 (the run had 0.004)\n" in err, err
    assert "--resume: offload none (the run had cpu)\n" in err, err
    assert [r["lr"] for r in read_metrics(out / "metrics.jsonl")] == [0.004, 0.004, 0.002]
    saved = json.loads((out / "checkpoints" / "step-00000003" / "manifest.json").read_text())
    assert (saved["config"]["offload"]["params"], saved["config"]["offload"]["optimizer"]) == (
        "none", "none")


def test_a_config_given_again_keeps_the_runs_train_section(
        tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a user-style probe: a run whose config's ``train:`` section named its model,
    data, batch and seq, resumed with a config that has none, was refused as a checkpoint
    of another model (the job's default), and with ``--model`` given trained the default
    data at the default batch without a word."""
    out, first, second = tmp_path / "run", tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text(f"train:\n  model: tiny\n  data: {text_file}\n  steps: 2\n  batch: 2\n"
                     "  seq: 32\n  save_every: 2\n")
    second.write_text("optimizer:\n  lr: 0.002\n")
    assert main(["train", "--out", str(out), "--config", str(first)]) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--steps", "3", "--config",
                 str(second)]) == 0
    err = capsys.readouterr().err
    assert f"data: {text_file.resolve()}" in err and "batch 2x32 per rank" in err, err
    assert "--resume: data" not in err and "--resume: batch" not in err
    assert len(read_metrics(out / "metrics.jsonl")) == 3
    other = tmp_path / "other.txt"  # a config given again that changes them: named
    other.write_text(text_file.read_text()[::-1])
    second.write_text(f"train:\n  data: {other}\n  batch: 1\n")
    assert main(["train", "--out", str(out), "--resume", "--steps", "4", "--config",
                 str(second)]) == 0
    err = capsys.readouterr().err
    assert f"--resume: data {other.resolve()} (the run had {text_file.resolve()})" in err, err
    assert "--resume: batch 1 (the run had 2)" in err, err


def test_a_bad_count_in_the_file_is_named_even_where_a_flag_wins(
        tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a user-style probe: ``train.steps: "two"`` passed unseen beside --steps."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  steps: two\n")
    err = _error(capsys, _job(tmp_path / "run", text_file, "--steps", "2", "--config", str(cfg)))
    assert "train.steps: must be a whole number >= 1, got 'two'" in err, err


def test_an_nvme_path_nothing_uses_is_said(
        tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--nvme-path`` with ``--offload cpu`` was ignored without a word."""
    with pytest.warns(UserWarning, match="--nvme-path .*fast is unused: nothing is placed on "
                                         r"NVMe \(params cpu, optimizer cpu\)"):
        assert main(_job(tmp_path / "run", text_file, "--steps", "1", "--offload", "cpu",
                         "--nvme-path", str(tmp_path / "fast"))) == 0
