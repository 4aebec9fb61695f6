"""The ``outcore`` command: outputs, exit codes and the one-line error policy."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from outcore.app import cli
from outcore.errors import ConfigError, DataError, OutcoreError, StorageError
from tests.common import REPO

DGX2 = ["--gpus", "16", "--gpu-memory", "32GB", "--host-memory", "1.5TB", "--nvme", "28TB"]
PROBE = {"disk_read_GBps": 2.0, "disk_write_GBps": 2.8, "host_copy_GBps": 19.0,
         "matmul_bf16_TFLOPs": 1.6, "matmul_fp32_TFLOPs": 0.3, "direct_io": True,
         "matmul_fp16_TFLOPs": 0.01, "native": {"bf16": True, "fp16": False, "fp32": True},
         "matmul_n": {"bf16": 4096, "fp16": 512, "fp32": 2048}, "auto_dtype": "bf16",
         "disk_bytes": 2**29, "device": "cpu",
         "machine": {"cpu": "Intel Xeon", "cores": 2, "gpu": None}}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, prog: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: "), err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0]


def test_estimate_json_for_a_parameter_count(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "estimate", "--params", "1.3B", "--gpus", "8", "--json")
    assert code == 0
    memory = json.loads(out)["memory"]
    assert memory["params"] == 1_300_000_000
    assert memory["model_states"] == 16 * 1_300_000_000
    assert memory["strategies"]["zero3_nvme"]["nvme"] == 16 * 1_300_000_000 // 8
    assert set(memory["strategies"]) == {"data_parallel", "zero3", "zero3_cpu", "zero3_nvme"}


def test_estimate_table_for_a_shape(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "estimate", "--layers", "24", "--hidden", "2048", "--seq", "2048",
                       "--batch", "4")
    assert code == 0
    assert "24 layers, hidden 2048, 16 heads" in out
    for name in ("data_parallel", "zero3", "zero3_cpu", "zero3_nvme", "device", "host", "nvme"):
        assert name in out
    assert "GB" in out and "batch 4 x seq 2048" in out


def test_max_model_json_is_the_documented_contract(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "estimate", "--max-model", *DGX2, "--json")
    assert code == 0
    data = json.loads(out)
    best = data["max_params"]
    assert set(best) == {"data_parallel", "zero3", "zero3_cpu", "zero3_nvme"}
    assert all(isinstance(v, int) for v in best.values())
    assert 1e9 < best["data_parallel"] < 2.5e9 and 0.7e12 < best["zero3_nvme"] < 2.5e12
    assert data["hardware"]["host_memory_per_node"] == 1_500_000_000_000


def test_max_model_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "estimate", "--max-model", *DGX2, "--fp32-grads")
    assert code == 0
    assert "20 bytes/param" in out and "runs out of" in out
    assert "1.4" in out.split("data_parallel")[-1].split("\n")[0]  # ~1.4B, as in the paper


def test_a_size_of_the_largest_model_group_asks_for_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--gpu-memory 80GB`` without ``--max-model`` was ignored without a word; the sizes
    not given count as none, as the table says."""
    code, out, _ = run(capsys, "estimate", "--params", "1B", "--gpu-memory", "80GB")
    assert code == 0 and "model states, whole model" in out
    assert "per node 0 B host, 0 B NVMe" in out and "max parameters" in out
    code, _, err = run(capsys, "estimate", "--nvme", "1TB")
    assert code == 2
    assert_one_line_error(err, "outcore estimate", "--max-model needs --gpu-memory")


def test_efficiency_from_a_probe_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(PROBE))
    code, out, _ = run(capsys, "estimate", "--model", "tiny", "--probe", str(probe),
                       "--tokens-per-step", "2048", "--json")
    assert code == 0
    eff = json.loads(out)["efficiency"]
    assert set(eff) == {"host", "nvme"}
    assert eff["nvme"]["tokens_per_step"] == 2048
    assert 0 < eff["nvme"]["combined"] < eff["nvme"]["params_grads"] < 1
    code, out, _ = run(capsys, "estimate", "--probe", str(probe))  # no model needed
    assert code == 0 and "params+grads" in out and "nvme" in out


