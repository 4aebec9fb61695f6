"""A long run whose execution path changes randomly every step: correct and bounded."""

from __future__ import annotations

from pathlib import Path

from tests.common import run_divergent as _run
from tests.distributed import run_world

BUDGET = 3 * 16640  # three of the model's 64x64 blocks


def test_sixty_random_paths_match_prefetch_off_with_bounded_memory(tmp_path: Path) -> None:
    on = run_world(_run, 1, "path", BUDGET, "nvme", str(tmp_path), 60)[0]
    off = run_world(_run, 1, "path", 0, "nvme", str(tmp_path), 60)[0]
    assert on["losses"] == off["losses"]
    s = on["stats"]
    assert s["divergences"] >= 20 and s["retraces"] >= 20  # it really kept diverging
    assert s["prefetch_hits"] > 0  # and still prefetched where the trace held
    assert s["peak_ahead_bytes"] <= BUDGET  # the budget held for all 60 steps
