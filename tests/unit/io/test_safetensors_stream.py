"""Streamed safetensors files (safetensors_stream.py's [Note: the safetensors layout,
exactly]): the header goes out first, the tensors follow one at a time in spec order, and the
result is a file ``safetensors`` itself loads to equal tensors, with the data 8-aligned and the
recorded size and crc32 those of the bytes on disk; the writer refuses a tensor out of order
or unlike its spec, a finish before every tensor came, and a duplicate or reserved name, and
leaves nothing under the final name when aborted. ``read_flat_range`` reads any element range
of a flat tensor cut into pieces over several files."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from outcore.io.safetensors_stream import (
    DTYPE_NAMES,
    FileInfo,
    StreamWriter,
    TensorSpec,
    file_checksum,
    header_bytes,
    pieces_overlapping,
    read_flat_range,
    write_json_durably,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "emb.weight": torch.randn(7, 5, generator=g),
        "half": torch.randn(3, 3, generator=g).half(),
        "brain": torch.randn(11, generator=g).bfloat16(),
        "double": torch.randn(2, 2, 2, generator=g).double(),
        "count": torch.tensor(41, dtype=torch.int64),
        "ids": torch.randint(-50, 50, (9,), generator=g).to(torch.int32),
        "short": torch.arange(3, dtype=torch.int16),
        "tiny": torch.arange(5, dtype=torch.int8),
        "bytes": torch.arange(6, dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "strided": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
    }


def _specs(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def _write(path: Path, tensors: dict[str, torch.Tensor],
           metadata: dict[str, str] | None = None) -> FileInfo:
    with StreamWriter(path, _specs(tensors), metadata) as w:
        for name, t in tensors.items():
            w.write(name, t)
        return w.finish()


def test_streamed_file_loads_with_safetensors_to_equal_tensors(tmp_path: Path) -> None:
    tensors = _tensors()
    path = tmp_path / "model.safetensors"
    _write(path, tensors)
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape, name
        assert torch.equal(loaded[name], t), name


def test_metadata_is_kept_as_strings(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    _write(path, {"w": torch.ones(2)}, {"format": "pt", "step": 7})  # type: ignore[dict-item]
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt", "step": "7"}


def test_the_layout_is_exactly_the_format(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(3, dtype=torch.float32), "b": torch.ones(2, dtype=torch.int64)}
    path = tmp_path / "x.safetensors"
    info = _write(path, tensors)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0  # the data starts 8-aligned
    header = json.loads(raw[8 : 8 + n])
    assert header == {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
                      "b": {"dtype": "I64", "shape": [2], "data_offsets": [12, 28]}}
    assert raw[8 + n :] == tensors["a"].numpy().tobytes() + tensors["b"].numpy().tobytes()
    assert info == FileInfo(path, len(raw), f"{zlib.crc32(raw):08x}")
    assert file_checksum(path) == (info.nbytes, info.checksum)


def test_a_streamed_file_reads_as_the_one_safetensors_writes(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(4.0), "b": torch.randn(2, 3).bfloat16()}
    theirs = tmp_path / "theirs.safetensors"
    save_file(tensors, theirs)
    ours = tmp_path / "ours.safetensors"
    _write(ours, tensors)
    a, b = load_file(ours), load_file(theirs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ours.stat().st_size == len(header_bytes(_specs(tensors))) + 16 + 12


def test_the_file_appears_under_its_name_only_when_finished(tmp_path: Path) -> None:
    path = tmp_path / "f.safetensors"
    w = StreamWriter(path, [TensorSpec("x", torch.float32, (2,))])
    assert w.tmp.exists() and not path.exists()
    w.write("x", torch.ones(2))
    assert not path.exists()
    w.finish()
    assert path.exists() and not w.tmp.exists()


def test_an_error_inside_with_removes_the_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "f.safetensors"
    path.write_bytes(b"the old file")
    with pytest.raises(KeyError), StreamWriter(path, [TensorSpec("x", torch.float32, (2,))]) as w:
        raise KeyError("boom")
    assert not w.tmp.exists()
    assert path.read_bytes() == b"the old file"  # nothing under the final name changed


def test_a_tensor_out_of_order_is_refused_by_name(tmp_path: Path) -> None:
    specs = [TensorSpec("a", torch.float32, (1,)), TensorSpec("b", torch.float32, (1,))]
    with StreamWriter(tmp_path / "f", specs) as w:
        with pytest.raises(ValueError, match="got 'b', expected 'a'"):
            w.write("b", torch.ones(1))
        w.write("a", torch.ones(1))
        w.write("b", torch.ones(1))
        with pytest.raises(ValueError, match="got 'c', expected 'nothing more'"):
            w.write("c", torch.ones(1))
        w.abort()


def test_a_tensor_unlike_its_spec_is_refused(tmp_path: Path) -> None:
    with StreamWriter(tmp_path / "f", [TensorSpec("a", torch.float32, (2, 2))]) as w:
        with pytest.raises(ValueError, match=r"a: got torch.float16 \(2, 2\), spec says "
                                             r"torch.float32 \(2, 2\)"):
            w.write("a", torch.ones(2, 2, dtype=torch.float16))
        with pytest.raises(ValueError, match=r"got torch.float32 \(4,\)"):
            w.write("a", torch.ones(4))
        w.abort()


def test_finish_before_every_tensor_is_refused(tmp_path: Path) -> None:
    specs = [TensorSpec(n, torch.float32, (1,)) for n in "abc"]
    path = tmp_path / "f"
    with StreamWriter(path, specs) as w:
        w.write("a", torch.ones(1))
        with pytest.raises(ValueError, match=r"closed before writing \['b', 'c'\]"):
            w.finish()
        w.abort()
    assert not path.exists() and not w.tmp.exists()


@pytest.mark.parametrize("names", [["a", "a"], ["__metadata__"]])
def test_duplicate_or_reserved_names_are_refused(names: list[str]) -> None:
    with pytest.raises(ValueError, match="duplicate or reserved tensor name"):
        header_bytes([TensorSpec(n, torch.float32, (1,)) for n in names])


def test_a_dtype_without_a_safetensors_name_is_refused() -> None:
    assert torch.complex64 not in DTYPE_NAMES
    with pytest.raises(ValueError, match="z: dtype torch.complex64 has no safetensors name"):
        header_bytes([TensorSpec("z", torch.complex64, (1,))])


def test_spec_nbytes() -> None:
    assert TensorSpec("a", torch.bfloat16, (3, 4)).nbytes == 24
    assert TensorSpec("s", torch.int64, ()).nbytes == 8
    assert TensorSpec("e", torch.float32, (0, 9)).nbytes == 0


def test_write_json_durably(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    write_json_durably(path, {"step": 3, "files": ["a"]})
    assert json.loads(path.read_text()) == {"step": 3, "files": ["a"]}
    assert not (tmp_path / "manifest.json.tmp").exists()


# -- reading ranges of flat tensors ------------------------------------------------------------
def test_pieces_overlapping() -> None:
    assert pieces_overlapping(10, 3, 0, 10) == range(0, 3)  # cuts of 4, 4, 2
    assert pieces_overlapping(10, 3, 4, 4) == range(1, 2)
    assert pieces_overlapping(10, 3, 3, 2) == range(0, 2)
    assert pieces_overlapping(10, 3, 5, 0) == range(0)


def test_read_flat_range_across_pieces_in_several_files(tmp_path: Path) -> None:
    flat = torch.arange(23, dtype=torch.float32)
    pieces, s = 3, 8  # cuts of 8, 8, 7 elements, stored with shapes of their own
    shapes = [(2, 4), (8,), (7, 1)]
    for k in range(pieces):
        _write(tmp_path / f"p{k}.safetensors",
               {"w": flat[k * s : (k + 1) * s].reshape(shapes[k]).clone()})
    handles = {k: safe_open(tmp_path / f"p{k}.safetensors", "pt") for k in range(pieces)}
    for a, b in [(0, 23), (3, 5), (6, 19), (16, 23), (22, 23), (9, 9)]:
        out = torch.full((b - a,), -1.0, dtype=torch.float64)
        read_flat_range(handles, pieces, "w", 23, a, b, out)
        assert torch.equal(out, flat[a:b].double()), (a, b)


def test_read_flat_range_of_a_scalar(tmp_path: Path) -> None:
    _write(tmp_path / "s.safetensors", {"s": torch.tensor(2.5)})
    out = torch.empty(1)
    read_flat_range({0: safe_open(tmp_path / "s.safetensors", "pt")}, 1, "s", 1, 0, 1, out)
    assert out.item() == 2.5
