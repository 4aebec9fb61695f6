"""Reading a model's own safetensors files in place: headers, unaligned ranges, casts, the
file's last page, chunk queueing, and what a malformed file does (fixtures: conftest.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from outcore.errors import ConfigError, StorageError
from outcore.offload.aio import AioEngine
from outcore.offload.source_file import SourceReader, content_hash, read_header


def test_header_names_the_bytes_safetensors_reads(st_file: Path) -> None:
    entries = read_header(st_file)
    raw = st_file.read_bytes()
    with safe_open(st_file, "pt") as h:
        assert sorted(entries) == sorted(h.keys())
        for name, e in entries.items():
            t = h.get_tensor(name)
            assert (e.dtype, e.shape) == (t.dtype, tuple(t.shape))
            want = t.contiguous().view(-1).view(torch.uint8)
            got = torch.frombuffer(bytearray(raw[e.offset : e.offset + e.nbytes]),
                                   dtype=torch.uint8)
            assert torch.equal(got, want)


def test_reads_at_any_offset_cast_into_the_destination(st_file: Path, reader: SourceReader
                                                       ) -> None:
    entries = read_header(st_file)
    with safe_open(st_file, "pt") as h:
        for name in "abcd":
            e, t = entries[name], h.get_tensor(name).reshape(-1)
            for dtype in (e.dtype, torch.float32):
                for lo, hi in ((0, t.numel()), (3, t.numel() - 2), (t.numel() // 2, t.numel())):
                    out = torch.full((hi - lo,), 7.0, dtype=dtype)
                    reader.read_now(e, lo, out)
                    assert torch.equal(out, t[lo:hi].to(dtype)), (name, dtype, lo, hi)
    assert reader.bytes_read > 0


def test_many_reads_queue_for_two_buffers_without_blocking_the_caller(
        st_file: Path, reader: SourceReader) -> None:
    e = read_header(st_file)["d"]
    outs = [torch.empty(40000, dtype=torch.float16) for _ in range(6)]
    futures = [reader.read(e.path, e.offset, o, e.dtype) for o in outs]  # 10 chunks each
    for f in futures:
        f.result(timeout=30)
    with safe_open(st_file, "pt") as h:
        for o in outs:
            assert torch.equal(o, h.get_tensor("d"))


def test_a_short_file_is_an_error_naming_it(st_file: Path, reader: SourceReader) -> None:
    e = max(read_header(st_file).values(), key=lambda t: t.offset)  # the file's last tensor
    out = torch.empty(e.nbytes // e.dtype.itemsize + 600, dtype=e.dtype)  # past the file's end
    with pytest.raises(StorageError, match="m.safetensors"):
        reader.read_now(e, 0, out)


def test_malformed_files_are_refused_in_words(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(ConfigError, match="bad.safetensors is not a readable safetensors"):
        read_header(bad)
    bad.write_bytes((2).to_bytes(8, "little") + b"{!")
    with pytest.raises(ConfigError, match="not a readable"):
        read_header(bad)
    bad.write_bytes((2).to_bytes(8, "little") + b"[]")
    with pytest.raises(ConfigError, match="header is no map"):
        read_header(bad)

    def write(header: bytes, data: bytes) -> None:
        bad.write_bytes(len(header).to_bytes(8, "little") + header + data)

    # a header that gives a tensor fewer bytes than its shape needs
    write(b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}}', bytes(16))
    with pytest.raises(ConfigError, match="'w' of shape \\[4\\] in F32 needs 16 bytes"):
        read_header(bad)
    # an F32 tensor at an odd byte (no header padding): refused, not misread
    head = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    assert (8 + len(head)) % 4
    write(head, bytes(8))
    with pytest.raises(ConfigError, match="not a multiple of its element size 4"):
        read_header(bad)


def test_close_waits_for_reads_in_flight(st_file: Path) -> None:
    with AioEngine(threads=1) as engine:
        r = SourceReader(engine, chunk_bytes=4096, buffers=1)
        e = read_header(st_file)["d"]
        out = torch.empty(40000, dtype=torch.float16)
        fut = r.read(e.path, e.offset, out, e.dtype)
        closer = threading.Thread(target=r.close)
        closer.start()
        fut.result(timeout=30)  # completed, not failed by a closed descriptor
        closer.join(timeout=30)
        assert r.closed and not closer.is_alive()


def test_content_hash_is_of_the_bytes(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * 10_000_000)
    b.write_bytes(b"x" * 9_999_999 + b"y")
    seen: list[int] = []
    assert content_hash(a, seen.append) != content_hash(b)
    assert sum(seen) == 10_000_000 and len(content_hash(a)) == 32
