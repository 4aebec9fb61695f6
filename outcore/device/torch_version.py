"""The torch versions outcore runs on, checked where a run starts.

[Note: torch 2.8 is the oldest outcore runs on]
outcore leans on torch APIs that arrived across the 2.x releases; an audit of the releases'
sources (2026-11-26) found what each older one lacks: ``adam(decoupled_weight_decay=)``
(2.7), the public ``register_load_state_dict_pre_hook`` (2.5), the CPU feature checks behind
``dtype: auto`` (2.5 and 2.6), and ``_top_saved_tensors_default_hooks`` (2.8), without which
a checkpointed block that takes a parameter as an input would keep a tensor whose storage is
released after forward, and backward would read freed memory. Rather than run unchecked where
that can happen, a run on an older torch stops at once and says so (``pip`` enforces the same
floor through ``pyproject.toml``, but an environment installed without dependencies, like a GPU
image's, does not). From 2.8 on the differences are guarded where they are used: the flat
collectives' names (runtime/comm.py) and the page-aligned storages of 2.12
(``AlignedRegions.supported``).
"""

from __future__ import annotations

import torch

from outcore.errors import ConfigError

OLDEST = (2, 8)


def release(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check_torch(version: str | None = None) -> None:
    """Refuse a torch older than ``OLDEST`` (see the note), naming both versions."""
    found = version or torch.__version__
    if release(found) < OLDEST:
        raise ConfigError(
            f"outcore needs torch {OLDEST[0]}.{OLDEST[1]} or newer; this is torch {found}. "
            f"Upgrade it (pip install 'torch>={OLDEST[0]}.{OLDEST[1]}'): older releases lack "
            "APIs outcore uses, and one of them would make backward read freed memory")
