"""The torch floor: torch_version.py's [Note: torch 2.8 is the oldest outcore runs on]."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import outcore
from outcore.device import torch_version
from outcore.device.torch_version import OLDEST, check_torch, release

ROOT = Path(__file__).resolve().parents[3]


def test_release_reads_local_and_pre_release_versions() -> None:
    assert release("2.11.0+cu130") == (2, 11)
    assert release("2.13.0") == (2, 13)
    assert release("2.9.0a0+git1234") == (2, 9)
    assert release("3.0") == (3, 0)


def test_an_older_torch_is_refused_in_words_when_a_run_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    check_torch()  # this one runs
    with pytest.raises(outcore.ConfigError, match=r"needs torch 2\.8 or newer; this is torch "
                       r"2\.4\.1\+cpu"):
        check_torch("2.4.1+cpu")
    monkeypatch.setattr(torch_version.torch, "__version__", "2.7.1")
    with pytest.raises(outcore.ConfigError, match="this is torch 2.7.1"):
        outcore.initialize(torch.nn.Linear(2, 2), outcore.Config(dtype="fp32"))


def test_the_package_declares_the_same_floor() -> None:
    # (tomllib is Python 3.11's; the project runs on 3.10 too)
    deps = re.findall(r'"torch>=([0-9.]+),', (ROOT / "pyproject.toml").read_text())
    assert deps == [f"{OLDEST[0]}.{OLDEST[1]}"]
