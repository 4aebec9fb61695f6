"""The static checks pass: ruff on the whole repository, and mypy, strict, on the packages
that move bytes and state.

``pyproject.toml`` holds both tools' settings (``[tool.mypy]`` names the packages: zero,
offload, optim, overlap); these run them as a developer does, in a subprocess, and show the
tool's own report when they fail, so CI (which runs the suite) runs them too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# the same code on either device: the CPU suite runs them (a GPU machine may lack the tools)
pytestmark = pytest.mark.cpu_only("static checks read the code; the device changes nothing")


def test_ruff_passes() -> None:
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"ruff found problems:\n{done.stdout}{done.stderr}"


def test_mypy_strict_passes() -> None:
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mypy found errors:\n{done.stdout}{done.stderr}"


def test_mypy_sees_an_error(tmp_path: Path) -> None:
    """The check can fail: the same configuration reports a wrongly typed function."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f(x: int) -> str:\n    return x\n")
    done = subprocess.run([sys.executable, "-m", "mypy", "--strict", str(bad)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Incompatible return value" in done.stdout, done.stdout
