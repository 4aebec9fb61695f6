"""bench/lora.py end to end with the tiny preset: one JSON with every row, and the bytes the
engine reports per kind show what a LoRA run keeps of a frozen base (outcore/hf/lora.py's
[Note: a frozen base costs its 16-bit bytes only]): only the adapters have optimizer state,
gradients and master weights (but in fp32 with the base and the optimizer state in the same
tier, where the base's one fp32 shard is its master); the base is stored once, in the compute
dtype, and with the base on NVMe it is read each step, never written, and never gathered
whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from outcore.app.models import PRESETS, num_params
from tests.common import REPO

pytest.importorskip("peft")


def adapter_params(r: int = 8) -> int:
    """LoRA parameters of ``r=8,targets=qkv,proj,fc`` on the tiny preset, counted by hand:
    r * (in + out) for each of qkv, attn.proj, mlp.fc, mlp.proj in every block."""
    cfg = PRESETS["tiny"]
    h, inner = cfg.hidden, cfg.mlp_ratio * cfg.hidden
    per_block = r * ((h + 3 * h) + (h + h) + (h + inner) + (inner + h))
    return cfg.layers * per_block


def total(row: dict, kind: str, peak: bool = False) -> int:
    """Bytes of one kind over all tiers (now, or the peak over the measured steps)."""
    return sum(v for k, v in row["kinds"][kind].items() if k.startswith("peak_") == peak)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_lora_bench_tiny_rows_and_bytes_per_kind(tmp_path: Path, dtype: str) -> None:
    out = tmp_path / "lora.json"
    # one torch thread: a 2-core machine shared with other work would otherwise stall
    # every parallel region on a descheduled thread
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "lora.py"), "--tiny", "--dtype", dtype,
         "--steps", "2", "--threads", "1", "--rows", "lora-mem,lora-nvme,full-nvme",
         "--nvme", str(tmp_path / "swap"), "--logs", str(tmp_path / "logs"), "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result == json.loads(out.read_text())
    assert result["dtype"] == dtype and result["machine_info"]["cpu"]
    assert "| LoRA, base on NVMe |" in proc.stderr  # the table
    rows = {r["row"]: r for r in result["rows"]}
    assert list(rows) == ["lora-mem", "lora-nvme", "full-nvme"]

    n, a = num_params(PRESETS["tiny"]), adapter_params()
    size = {"bf16": 2, "fp32": 4}[dtype]
    assert result["base_bytes"] == n * size and result["adapter_params"] == a
    assert result["host_budget_bytes"] == 2 << 20 < result["base_bytes"]
    assert not result["base_fits_budget"]
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["peak_rss"] > 0 and r["rss_steps_peak"] > 0
        assert r["losses"][-1] < r["losses"][0], r["row"]

    for name in ("lora-mem", "lora-nvme"):
        r = rows[name]
        assert r["frozen_init"] and (r["params_trainable"], r["params_frozen"]) == (a, n)
        # AdamW's two fp32 moments, and fp32 gradients, for the adapters only
        assert total(r, "optimizer") == 8 * a, name
        assert 0 < total(r, "grads", peak=True) <= 4 * a, name
        if name == "lora-mem" and dtype == "fp32":
            # params and optimizer state in one tier: the base's one fp32 shard is its
            # master (compute_is_master), there is no second copy
            assert total(r, "master") == 4 * (n + a) and total(r, "params") == 0, name
        else:  # the base once, in the compute dtype; fp32 masters for the adapters alone
            assert total(r, "master") == 4 * a, name
            # on NVMe the adapters' copies are cast from their masters, stored nowhere
            # (storage.py's CastShard); in memory each has a stored copy
            assert total(r, "params") == size * (n + (a if name == "lora-mem" else 0)), name
            # built frozen: the base never had an fp32 master, not even during the build
            assert r["after_build"]["by_kind"]["peak.device.master"] == 4 * a, name
    full = rows["full-nvme"]
    assert total(full, "optimizer") == 8 * n
    assert total(full, "grads", peak=True) > 4 * a  # more than every adapter's gradient

    # base on NVMe: its bytes sit in the nvme tier; each step reads the base (forward and
    # the input gradients of backward) and writes nothing: the adapters' new values are their
    # masters in memory, which the next fetch casts
    r = rows["lora-nvme"]
    assert r["placement"] == {"params": "nvme", "optimizer": "none"}
    stored = r["kinds"]["params"]
    assert stored["nvme"] == size * n and set(stored) == {"nvme", "peak_nvme"}
    assert r["store_read_per_step"] >= n * size
    assert r["store_write_per_step"] == 0
    # never the whole base gathered at once: the layers are fetched and released in turn
    assert 0 < r["by_kind"]["peak.device.unsharded"] < n * size
    assert rows["lora-mem"]["store_read_per_step"] == 0
    assert full["store_write_per_step"] >= 12 * n  # the full fine-tune writes every state
    assert not (tmp_path / "swap").exists()  # each row's swap folder is removed
