"""A script that ends, or raises, while outcore's updates run (after a backward, before or
without ``close()``) exits with its own status: optim/pipeline.py's [Note: a process that ends
with updates running]. Each case runs in its own interpreter, since the failure it guards
against aborts the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, torch, outcore
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
engine = outcore.initialize(model, {{
    "dtype": "fp32", "zero": {{"overlap_step_with_forward": {defer}}},
    "offload": {{"params": "nvme", "optimizer": "nvme", "nvme_path": sys.argv[1]}}}})
x = torch.randn(32, 256)
for step in range({steps}):
    engine.backward(engine(x).pow(2).mean())
    if step < {steps} - 1 or {last_step}:
        engine.step()
assert engine.overlaps_optimizer
print("ending", flush=True)
{ending}
"""


@pytest.mark.parametrize(("case", "defer", "last_step", "ending", "status"), [
    ("the script ends after a backward", False, False, "", 0),
    ("it raises after a backward", False, False, "raise RuntimeError('user bug')", 1),
    ("sys.exit(3) after a backward", False, False, "sys.exit(3)", 3),
    ("it ends while the step's tail runs", True, True, "", 0),
])
def test_the_process_exits_with_its_own_status(tmp_path: Path, case: str, defer: bool,
                                               last_step: bool, ending: str,
                                               status: int) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT).format(
        defer=defer, steps=1, last_step=last_step, ending=ending))
    proc = subprocess.run([sys.executable, str(script), str(swap)], cwd=ROOT, timeout=300,
                          capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert "ending" in proc.stdout, out
    assert proc.returncode == status, f"{case}: status {proc.returncode}\n{out}"
    assert "terminate called" not in out
    assert not [p for p in swap.rglob("*") if p.is_file()]  # its swap files went with it
