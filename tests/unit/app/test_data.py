"""Training data: the stdlib corpus, user text and its errors, and the batch sampler."""

from __future__ import annotations

import json

import pytest
import torch

from outcore.app.data import BatchSampler, default_corpus, load_text, load_tokens, split_tokens
from outcore.errors import DataError, OutcoreError
from tests.common import char_tokenizer as _char_tokenizer


def test_default_corpus_is_stdlib_python_deterministic_and_capped() -> None:
    a = default_corpus(max_bytes=1 << 20)
    b = default_corpus(max_bytes=1 << 20)
    assert a == b
    assert len(a) == 1 << 20  # the stdlib holds far more than 1 MiB of source
    assert a.startswith(b"\n# ---- file: ") and a.index(b".py ----") < 100  # a header first
    assert b"def " in a and b"import " in a
    assert b"site-packages" not in a[:200]


def test_default_tokens_are_bytes() -> None:
    tokens = load_tokens(None, max_bytes=1 << 16)
    assert tokens.dtype == torch.uint8 and len(tokens) == 1 << 16
    assert bytes(tokens.numpy()) == default_corpus(1 << 16)


def test_text_file_and_folder(tmp_path) -> None:
    f = tmp_path / "one.txt"
    f.write_text("héllo wörld\n")
    assert load_text(f) == "héllo wörld\n".encode()
    folder = tmp_path / "corpus"
    (folder / "b" / "c").mkdir(parents=True)
    (folder / "b" / "c" / "z.txt").write_text("third")
    (folder / "b" / "a.txt").write_text("second")
    (folder / "a.md").write_text("first")
    (folder / ".git").mkdir()
    (folder / ".git" / "objects").write_bytes(b"\x00\x01binary")  # hidden: skipped
    (folder / "empty.txt").write_text("")
    assert load_text(folder) == b"first\nsecond\nthird"
    # a run's own --out inside the data folder (``--data .``): its checkpoints and metrics are
    # not text to train on, and would change the token stream a --resume reads
    (folder / "outcore-run" / "checkpoints").mkdir(parents=True)
    (folder / "outcore-run" / "checkpoints" / "rank0.safetensors").write_bytes(b"\x00\x01")
    (folder / "outcore-run" / "metrics.jsonl").write_text('{"step": 1}')
    assert load_text(folder, skip=folder / "outcore-run") == b"first\nsecond\nthird"
    # an --out that is the data folder, or holds it, skips nothing of it
    (folder / "outcore-run" / "checkpoints" / "rank0.safetensors").unlink()
    for out in (folder, folder.parent):
        assert b"first" in load_text(folder, skip=out)


def _expect_data_error(path, match: str) -> DataError:
    with pytest.raises(DataError, match=match) as info:
        load_text(path)
    assert str(path) in str(info.value)  # the message names the path
    return info.value


