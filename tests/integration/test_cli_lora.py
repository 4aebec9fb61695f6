"""``outcore train --lora SPEC``: LoRA adapters over a frozen, offloaded base, run as users run
it (``outcore.app.cli.main``), on a tiny Llama saved as a Hugging Face folder."""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import outcore
from outcore.app import cli
from outcore.app.report import read_metrics
from tests.common import save_tiny_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

SPEC = "r=4,alpha=8,targets=q_proj,v_proj"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama (about 109K parameters) with config.json and model.safetensors."""
    return save_tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(Path(inspect.getsourcefile(argparse)).read_text() * 2)
    return path


def _train(llama: Path, corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(llama), "--data", str(corpus), "--out", str(out),
            "--batch", "2", "--seq", "32", "--lr-schedule", "constant", *extra]


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    code = cli.main(argv)
    return code, capsys.readouterr().err


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return safetensors_torch.load_file(folder / "adapter_model.safetensors")


def _reference(llama: Path, corpus: Path, steps: int, lr: float) -> torch.nn.Module:
    """The same job in plain PyTorch: the job's seed before the build, the folder's weights,
    peft's wrapper, torch's AdamW with the job's defaults, clipping at 1.0, the job's batches."""
    from outcore.app.data import BatchSampler, load_tokens, split_tokens
    from outcore.hf.lora import apply_lora

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(llama))
    model.load_state_dict(safetensors_torch.load_file(llama / "model.safetensors"))
    torch.manual_seed(0)  # the job seeds the adapters' init anew, whatever the build drew
    model = apply_lora(model, SPEC)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    sampler = BatchSampler(split_tokens(load_tokens(corpus))[0], 2, 32, seed=0)
    for _ in range(steps):
        x, _ = sampler.next()
        model(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
    return model


def test_adapters_equal_plain_peft_training_and_load_with_peft(
        tmp_path: Path, llama: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = (llama / "model.safetensors").read_bytes()
    out = tmp_path / "run"
    code, err = _run(capsys, _train(llama, corpus, out, "--steps", "3", "--lr", "1e-2",
                                    "--dtype", "fp32", "--offload", "nvme", "--lora", SPEC))
    assert code == 0, err
    adapter = out / "adapter"
    assert f'adapter: {adapter} (PEFT format; load with PeftModel.from_pretrained(base, ' \
           f'"{adapter}"))' in err
    assert "lora: r=4, alpha=8, dropout 0 on q_proj, v_proj: 1,792 trainable params" in err

    saved = _tensors(adapter)
    ref = _reference(llama, corpus, steps=3, lr=1e-2)
    expected = peft.get_peft_model_state_dict(ref)
    assert sorted(saved) == sorted(expected)  # the adapters only, no base weight
    for name, t in expected.items():
        assert saved[name].shape == t.shape  # full-shaped, not ZeRO-3's [0] placeholders
        torch.testing.assert_close(saved[name], t.detach(), rtol=1e-4, atol=1e-6)
    assert all(saved[n].abs().sum() > 0 for n in saved if "lora_B" in n)  # it trained
    assert (llama / "model.safetensors").read_bytes() == weights  # the base is untouched

    base = transformers.AutoModelForCausalLM.from_pretrained(llama)
    loaded = peft.PeftModel.from_pretrained(base, adapter).eval()
    assert loaded.peft_config["default"].base_model_name_or_path == str(llama.resolve())
    x = torch.randint(0, 260, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, ref.eval()(input_ids=x).logits,
                                   rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory: pytest.TempPathFactory, llama: Path) -> Path:
    """The same Llama saved in bf16, as pretrained models ship, in two files and an index."""
    folder = tmp_path_factory.mktemp("llama_bf16")
    model = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="120KB")
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_frozen_base_is_read_in_place_never_copied(
        tmp_path: Path, llama_bf16: Path, corpus: Path, dtype: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A bf16 base on NVMe is read from the folder's own files, in bf16 whatever the compute
    dtype: nothing of it is written to the swap file or the checkpoint."""
    before = {p: p.stat().st_mtime_ns for p in llama_bf16.iterdir()}
    out = tmp_path / "run"
    code, err = _run(capsys, _train(llama_bf16, corpus, out, "--steps", "2", "--dtype", dtype,
                                    "--offload", "nvme", "--lora", SPEC))
    assert code == 0, err
    total, adapters = 109_120, 1_792
    # the summary says so, from the shards themselves: 2 bytes per parameter, in bf16
    compute = "bfloat16" if dtype == "bf16" else "float32"
    assert (f"frozen base 107K params, 215 KB of bfloat16 read in place from "
            f"{llama_bf16.resolve()} (2 B/param; computed in {compute}; no master, gradient "
            "or optimizer state)") in err
    # the ledger counts outcore's own bytes on disk: the adapters' master and AdamW moments
    # (and their bf16 copy, where the compute dtype is not the master's); twice once a step
    # needed no clipping (the main job clips at 1.0): the speculative step then keeps room
    # beside each for its tentative updates
    records = read_metrics(out / "metrics.jsonl")
    speculated = records[0]["grad_norm"] <= 1.0
    assert records[-1]["bytes_nvme"] == (1 + speculated) * adapters * (
        4 + 8 + (2 if dtype == "bf16" else 0))
    assert (total - adapters) * 2 == sum(p.stat().st_size for p in llama_bf16.glob(
        "*.safetensors")) - sum(8 + int.from_bytes(p.read_bytes()[:8], "little")
                                for p in llama_bf16.glob("*.safetensors"))
    # the checkpoint names the base's files and stores the adapters' state only
    ckpt = outcore.latest_checkpoint(out / "checkpoints")
    with safe_open(next(ckpt.glob("*.safetensors")), "pt") as h:
        kinds = {k.split("::", 1)[1] for k in h.keys() if not k.startswith("__")}  # noqa: SIM118
        assert all(".lora_" in k for k in h.keys() if not k.startswith("__"))  # noqa: SIM118
    assert kinds == {"master", "exp_avg", "exp_avg_sq"}
    man = json.loads((ckpt / "manifest.json").read_text())
    assert sorted(man["base"]["files"]) == sorted(p.name for p in llama_bf16.glob("*.safetensors"))
    assert man["base"]["folder"] == str(llama_bf16.resolve())
    assert all(len(f["xxh3_128"]) == 32 for f in man["base"]["files"].values())
    assert not (ckpt / "config.json").exists()
    assert not [p for p in (out / "swap").rglob("*") if p.is_file()]  # swap removed at close
    assert {p: p.stat().st_mtime_ns for p in llama_bf16.iterdir()} == before  # untouched


