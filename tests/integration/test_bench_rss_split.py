"""bench/rss_split.py end to end with a small preset: the settings reach the engine, the
ledger's kinds in host memory are reported beside the peak, and the smallest footprint's
buffers are smaller."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.common import REPO


def _split(tmp_path: Path, *flags: str) -> dict:
    cmd = [sys.executable, str(REPO / "bench" / "rss_split.py"), "--model", "small", "--seq",
           "64", "--steps", "2", "--nvme-path", str(tmp_path / "swap"), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_rss_split_reports_the_ledger_under_the_peak(tmp_path: Path,
                                                    device: torch.device) -> None:
    default = _split(tmp_path)
    lean = _split(tmp_path, "--lean", "--checkpoint")
    assert default["settings"] == {"offload": {}, "zero": {}}
    mib = 1 << 20
    assert lean["settings"] == {"offload": {"reuse_freed_memory": False,
                                            "host_buffer_bytes": 64 * mib},
                                "zero": {"prefetch_bytes": 64 * mib}}
    assert lean["checkpointed_blocks"] == 4 and default["checkpointed_blocks"] == 0
    for split in (default, lean):
        rss = split["rss_MiB"]
        assert 0 < rss["python_torch"] <= rss["outcore_imported"] < rss["steps_peak"]
        # on the CPU the device tier is host memory too: the kept layers are counted, or the
        # copies kept in memory across steps (zero/build.py's keep_resident); on a GPU they
        # are device memory, outside the host's peak (seen under --device cuda)
        peaks = set(split["ledger_peaks_MiB"])
        assert "host.io_buffers" in peaks
        assert device.type != "cpu" or {"device.unsharded", "host.params"} & peaks
        assert device.type == "cpu" or not any(
            k.startswith("device.") for k in split["ledger_peaks_MiB"])
        growth = rss["steps_peak"] - rss["outcore_imported"]  # each rounded down to MiB
        assert abs(split["rest_MiB"] - (growth - sum(split["ledger_peaks_MiB"].values()))) <= 1
        assert split["peak_over_model_states"] > 0 and len(split["steps_s"]) == 2
    # 64 MiB of I/O buffers against the default 256
    assert lean["ledger_peaks_MiB"]["host.io_buffers"] <= 64
    assert default["ledger_peaks_MiB"]["host.io_buffers"] > 128
    assert not list((tmp_path / "swap").glob("*")), "the engine removes its swap file"


def test_rss_split_offloads_every_block_and_says_so(tmp_path: Path) -> None:
    """``--offload-activations`` reaches the model: every block offloaded, none checkpointed,
    and the swap folder left empty."""
    split = _split(tmp_path, "--offload-activations")
    assert split["offloaded_blocks"] == 4 and split["checkpointed_blocks"] == 0
    assert len(split["steps_s"]) == 2
    assert not list((tmp_path / "swap").glob("*")), "the engine removes its swap file"


def test_a_flag_beside_lean_takes_precedence(tmp_path: Path) -> None:
    """``--lean`` fills in only what no flag set: a prefetch budget given beside it is used."""
    split = _split(tmp_path, "--lean", "--prefetch-mib", "96")
    assert split["settings"] == {"offload": {"reuse_freed_memory": False,
                                             "host_buffer_bytes": 64 << 20},
                                 "zero": {"prefetch_bytes": 96 << 20}}
