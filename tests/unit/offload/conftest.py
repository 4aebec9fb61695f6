"""Fixtures of the offload tests: a safetensors file with tensors at unaligned offsets and a
reader over it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from outcore.offload.aio import AioEngine
from outcore.offload.source_file import SourceReader


@pytest.fixture
def st_file(tmp_path: Path) -> Path:
    """Tensors of odd sizes, so most start at offsets no page boundary meets."""
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(7, generator=g).to(torch.bfloat16),
               "b": torch.randn(3001, 5, generator=g).to(torch.bfloat16),
               "c": torch.randn(1234, generator=g),
               "d": torch.randn(40000, generator=g).to(torch.float16),
               "z": torch.arange(11, dtype=torch.int64)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, path)
    return path


@pytest.fixture
def reader():
    with AioEngine(threads=3) as engine:
        r = SourceReader(engine, chunk_bytes=8192, buffers=2)  # many chunks, few buffers
        yield r
        r.close()
