"""A frozen parameter's shard read from the model's own file: padding, partial ranges,
digests that catch a rewritten file, and writes refused (fixtures: conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from outcore.errors import StorageError
from outcore.offload.file_shard import FileShard
from outcore.offload.source_file import SourceReader, read_header


def test_file_shard_pads_verifies_and_refuses_writes(st_file: Path, reader: SourceReader) -> None:
    e = read_header(st_file)["b"]
    full = e.shape[0] * e.shape[1]
    shard = FileShard(reader, e, start=full - 100, valid=100, numel=128)
    out = torch.full((128,), 5.0)
    shard.load(out).result()
    with safe_open(st_file, "pt") as h:
        want = h.get_tensor("b").reshape(-1)[-100:].float()
    assert torch.equal(out[:100], want) and not out[100:].any()  # padding is zeros
    part = torch.empty(30)
    shard.load_range(90, part).result()  # 10 values, then padding
    assert torch.equal(part[:10], want[90:]) and not part[10:].any()
    with pytest.raises(StorageError, match="never writes"):
        shard.save(out)
    # the same bytes rewritten on disk (same size, new values) are caught at the next read
    raw = bytearray(st_file.read_bytes())
    raw[e.offset + e.nbytes - 4] ^= 0xFF
    with open(st_file, "r+b") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    with pytest.raises(StorageError, match="changed while outcore used it"):
        shard.load(out).result()