@pytest.mark.parametrize(("argv", "words"), [
    (["estimate", "--max-model", "--gpu-memory", "32XB"], ["--gpu-memory", "'32XB'", "GiB"]),
    (["estimate", "--params", "lots"], ["--params", "'lots'"]),
    (["estimate", "--params", "1B", "--bogus"], ["unrecognized", "--bogus"]),
    (["estimate", "--batch", "0", "--params", "1B"], ["--batch"]),
    (["estimate"], ["give a model"]),
    (["estimate", "--params", "1B", "--layers", "2", "--hidden", "64"], ["--params", "--layers"]),
    (["estimate", "--layers", "2"], ["--hidden"]),
    (["estimate", "--layers", "2", "--hidden", "100", "--heads", "3"], ["divisible"]),
    (["estimate", "--model", "no-such-model"], ["unknown preset 'no-such-model'; choose "
                                                "one of tiny, small,", "config.json"]),
    (["estimate", "--max-model"], ["--gpu-memory"]),
    (["estimate", "--max-model", "--gpu-memory", "0"], ["--gpu-memory: got 0"]),
    (["estimate", "--model", "gpt-335m", "--seq", "4096"],
     ["--seq: 4096 exceeds the model's longest sequence 1024"]),
    (["estimate", "--model", "./no/such/folder"], ["./no/such/folder: no such folder"]),
    (["estimate", "--probe", "/no/such/probe.json"], ["/no/such/probe.json"]),
    (["estimate", "--max-model", "--gpu-memory", "1GB", "--gpus", "3", "--nodes", "2"],
     ["nodes"]),
    (["probe", "--size", "1.5"], ["--size", "whole number"]),
    (["probe", "--size", "0"], ["--size", "under 64MiB"]),
    (["probe", "--size", "1"], ["--size", "under 64MiB, too small to measure"]),
    (["probe", "--path", "/no/such/folder"], ["/no/such/folder"]),
    (["consolidate"], ["CKPT"]),
])
def test_bad_arguments_exit_2_with_one_line(capsys: pytest.CaptureFixture[str],
                                            argv: list[str], words: list[str]) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert_one_line_error(err, f"outcore {argv[0]}", *words)


def test_top_level_usage(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "frobnicate")
    assert code == 2
    assert_one_line_error(err, "outcore", "frobnicate")
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("outcore ") and out.strip() != "outcore unknown"
    code, _, err = run(capsys)
    assert code == 2 and "estimate" in err  # no command: the help, on stderr
    code, out, _ = run(capsys, "estimate", "--help")
    assert code == 0 and "--max-model" in out


@pytest.fixture
def fake_probe(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """An ``outcore.sizing.probe`` stand-in recording its calls; ``raises`` makes it fail."""
    calls: dict[str, Any] = {}

    def measure(path: str, **kwargs: Any) -> Any:
        calls.update(path=path, **kwargs)
        if "raises" in calls:
            raise calls["raises"]
        return types.SimpleNamespace(to_json=lambda: dict(PROBE))

    monkeypatch.setitem(sys.modules, "outcore.sizing.probe",
                        types.SimpleNamespace(measure=measure))
    return calls


def test_probe_prints_json_or_a_table(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                      fake_probe: dict[str, Any]) -> None:
    code, out, _ = run(capsys, "probe", "--path", str(tmp_path), "--size", "1GiB", "--json")
    assert code == 0 and json.loads(out) == PROBE
    assert fake_probe == {"path": str(tmp_path), "size_bytes": 2**30}
    fake_probe.clear()
    code, out, _ = run(capsys, "probe", "--path", str(tmp_path))
    assert code == 0  # the probe picks its own size, and shows progress to a person
    assert fake_probe == {"path": str(tmp_path), "progress": True}
    assert "disk read" in out and "GB/s" in out and "TFLOP/s" in out
    assert re.search(r"bypassed page cache +yes", out)
    assert "Intel Xeon, 2 cores" in out and re.search(r"dtype auto chooses +bf16", out)
    assert "matmul fp16 on cpu (emulated)" in out and "matmul bf16 on cpu (native)" in out


@pytest.mark.parametrize(("error", "code"), [
    (ConfigError("offload.nvme_path: must be a folder, got 'x'"), 2),
    (DataError("data: /tmp/empty.txt is empty"), 2),
    (StorageError("nvme_path /swap: no space left (needs 12 GB)"), 1),
    (OutcoreError("something the user can fix\nspread over lines"), 1),
    (KeyboardInterrupt(), 130),
])
def test_errors_inside_a_subcommand(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                    fake_probe: dict[str, Any], error: BaseException,
                                    code: int) -> None:
    fake_probe["raises"] = error
    got, out, err = run(capsys, "probe", "--path", str(tmp_path))
    assert got == code
    if code != 130:
        assert_one_line_error(err, "outcore probe", str(error).split()[0])
    else:
        assert "interrupted" in err and "Traceback" not in err


def test_bugs_keep_their_traceback(tmp_path: Path, fake_probe: dict[str, Any]) -> None:
    fake_probe["raises"] = RuntimeError("a bug")
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["probe", "--path", str(tmp_path)])


