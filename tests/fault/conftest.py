"""Fixtures for fault tests: a really small filesystem to fill up."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB ext4 filesystem mounted from a loop image (root only; skipped elsewhere)."""
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    image.write_bytes(b"")
    subprocess.run(["truncate", "-s", "48M", str(image)], check=True)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True)
    mounted = made.returncode == 0 and subprocess.run(
        ["mount", "-o", "loop", str(image), str(mnt)], capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("cannot mount a loop filesystem here (needs root and loop devices)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
