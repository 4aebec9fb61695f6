"""The machine probe: positive rates under the exact JSON keys, and nothing left on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from outcore.errors import StorageError
from outcore.probe import ProbeResult, measure

KEYS = {
    "disk_read_GBps",
    "disk_write_GBps",
    "host_copy_GBps",
    "matmul_bf16_TFLOPs",
    "matmul_fp32_TFLOPs",
}


def test_probe_measures_positive_rates_and_cleans_up(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    result = measure(
        tmp_path,
        size_bytes=3 << 20,
        rounds=1,
        host_copy_bytes=1 << 20,
        bf16_n=128,
        fp32_n=128,
        block_bytes=1 << 18,
    )
    assert isinstance(result, ProbeResult)
    out = result.to_json()
    assert set(out) == KEYS | {"direct_io"}
    assert all(isinstance(out[k], float) and out[k] > 0 for k in KEYS)
    assert isinstance(out["direct_io"], bool)
    assert json.loads(json.dumps(out)) == out
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_probe_on_a_missing_folder_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "a" / "b"
    with pytest.raises(StorageError, match=str(missing)):
        measure(missing, size_bytes=1 << 16, rounds=1, bf16_n=8, fp32_n=8)


def test_probe_rejects_nonsense_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        measure(tmp_path, size_bytes=0)
