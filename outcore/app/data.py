"""Training text for ``outcore train``: the embedded default corpus, user text, and batches.

Tokens are bytes (vocab 256): no tokenizer to download or ship, any UTF-8 text works, and the
built-in presets are sized for it.
"""

from __future__ import annotations

import codecs
import os
import sysconfig
import warnings
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import torch
import xxhash

from outcore.app import models
from outcore.errors import ConfigError, DataError

__all__ = ["DEFAULT_CORPUS_BYTES", "BatchSampler", "default_corpus", "encode", "job_tokens",
           "load_text", "load_tokens", "split_tokens"]

DEFAULT_CORPUS_BYTES = 16 << 20
"""Cap on the default corpus: ~16 MiB reads in well under a second and is far more text than
the default job's ~600k training tokens, so it never repeats."""

_SNIFF_BYTES = 64 << 10


# [Note: the default corpus]
# The job must train on every machine with no download, so it reads text that every Python
# installation has: the standard library's own .py files, from the running interpreter.
# site-packages is skipped (it differs between environments), files are read in sorted
# relative-path order and cut at a byte cap, so one interpreter always yields the same bytes.
# A short header line before each file marks the boundary, in Python syntax, so the model
# learns it as ordinary text.
def default_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> bytes:
    """The standard library's Python source, concatenated deterministically, at most max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for rel in _stdlib_sources(root):
        if len(out) >= max_bytes:
            break
        try:
            body = (root / rel).read_bytes()
        except OSError:
            continue  # an unreadable stdlib file is not the user's problem; skip it
        out += f"\n# ---- file: {rel} ----\n".encode()
        out += body
    if not out:
        raise DataError(f"no Python source files found under the standard library at {root}; "
                        "pass --data PATH")
    return bytes(out[:max_bytes])


def _stdlib_sources(root: Path) -> list[str]:
    """Relative paths of the stdlib's .py files, sorted; site-packages is pruned, not filtered,
    because it can hold hundreds of MB of third-party files that would make startup slow."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "__pycache__")]
        rel_dir = Path(dirpath).relative_to(root)
        found += [(rel_dir / f).as_posix() for f in filenames if f.endswith(".py")]
    return sorted(found)


def _check_text(path: Path) -> None:
    """Raise DataError if the file's first chunk is not UTF-8 text (NUL bytes, bad encoding)."""
    with path.open("rb") as f:
        head = f.read(_SNIFF_BYTES)
    if b"\x00" in head:
        raise DataError(f"data: {path} looks binary (contains NUL bytes); give UTF-8 text")
    try:
        # Incremental, so a multi-byte character cut at the chunk's end is not an error.
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as e:
        raise DataError(f"data: {path} is not UTF-8 text (bad byte at offset {e.start}); "
                        "give UTF-8 text") from None


Skip: TypeAlias = Path | str | None | tuple[Path | str | None, ...]  # paths left out


def _text_files(folder: Path, skip: Skip = None) -> list[Path]:
    """Regular files under folder, recursively, sorted; hidden files and folders are skipped,
    and so is each of ``skip`` (the run's own --out and --nvme-path, when inside the data
    folder: a killed run's swap file there was read as data, and refused as binary)."""
    root = folder.resolve()
    away = [Path(s).expanduser().resolve() for s in (skip if isinstance(skip, tuple) else (skip,))
            if s is not None and s != ""]
    away = [a for a in away if a != root and a.is_relative_to(root)]  # strictly inside only
    files = [p for p in folder.rglob("*")
             if p.is_file() and not any(part.startswith(".")
                                        for part in p.relative_to(folder).parts)
             and not any(p.resolve().is_relative_to(a) for a in away)]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def load_text(path: str | Path, skip: Skip = None) -> bytes:
    """The bytes of a text file, or of every text file in a folder (recursively, sorted).

    Raises DataError naming the path if it is missing, holds no text, or holds a binary file,
    so the CLI can print one line instead of training on garbage.
    """
    p = Path(path)
    if not p.exists():
        raise DataError(f"data: {p} does not exist")
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = _text_files(p, skip)
        if not files:
            raise DataError(f"data: folder {p} holds no files")
    else:
        raise DataError(f"data: {p} is neither a file nor a folder")
    parts = []
    for f in files:
        try:
            _check_text(f)
            parts.append(f.read_bytes())
        except PermissionError:
            raise DataError(f"data: {f} is not readable (permission denied)") from None
    text = b"\n".join(part for part in parts if part)
    if not text:
        what = "file" if p.is_file() else "folder"
        raise DataError(f"data: {what} {p} is empty (0 bytes of text)")
    return text


def load_tokens(path: str | Path | None = None, max_bytes: int = DEFAULT_CORPUS_BYTES,
                skip: Skip = None) -> torch.Tensor:
    """Byte-level tokens (uint8) of ``path`` (less ``skip``: load_text), or of the default
    corpus when path is None."""
    raw = default_corpus(max_bytes) if path is None else load_text(path, skip)
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())


def encode(raw: bytes, tokenizer: Any, chunk_bytes: int = 1 << 20) -> torch.Tensor:
    """Token ids (int32) of UTF-8 text under a Hugging Face tokenizer.

    The text is encoded in pieces of about ``chunk_bytes`` cut at line ends, because fast
    tokenizers warn about (and slow ones choke on) one multi-megabyte string.
    """
    text = raw.decode("utf-8", errors="replace")
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = text.find("\n", start + chunk_bytes)
        end = len(text) if end < 0 else end + 1
        ids += tokenizer(text[start:end], add_special_tokens=False)["input_ids"]
        start = end
    if not ids:
        raise DataError("data: the tokenizer produced no tokens from the text")
    return torch.tensor(ids, dtype=torch.int32)