def test_resume_continues_to_the_uninterrupted_adapters(
        tmp_path: Path, llama: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    argv = _train(llama, corpus, out, "--steps", "4", "--save-every", "2", "--dtype", "fp32",
                  "--offload", "cpu", "--lr", "1e-2", "--lora", SPEC)
    assert _run(capsys, argv)[0] == 0
    uninterrupted = _tensors(out / "adapter")
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl")]
    # As if killed after step 3: the step-4 checkpoint and the adapters never got written.
    shutil.rmtree(out / "checkpoints" / "step-00000004")
    shutil.rmtree(out / "adapter")
    code, err = _run(capsys, [*argv, "--resume"])
    assert code == 0, err
    assert "resuming at step 2" in err
    assert [r["loss"] for r in read_metrics(out / "metrics.jsonl")] == losses
    resumed = _tensors(out / "adapter")
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


def test_resume_needs_the_same_spec(tmp_path: Path, llama: Path, corpus: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    argv = _train(llama, corpus, out, "--steps", "1", "--dtype", "fp32", "--offload", "none")
    assert _run(capsys, [*argv, "--lora", SPEC])[0] == 0
    ckpt = out / "checkpoints" / "step-00000001"
    words = (f"{ckpt} was trained with --lora {SPEC}, not --lora r=8,targets=q_proj; give "
             "the same spec")
    code, err = _run(capsys, [*argv, "--resume", "--lora", "r=8,targets=q_proj"])
    assert code == 2 and err == f"outcore train: error: --resume: {words}" + err.split(
        words, 1)[1]
    assert err.count("\n") == 1 and "Traceback" not in err
    # without --lora, the run's own spec (job.py's [Note: a resume is started as its run was])
    code, err = _run(capsys, [*argv, "--resume"])
    assert code == 0 and "error" not in err, err
    # the same spec spelled differently (key and target order, a default spelled out) resumes
    code, err = _run(capsys, [*argv, "--steps", "2", "--resume", "--lora",
                              "targets=v_proj,q_proj,alpha=8,r=4,dropout=0"])
    assert code == 0, err
    # a run without --lora is not continued by a LoRA run either
    plain = tmp_path / "plain"
    argv = _train(llama, corpus, plain, "--steps", "1", "--dtype", "fp32", "--offload", "none")
    assert _run(capsys, argv)[0] == 0
    code, err = _run(capsys, [*argv, "--resume", "--lora", SPEC])
    assert code == 2 and "checkpoint of a run without --lora; drop --lora" in err


@pytest.mark.parametrize(("spec", "words"), [
    ("r=0,targets=q_proj", "r='0'"),
    ("r=8,foo=1,targets=q_proj", "unknown key 'foo'"),
    ("r=8,targets=nonexistent", "['nonexistent'] match no module"),
    ("r=8,targets=layers", "cannot put an adapter on layers (a ModuleList)"),
    ("r=8", "give at least r=... and targets=..."),
    ("r=8,targets=", "give at least r=... and targets=..."),
])
def test_bad_specs_are_one_line_before_anything_is_built(
        tmp_path: Path, llama: Path, corpus: Path, capsys: pytest.CaptureFixture[str],
        spec: str, words: str) -> None:
    out = tmp_path / "run"
    code, err = _run(capsys, _train(llama, corpus, out, "--lora", spec))
    assert code == 2
    assert err.startswith("outcore train: error: --lora") and words in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()  # nothing built: no swap, no lock, no folder


def test_lora_needs_a_pretrained_hf_folder_and_peft(
        tmp_path: Path, llama: Path, corpus: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    code, err = _run(capsys, ["train", "--model", "tiny", "--out", str(tmp_path / "a"),
                              "--lora", SPEC])
    assert code == 2 and "--lora adapts pretrained weights, so it needs --model HF_FOLDER" in err
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(llama / "config.json", bare)
    code, err = _run(capsys, _train(bare, corpus, tmp_path / "b", "--lora", SPEC))
    assert code == 2 and "holds no *.safetensors weights" in err
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    code, err = _run(capsys, _train(llama, corpus, tmp_path / "c", "--lora", SPEC))
    assert code == 2 and "pip install 'outcore[hf]'" in err and err.count("\n") == 1
    assert not (tmp_path / "c").exists()


def test_the_config_files_train_section_takes_a_spec(
        tmp_path: Path, llama: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("train: {lora: 'r=8,foo=1'}\n")
    code, err = _run(capsys, _train(llama, corpus, tmp_path / "run", "--config", str(cfg)))
    assert code == 2 and "unknown key 'foo'" in err
    cfg.write_text("train: {lora: 8}\n")
    code, err = _run(capsys, _train(llama, corpus, tmp_path / "run", "--config", str(cfg)))
    assert code == 2 and "train.lora: expected a spec" in err


def _rank_job(llama: str, corpus: str, out: str) -> int:
    return cli.main(_train(Path(llama), Path(corpus), Path(out), "--batch", "1", "--steps", "3",
                           "--lr", "1e-2", "--dtype", "fp32", "--offload", "nvme",
                           "--lora", SPEC))


@pytest.mark.slow
def test_two_ranks_write_the_one_rank_adapters(tmp_path: Path, llama: Path,
                                               corpus: Path) -> None:
    """Saving is a collective: both ranks gather their shards of every adapter, rank 0 writes
    them; with the same global batch (1 row per rank) they equal the one-process reference."""
    from tests.distributed import run_world

    out = tmp_path / "run"
    assert run_world(_rank_job, 2, str(llama), str(corpus), str(out)) == [0, 0]
    saved = _tensors(out / "adapter")
    expected = peft.get_peft_model_state_dict(_reference(llama, corpus, steps=3, lr=1e-2))
    assert sorted(saved) == sorted(expected)
    for name, t in expected.items():
        torch.testing.assert_close(saved[name], t.detach(), rtol=1e-4, atol=1e-5)


def test_consolidate_refuses_to_write_over_the_base_or_a_checkpoint(
        tmp_path: Path, llama: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a user-style probe: ``outcore consolidate CKPT BASE_FOLDER`` wrote over the
    base the run reads in place (its checkpoints could no longer resume or consolidate), and
    an OUT naming another checkpoint's rank file or manifest corrupted that checkpoint."""
    base = tmp_path / "base"
    shutil.copytree(llama, base)
    before = (base / "model.safetensors").read_bytes()
    out = tmp_path / "run"
    code, err = _run(capsys, _train(base, corpus, out, "--steps", "2", "--save-every", "1",
                                    "--offload", "nvme", "--lora", SPEC))
    assert code == 0, err
    ckpts = out / "checkpoints"
    last, first = ckpts / "step-00000002", ckpts / "step-00000001"
    code, err = _run(capsys, ["consolidate", str(last), str(base)])
    assert code == 2 and "is the frozen base this checkpoint's run reads in place" in err, err
    assert (base / "model.safetensors").read_bytes() == before
    for name in ("rank00000-of-00001.safetensors", "manifest.json"):
        kept = (first / name).read_bytes()
        code, err = _run(capsys, ["consolidate", str(last), str(first / name)])
        assert code == 2 and "is one of the files of the checkpoint in" in err, err
        assert (first / name).read_bytes() == kept


def test_a_base_folder_moved_since_resumes_where_it_is_now(
        tmp_path: Path, llama: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a user's probe: the run named its base by the path it had, so a base moved
    (or copied to another disk) could never resume, the message not saying it was gone. The
    base's files are checked against the checkpoint's record, so a changed one is still
    refused."""
    base = tmp_path / "base"
    shutil.copytree(llama, base)
    out = tmp_path / "run"
    argv = _train(base, corpus, out, "--steps", "2", "--save-every", "2", "--dtype", "fp32",
                  "--offload", "nvme", "--lr", "1e-2", "--lora", SPEC)
    code, err = _run(capsys, argv)
    assert code == 0 and "read in place" in err
    moved = tmp_path / "moved"
    base.rename(moved)
    code, err = _run(capsys, ["train", "--out", str(out), "--resume", "--steps", "3"])
    assert code == 2 and f"'{base}' does not exist (moved? give --model where it is" in err
    code, err = _run(capsys, ["train", "--out", str(out), "--resume", "--steps", "3",
                              "--model", str(moved)])
    assert code == 0, err
    assert "resuming at step 2" in err
    raw = bytearray((moved / "model.safetensors").read_bytes())
    raw[-3] ^= 0x01
    (moved / "model.safetensors").write_bytes(bytes(raw))
    code, err = _run(capsys, ["train", "--out", str(out), "--resume", "--steps", "4",
                              "--model", str(moved)])
    assert code == 2 and "changed since" in err, err[-600:]
