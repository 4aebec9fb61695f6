"""bench/gpu.py end to end with a tiny model: one JSON, every row with numbers (on the CPU
here; under ``--device cuda`` the same run is a smoke test of the GPU rows)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.common import REPO


def test_gpu_bench_runs_tiny_and_prints_one_json(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py"), "--tiny", "--models", "tiny",
         "--rows", "plain,none,cpu+opt,nvme+opt", "--nvme-path", str(tmp_path / "swap"),
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result == json.loads(out.read_text())
    assert {"probe", "dtype", "models", "rows", "peak_TFLOPs", "sweep", "targets"} <= set(result)
    pr = result["probe"]
    assert pr["matmul_bf16_TFLOPs"] > 0 and pr["disk_read_GBps"] > 0
    assert pr["machine"]["torch"] and "device" in pr
    assert result["models"]["tiny"]["params"] > 1e6

    rows = {(r["row"], r["batch"], r["seq"]): r for r in result["rows"]}
    assert {r[0] for r in rows} == {"plain", "none", "cpu+opt", "nvme+opt"}
    for r in rows.values():
        assert r["status"] == "ok", r
        for key in ("tokens_per_s", "TFLOPs", "pct_of_peak", "step_s", "peak_host_rss"):
            assert isinstance(r[key], (int, float)) and r[key] > 0, (r["row"], key)
        assert r["losses"][-1] < r["losses"][0], r["row"]
        if r["row"] != "plain":
            assert r["floor_s"] > 0 and r["step_over_floor"] > 0
    assert rows[("nvme+opt", 2, 64)]["read_bytes_per_step"] > 0
    assert rows[("nvme+opt", 2, 64)]["written_bytes_per_step"] > 0
    assert rows[("none", 2, 64)]["read_bytes_per_step"] == 0

    sweep = result["sweep"]
    assert sweep["row"] == "cpu+opt" and len(sweep["points"]) == 2
    for p in sweep["points"]:
        assert p["measured"] > 0 and 0 < p["predicted"] <= 1
    for name in ("none_vs_plain", "none_pct_of_peak", "host_vs_none_at_most_tokens",
                 "nvme_step_over_floor", "big_model_trains"):
        assert "met" in result["targets"][name]
    assert not (tmp_path / "swap").exists()  # each row's swap folder is removed


def test_checkpointed_rows_checkpoint_every_block_and_train_the_same(tmp_path: Path) -> None:
    """``--checkpoint`` (more tokens beside the device's states): the outcore rows' blocks keep
    only their inputs, every block or N of them, the losses are the same, and the prediction
    moves activations off the device."""
    losses = {}
    for flag, blocks in (([], 0), (["--checkpoint"], 2), (["--checkpoint", "1"], 1)):
        out = tmp_path / f"gpu{len(flag)}.json"
        proc = subprocess.run(
            [sys.executable, str(REPO / "bench" / "gpu.py"), "--tiny", "--models", "tiny",
             "--rows", "cpu+opt", "--no-sweep", "--nvme-path", str(tmp_path / "swap"),
             "--out", str(out), *flag],
            capture_output=True, text=True, timeout=600, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (row,) = json.loads(out.read_text())["rows"]
        assert row["status"] == "ok", row
        assert row["checkpointed_blocks"] == blocks  # the tiny model has 2
        losses[blocks] = row["losses"]
    for blocks in (1, 2):
        assert losses[blocks] == pytest.approx(losses[0], rel=1e-5)  # the same arithmetic

    if str(REPO / "bench") not in sys.path:
        sys.path.append(str(REPO / "bench"))
    import gpu

    m = gpu.shape("gpt-1.3b")
    whole, half, kept = (gpu.predicted_bytes("cpu+opt", m, 16, 2048, checkpoint=c)
                         for c in (None, 12, "on"))
    assert kept["device"] < whole["device"] / 3 and kept["host"] > whole["host"]
    assert kept["device"] < half["device"] < whole["device"]
    assert whole["host"] < half["host"] < kept["host"]
    assert gpu._checkpoint_arg("on") == "on" and gpu._checkpoint_arg("12") == 12
    for bad in ("-1", "²", "all"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a number of blocks"):
            gpu._checkpoint_arg(bad)


def test_set_reaches_the_outcore_rows_engine(tmp_path: Path) -> None:
    """``--set KEY=JSON`` (as bench/train.py's) overrides the config of every outcore row: with
    a learning rate of 1e-30 (0 is refused) no weight moves, so the fixed batch's loss stays.
    A swap folder that was there before the run stays after it (only what the run made goes)."""
    out = tmp_path / "gpu.json"
    (tmp_path / "swap").mkdir()
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py"), "--tiny", "--models", "tiny",
         "--rows", "none", "--no-sweep", "--set", "optimizer.lr=1e-30", "--set",
         "zero.overlap_step_with_forward=true", "--nvme-path", str(tmp_path / "swap"),
         "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["status"] == "ok" and len(set(row["losses"])) == 1, row["losses"]
    assert set(row["updates"]) >= {"updates_during_backward", "updates_at_step",
                                   "updates_after_step"}
    assert "overlap_step_with_forward" in result["settings"]["outcore_set"]
    assert (tmp_path / "swap").is_dir() and not any((tmp_path / "swap").iterdir())


def test_merged_runs_give_one_json(tmp_path: Path) -> None:
    """Runs split over several commands (the GPU session's 10-minute limit) merge into one,
    the later run's rows replacing the same rows of the earlier."""
    if str(REPO / "bench") not in sys.path:
        sys.path.append(str(REPO / "bench"))  # after the standard library (bench/io.py)
    import gpu

    probe = {"matmul_bf16_TFLOPs": 100.0, "disk_read_GBps": 2.0, "disk_write_GBps": 1.0,
             "host_copy_GBps": 10.0, "h2d_GBps": 20.0, "machine": {"gpu": None}}
    model = {"params": 10**9, "layers": 24, "hidden": 2048, "vocab": 32000, "seq_len": 2048,
             "state_bytes": 16 * 10**9}

    def row(name: str, step_s: float, placement: list[str]) -> dict:
        return {"model": "m", "row": name, "label": name, "placement": placement, "batch": 1,
                "seq": 2048, "main": True, "status": "ok", "step_s": step_s, "fwd_s": 0.1,
                "bwd_s": 0.2, "losses": [2.0, 1.0], "peak_host_rss": 1,
                "store_read_per_step": 0.0, "store_write_per_step": 0.0}

    first = {"probe": probe, "dtype": "bf16", "models": {"m": model},
             "settings": {"models": "m", "sweep_row": "cpu+opt"},
             "rows": [row("none", 1.0, ["none", "none"]), row("cpu+opt", 9.0, ["cpu", "cpu"])]}
    second = {**first, "rows": [row("cpu+opt", 1.25, ["cpu", "cpu"])]}
    paths = []
    for i, run in enumerate((first, second)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(run))
    merged = gpu.summarize(gpu.merge(paths))
    assert [r["row"] for r in merged["rows"]] == ["none", "cpu+opt"]
    host = merged["rows"][1]
    assert host["step_s"] == 1.25 and host["floor"]["compute_s"] == 1.0
    # params there and back (4 B) and gradients down (2 B) per parameter over a 20 GB/s link
    assert host["floor"]["link_bytes"] == 6 * 10**9
    assert host["floor_s"] == 1.0 and host["step_over_floor"] == 1.25
    assert merged["targets"]["host_vs_none_at_most_tokens"]["value"] == 0.8
    assert [p["measured"] for p in merged["sweep"]["points"]] == [0.8]

    # the host-memory row checkpointed at 4 sequences, no offload's most at 2: each row at
    # the most tokens it ran (issue 21's measure), not only where both ran
    third = {**first, "rows": [{**row("none", 1.5, ["none", "none"]), "batch": 2},
                               {**row("cpu+opt", 2.5, ["cpu", "cpu"]), "batch": 4}]}
    paths.append(tmp_path / "2.json")
    paths[-1].write_text(json.dumps(third))
    target = gpu.summarize(gpu.merge(paths))["targets"]["host_vs_none_at_most_tokens"]
    # 4 x 2048 / 2.5 s against 2 x 2048 / 1.5 s
    assert target["value"] == pytest.approx((4 / 2.5) / (2 / 1.5))
    assert (target["tokens"], target["none_tokens"], target["met"]) == (4 * 2048, 2 * 2048, True)


def test_a_probe_from_an_earlier_run_gets_this_machines_link(tmp_path: Path) -> None:
    """``--probe-from`` keeps the earlier probe but measures the host-device link again: two
    H100 machines of one kind can differ there (bench/gpu/2026-11-26-h100-c/README.md)."""
    import argparse

    import torch

    if str(REPO / "bench") not in sys.path:
        sys.path.append(str(REPO / "bench"))
    import gpu

    earlier = {"h2d_GBps": 55.0, "d2h_GBps": 55.0, "matmul_bf16_TFLOPs": 730.0}
    pr = gpu.own_link(earlier, argparse.Namespace(tiny=True), tmp_path)
    assert pr["matmul_bf16_TFLOPs"] == 730.0  # the rest of the probe is kept
    if torch.cuda.is_available():  # link_rates measures wherever torch sees a GPU
        assert pr["link_from"] == "this run" and pr["h2d_GBps"] != 55.0
    else:  # no link to measure: the earlier rates stand, and the JSON says whose they are
        assert pr["link_from"] == "the earlier probe" and pr["h2d_GBps"] == 55.0
    assert (tmp_path / "link.log").is_file()


def test_gpu_step_profile_runs_every_variant_tiny(tmp_path: Path) -> None:
    # bench/gpu/profile_step.py: prepared here so a GPU session spends its minutes on the run
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu" / "profile_step.py"), "--model", "tiny",
         "--batch", "2", "--seq", "32", "--warmup", "1", "--steps", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = {r["variant"]: r for r in json.loads((tmp_path / "profile-summary.json").read_text())}
    assert set(summary) == {"plain", "plain-master", "none", "none-serial", "cpu+opt"}
    for variant, r in summary.items():
        assert r["step_s"] > 0 and r["cpu_ops_per_step"] > 0
        table = (tmp_path / f"profile-{variant.replace('+', '-')}.txt").read_text()
        assert "by device time" in table and "aten::" in table
    # outcore's own ranges are seen in its rows only
    assert "outcore::step" in summary["none"]["outcore_ranges_ms_per_step"]
    # the host-memory row runs its update on the host (the CPU device here)
    assert "outcore::optim_update" in summary["cpu+opt"]["outcore_ranges_ms_per_step"]
    assert summary["plain"]["outcore_ranges_ms_per_step"] == {}
    # every file a name the device tool brings back (letters, digits, '.', '_', '-')
    assert all(re.fullmatch(r"[\w.-]+", p.name) for p in tmp_path.iterdir())