def test_consolidate_writes_weights_that_load_strictly(capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    import outcore

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7))
    plain = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7))
    engine = outcore.initialize(model, {"dtype": "fp32"})
    engine.backward(engine(torch.randn(3, 5).to(engine.device)).sum())
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    with engine.gathered_parameters():
        expected = {n: p.data.cpu().clone() for n, p in model.named_parameters()}
    engine.close()
    out_file = tmp_path / "model.safetensors"
    code, out, _ = run(capsys, "consolidate", str(tmp_path / "ckpt"), str(out_file))
    assert code == 0 and str(out_file) in out
    plain.load_state_dict(load_file(out_file), strict=True)
    for name, p in plain.named_parameters():
        assert torch.equal(p, expected[name]), name
    # over the checkpoint's own files: refused, the checkpoint untouched; into its folder
    # under the default name: allowed (a folder from_pretrained loads)
    ckpt = tmp_path / "ckpt"
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    for target in ("rank00000-of-00001.safetensors", "manifest.json"):
        code, out, err = run(capsys, "consolidate", str(ckpt), str(ckpt / target))
        assert code == 2 and out == ""
        assert_one_line_error(err, "outcore consolidate", "is one of the files of the checkpoint")
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert run(capsys, "consolidate", str(ckpt), str(ckpt))[0] == 0
    plain.load_state_dict(load_file(ckpt / "model.safetensors"), strict=True)


