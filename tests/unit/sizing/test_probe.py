"""The machine probe: positive rates under the exact JSON keys, and nothing left on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from outcore.device.compute_dtype import capabilities, choose
from outcore.errors import StorageError
from outcore.sizing.probe import ProbeResult, measure

KEYS = {
    "disk_read_GBps",
    "disk_write_GBps",
    "host_copy_GBps",
    "matmul_bf16_TFLOPs",
    "matmul_fp32_TFLOPs",
    "matmul_fp16_TFLOPs",
}
ADDED = {"direct_io", "native", "matmul_n", "auto_dtype", "disk_bytes", "device", "machine"}


def test_probe_measures_positive_rates_and_cleans_up(tmp_path: Path,
                                                     device: torch.device) -> None:
    (tmp_path / "keep.txt").write_text("x")
    result = measure(
        tmp_path,
        size_bytes=3 << 20,
        rounds=1,
        host_copy_bytes=1 << 20,
        matmul_seconds=0.05,
        max_n=256,
        block_bytes=1 << 18,
    )
    assert isinstance(result, ProbeResult)
    out = result.to_json()
    assert set(out) == KEYS | ADDED
    assert all(isinstance(out[k], float) and out[k] > 0 for k in KEYS)
    assert isinstance(out["direct_io"], bool)
    assert json.loads(json.dumps(out)) == out
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    # what this machine multiplies natively, and what auto picks from it, as the engine would
    caps = capabilities(device)
    assert out["device"] == str(device)
    assert out["native"] == {"bf16": caps.bf16, "fp16": caps.fp16, "fp32": True}
    assert out["auto_dtype"] == choose("auto", caps).name
    assert out["machine"]["cpu"] and out["machine"]["dtype"] == out["auto_dtype"]
    assert all(128 <= n <= 256 for n in out["matmul_n"].values())
    assert 0 < out["disk_bytes"] <= 3 << 20


def test_probe_sizes_its_matmuls_by_time(tmp_path: Path) -> None:
    """A tiny time budget stops at the first size; a larger one grows the square."""
    small = measure(tmp_path, size_bytes=1 << 20, rounds=1, host_copy_bytes=1 << 16,
                    matmul_seconds=1e-6, block_bytes=1 << 18)
    assert set(small.matmul_n.values()) == {128}
    grown = measure(tmp_path, size_bytes=1 << 20, rounds=1, host_copy_bytes=1 << 16,
                    matmul_seconds=2.0, max_n=512, block_bytes=1 << 18)
    assert grown.matmul_n["fp32"] > 128  # a 256-square fp32 product takes well under 0.2 s


def test_probe_on_a_missing_folder_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "a" / "b"
    with pytest.raises(StorageError, match=str(missing)):
        measure(missing, size_bytes=1 << 16, rounds=1, matmul_seconds=0.01, max_n=8)


def test_probe_rejects_nonsense_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        measure(tmp_path, size_bytes=0)