def split_tokens(tokens: torch.Tensor,
                 val_fraction: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the last ``val_fraction`` of the stream is held out, as a contiguous tail
    so no validation window overlaps a training one."""
    n_val = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]


# [Note: batches that survive resume and a change of world size]
# Window starts for step s are drawn from a generator seeded by (seed, s) alone, so the
# sampler's whole state is the next step number: a checkpoint stores two ints, and a resumed
# run draws exactly the batches the uninterrupted run would have. Each step draws the *global*
# batch (batch x world_size rows) and rank r takes rows [r*batch, (r+1)*batch), so ranks are
# disjoint and the global batch is the same at any world size with the same global size.
class BatchSampler:
    """Deterministic random (input, target) windows for one rank of a data-parallel job."""

    def __init__(self, tokens: torch.Tensor, batch: int, seq_len: int, seed: int,
                 rank: int = 0, world_size: int = 1) -> None:
        if batch < 1 or seq_len < 1:
            raise DataError(f"batch ({batch}) and seq_len ({seq_len}) must be >= 1")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world size {world_size}")
        if len(tokens) < seq_len + 1:  # one window: seq_len inputs and its shifted targets
            raise DataError(f"data: {len(tokens)} tokens is too short for sequences of "
                            f"{seq_len}; give more text or a smaller --seq")
        self.tokens = tokens
        self.batch, self.seq_len, self.seed = batch, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self.step = 0
        self._offsets = torch.arange(seq_len + 1)
        self._tokens_digest: int | None = None  # _digest's, once

    def starts(self, step: int) -> np.ndarray:
        """Window start offsets of the whole global batch at ``step``."""
        rng = np.random.default_rng([self.seed, step])
        high = len(self.tokens) - self.seq_len - 1  # last start whose target still fits
        return rng.integers(0, high + 1, size=self.batch * self.world_size)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets), int64 ``(batch, seq_len)``; advances one step."""
        starts = self.starts(self.step)[self.rank * self.batch:(self.rank + 1) * self.batch]
        self.step += 1
        idx = torch.from_numpy(starts).unsqueeze(1) + self._offsets
        windows = self.tokens[idx].long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()

    def state_dict(self) -> dict[str, int]:
        """Plain ints, so the state fits a JSON checkpoint manifest: the step, the seed and
        what the windows are cut from (its length and digest)."""
        return {"step": self.step, "seed": self.seed, "tokens": len(self.tokens),
                "digest": self._digest()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``; the seed must match or the batches would silently differ.

        Other text than the checkpoint's (a file edited, another ``--data``, the default corpus
        of another Python) is named but taken: continuing on new text is a real use, and the
        step's windows are drawn from whatever text is given. A checkpoint from before the
        digest was kept is taken as it is."""
        if int(state["seed"]) != self.seed:
            raise DataError(f"checkpoint's data seed {state['seed']} differs from --seed "
                            f"{self.seed}; resume with the same seed")
        self.step = int(state["step"])
        if self.rank == 0 and "digest" in state and int(state["digest"]) != self._digest():
            then, now = int(state.get("tokens", -1)), len(self.tokens)
            sizes = (f"{then:,} tokens then, {now:,} now" if then != now
                     else f"{now:,} tokens, other ones")
            warnings.warn(f"the training text differs from the checkpoint's ({sizes}): the "
                          f"run continues at step {self.step} with windows from this text, "
                          "not the batches the first run would have drawn", stacklevel=2)

    def _digest(self) -> int:
        """xxh3 of the training tokens (milliseconds for the default corpus), once."""
        if self._tokens_digest is None:
            data = np.ascontiguousarray(self.tokens.numpy())
            self._tokens_digest = xxhash.xxh3_64_intdigest(data.view(np.uint8).data)
        return self._tokens_digest


# [Note: text to tokens]
# Presets are byte-level (vocab 256), so any UTF-8 text works with no tokenizer to ship. A
# Hugging Face folder that ships a tokenizer is fed through it (fine-tuning a pretrained model
# on bytes would waste its embeddings); one without a tokenizer gets bytes too, which needs a
# vocabulary of at least 256. The default corpus is cut to 4 MB for a tokenizer: it is still
# several times the tokens the default job reads, and tokenizing 16 MB on 2 cores is slow.
def job_tokens(job: dict[str, Any], vocab: int, swap: str | None = None
               ) -> tuple[torch.Tensor, str]:
    """The token stream of the job's text, and what tokenized it; its --out and swap folder
    ``swap`` are left out of a data folder that holds them."""
    skip = (job["out"], swap)
    tokenizer = models.load_hf_tokenizer(job["model"]) if models.is_hf_folder(job["model"]) \
        else None
    if tokenizer is None:
        if vocab < 256:
            raise ConfigError(f"--model: {job['model']} has a vocabulary of {vocab} and no "
                              "tokenizer; byte tokens need at least 256")
        return load_tokens(job["data"], skip=skip), "bytes"
    raw = (load_text(job["data"], skip=skip) if job["data"]
           else default_corpus(4 << 20))
    return encode(raw, tokenizer), f"{type(tokenizer).__name__} from {job['model']}"