def test_train_options_come_from_outcore_train(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[argparse.Namespace] = []

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--steps", type=int, default=10)

    def run_job(args: argparse.Namespace) -> int:
        seen.append(args)
        if args.steps < 0:
            raise DataError("data: no text in /tmp/x")
        return 0

    monkeypatch.setitem(sys.modules, "outcore.app.train",
                        types.SimpleNamespace(add_arguments=add_arguments, run=run_job))
    assert run(capsys, "train", "--steps", "3")[0] == 0
    assert seen[-1].steps == 3
    code, _, err = run(capsys, "train", "--stepz", "3")
    assert code == 2
    assert_one_line_error(err, "outcore train", "--stepz")
    code, _, err = run(capsys, "train", "--steps", "-1")
    assert code == 2
    assert_one_line_error(err, "outcore train", "no text")


def test_a_missing_part_is_one_line_not_a_traceback(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "outcore.app.train", None)  # makes the import fail
    code, _, err = run(capsys, "train")
    assert code == 1
    assert_one_line_error(err, "outcore train", "outcore.app.train")
    assert run(capsys, "estimate", "--params", "1B")[0] == 0  # the others still work


def test_the_real_command_in_a_subprocess() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    ok = subprocess.run([sys.executable, "-m", "outcore", "estimate", "--max-model", *DGX2,
                         "--json"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert set(json.loads(ok.stdout)["max_params"]) == {"data_parallel", "zero3", "zero3_cpu",
                                                       "zero3_nvme"}
    bad = subprocess.run([sys.executable, "-m", "outcore", "estimate", "--max-model",
                          "--gpu-memory", "lots"], capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=120)
    assert bad.returncode == 2
    assert_one_line_error(bad.stderr, "outcore estimate", "'lots'")
    # a reader that has gone (`| head -1` after its line): no traceback, SIGPIPE's exit code
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to the pipe now fails, as after head exits
    try:
        proc = subprocess.run([sys.executable, "-m", "outcore", "estimate", "--model",
                               "gpt-335m"], stdout=write_end, stderr=subprocess.PIPE,
                              cwd=REPO, env=env, timeout=120)
    finally:
        os.close(write_end)
    err = proc.stderr.decode()
    assert (proc.returncode, err) == (141, "")
    if Path("/dev/full").exists():  # a stdout that takes nothing: one line, not a traceback
        with open("/dev/full", "w") as full:
            proc = subprocess.run([sys.executable, "-m", "outcore", "estimate", "--params",
                                   "1B"], stdout=full, stderr=subprocess.PIPE, text=True,
                                  cwd=REPO, env=env, timeout=120)
        assert (proc.returncode, proc.stderr) == (
            1, "outcore estimate: error: writing the output failed: No space left on "
               "device\n")
    proc = subprocess.run(["sh", "-c", 'exec "$0" -m outcore estimate --params 1B >&-',
                           sys.executable], stderr=subprocess.PIPE, text=True, cwd=REPO,
                          env=env, timeout=120)  # a closed stdout: it printed nothing, exit 0
    assert (proc.returncode, proc.stderr) == (
        1, "outcore estimate: error: writing the output failed: standard output is closed\n")


def test_a_warning_is_one_line_without_source() -> None:
    """Python's format put the file, line number and source line around a warning
    ("/.../bin/outcore:8: EmulatedDtypeWarning ..."); the command says what, in one line."""
    code = ("import sys, warnings\nfrom outcore.app import cli\n"
            "cli._run_estimate = lambda args: (warnings.warn('something to know'), 0)[1]\n"
            "sys.exit(cli.main(['estimate', '--params', '1B']))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120)
    assert (done.returncode, done.stderr) == (0, "outcore estimate: warning: something to know\n")


@pytest.mark.parametrize("extra", [(), ("--max-model", "--gpu-memory", "32GB")])
def test_estimate_refuses_gpus_that_the_nodes_cannot_share(
        capsys: pytest.CaptureFixture[str], extra: tuple[str, ...]) -> None:
    """Found by a user-style probe: 3 nodes of 2 GPUs in all was priced without a word,
    and refused only with --max-model."""
    code, out, err = run(capsys, "estimate", "--params", "1B", "--nodes", "3", "--gpus", "2",
                         *extra)
    assert code == 2 and out == ""
    assert "--gpus (2) must be a multiple of --nodes (3)" in err


def test_a_stop_signal_after_the_command_ends_does_not_kill_it(tmp_path: Path) -> None:
    """Found by a user-style probe: a SIGTERM or SIGINT in the second the interpreter takes
    to tear down after a finished run killed it with 143 or 130 and no word."""
    script = ("import os, signal, sys, time\nfrom outcore.app.cli import main\n"
              "sys.argv = ['outcore', 'estimate', '--params', '1B']\ncode = main()\n"
              "for sig in (signal.SIGTERM, signal.SIGINT):\n    os.kill(os.getpid(), sig)\n"
              "time.sleep(0.2)\nprint('exited', code, flush=True)\nsys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and "exited 0" in proc.stdout, proc.stderr


@pytest.mark.parametrize(("ckpt", "out", "said"), [
    ("a_file", "w.safetensors", "is a file; give a checkpoint's folder"),
    (".", "", "OUT is empty"),
])
def test_consolidate_names_a_file_for_a_checkpoint_and_an_empty_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], ckpt: str, out: str,
        said: str) -> None:
    """A file given as the checkpoint read "manifest.json is unreadable or not JSON: Not a
    directory" (exit 1); an empty OUT wrote ./model.safetensors."""
    (tmp_path / "a_file").write_text("x")
    code, _, err = run(capsys, "consolidate", str(tmp_path / ckpt), out)
    assert code == 2
    assert_one_line_error(err, "outcore consolidate", said)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