def test_missing_empty_and_binary_inputs_name_the_path(tmp_path) -> None:
    _expect_data_error(tmp_path / "nope.txt", "does not exist")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _expect_data_error(empty, "empty")
    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    _expect_data_error(empty_dir, "no files")
    (empty_dir / "blank.txt").write_text("")
    _expect_data_error(empty_dir, "empty")
    nul = tmp_path / "model.bin"
    nul.write_bytes(b"abc\x00def")
    _expect_data_error(nul, "binary")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait".encode("latin-1"))
    _expect_data_error(latin1, "UTF-8")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "ok.txt").write_text("fine")
    (mixed / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    _expect_data_error(mixed / "img.png", "binary")
    err = _expect_data_error(mixed, "binary")
    assert isinstance(err, OutcoreError) and isinstance(err, ValueError)


def test_multibyte_char_cut_by_the_sniff_window_is_not_binary(tmp_path) -> None:
    f = tmp_path / "edge.txt"
    f.write_bytes(b"a" * ((64 << 10) - 1) + "é".encode() + b"tail")
    assert load_text(f).endswith(b"tail")


def test_split_holds_out_a_contiguous_tail() -> None:
    tokens = torch.arange(1000) % 256
    train, val = split_tokens(tokens, 0.01)
    assert len(train) == 990 and len(val) == 10
    assert torch.equal(torch.cat([train, val]), tokens)


def _tokens(n: int = 5000) -> torch.Tensor:
    return (torch.arange(n) % 251).to(torch.uint8)


def test_sampler_windows_are_shifted_pairs_and_deterministic() -> None:
    a = BatchSampler(_tokens(), batch=4, seq_len=16, seed=7)
    b = BatchSampler(_tokens(), batch=4, seq_len=16, seed=7)
    for _ in range(5):
        (xa, ya), (xb, yb) = a.next(), b.next()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.shape == (4, 16) and xa.dtype == torch.int64
        assert torch.equal(xa[:, 1:], ya[:, :-1])  # targets are the next tokens
    other = BatchSampler(_tokens(), batch=4, seq_len=16, seed=8)
    assert not torch.equal(other.next()[0], BatchSampler(_tokens(), 4, 16, seed=7).next()[0])


def test_ranks_take_disjoint_rows_of_the_global_batch() -> None:
    whole = BatchSampler(_tokens(), batch=6, seq_len=8, seed=3)
    ranks = [BatchSampler(_tokens(), batch=2, seq_len=8, seed=3, rank=r, world_size=3)
             for r in range(3)]
    for _ in range(4):
        x_whole, _ = whole.next()
        parts = [s.next()[0] for s in ranks]
        assert torch.equal(torch.cat(parts), x_whole)
    starts = ranks[0].starts(0)
    assert len(starts) == 6


def test_sampler_state_round_trip_resumes_the_same_batches() -> None:
    uninterrupted = BatchSampler(_tokens(), batch=3, seq_len=10, seed=11)
    expected = [uninterrupted.next()[0] for _ in range(8)]
    first = BatchSampler(_tokens(), batch=3, seq_len=10, seed=11)
    for _ in range(5):
        first.next()
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON manifest
    resumed = BatchSampler(_tokens(), batch=3, seq_len=10, seed=11)
    resumed.load_state_dict(state)
    for i in range(5, 8):
        assert torch.equal(resumed.next()[0], expected[i])
    with pytest.raises(DataError, match="seed"):
        BatchSampler(_tokens(), batch=3, seq_len=10, seed=12).load_state_dict(state)


def test_sampler_names_other_text_than_the_checkpoints(recwarn: pytest.WarningsRecorder) -> None:
    """A resume over edited text took the step and drew windows from the new text with no
    word: the run was no longer the one it continued. It is named and taken (continuing on
    new text is a real use); the same text, and a state from before the digest, pass."""
    first = BatchSampler(_tokens(), batch=3, seq_len=10, seed=11)
    first.next()
    state = json.loads(json.dumps(first.state_dict()))
    BatchSampler(_tokens(), batch=3, seq_len=10, seed=11).load_state_dict(state)
    BatchSampler(_tokens(4000), 3, 10, seed=11).load_state_dict({"step": 1, "seed": 11})
    assert not recwarn.list
    longer = BatchSampler(_tokens(6000), batch=3, seq_len=10, seed=11)
    with pytest.warns(UserWarning, match=r"differs from the checkpoint's \(5,000 tokens then, "
                                         r"6,000 now\): the run continues at step 1"):
        longer.load_state_dict(state)
    assert longer.step == 1
    edited = _tokens()
    edited[100] += 1
    with pytest.warns(UserWarning, match=r"\(5,000 tokens, other ones\)"):
        BatchSampler(edited, batch=3, seq_len=10, seed=11).load_state_dict(state)
    other_rank = BatchSampler(edited, batch=3, seq_len=10, seed=11, rank=1, world_size=2)
    other_rank.load_state_dict(state)  # rank 0 says it once for the job
    assert not recwarn.list


def test_sampler_rejects_bad_shapes() -> None:
    with pytest.raises(DataError, match="too short"):
        BatchSampler(_tokens(20), batch=1, seq_len=32, seed=0)
    with pytest.raises(DataError, match="rank"):
        BatchSampler(_tokens(), batch=1, seq_len=8, seed=0, rank=2, world_size=2)
    sampler = BatchSampler(_tokens(12), batch=64, seq_len=10, seed=0)
    x, y = sampler.next()  # every window fits, even at the very end of the stream
    assert x.shape == y.shape == (64, 10)




def test_encode_with_a_tokenizer_in_line_aligned_chunks(tmp_path) -> None:
    from outcore.app.data import encode

    tokenizer = _char_tokenizer(tmp_path / "tok")
    text = "ab c\n" * 50
    ids = encode(text.encode(), tokenizer, chunk_bytes=7)  # many chunks, cut at line ends
    assert ids.dtype == torch.int32
    assert ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_runs_swap_folder_inside_the_data_folder_is_not_data(tmp_path) -> None:
    """A killed run's swap file under ``--nvme-path`` inside ``--data`` was read as data and
    refused as binary, and every later run with it; found by a probe."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("text")
    swap = folder / "swap" / "outcore-1-deadbeef"
    swap.mkdir(parents=True)
    (swap / "rank0.swap").write_bytes(b"\0" * 4096)
    with pytest.raises(DataError, match="looks binary"):
        load_text(folder)
    assert load_text(folder, skip=(folder / "run", str(folder / "swap"))) == b"text"
