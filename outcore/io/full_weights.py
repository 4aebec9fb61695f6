"""``outcore consolidate``: one safetensors file of full weights from a sharded checkpoint.

The file is assembled one parameter at a time from the rank files' valid pieces (see
checkpoint.py's note on valid-only shards), so it never holds more than the largest
parameter, and it is written atomically by the streaming writer. No pickle is involved.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from outcore.errors import ConfigError, StorageError
from outcore.io import base_record
from outcore.io import safetensors_stream as sts
from outcore.io.manifest import check_file, rank_file, read_manifest
from outcore.io.publish import MANIFEST, OWN_FILES, file_above
from outcore.io.safetensors_stream import StreamWriter, TensorSpec
from outcore.offload.aio import AioEngine
from outcore.offload.source_file import SourceReader, TensorEntry


def consolidate(ckpt: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the checkpoint's full weights to one safetensors file; return its path.

    Parameters come out in fp32 (the master values; frozen parameters' values upcast), every
    name of a tied parameter as its own copy, and the persistent buffers, so that
    ``model.load_state_dict(safetensors.torch.load_file(out))`` works with ``strict=True``.
    The file is assembled one parameter at a time (memory: the largest parameter) and written
    atomically. ``out`` is the file where it names an existing file or ends in
    ``.safetensors``; anything else is a folder, made if missing, which gets
    ``model.safetensors`` (a new name like ``final`` is a folder: written as a file, the
    ``config.json`` beside it would land in its parent, and ``from_pretrained`` fail).

    Hugging Face models: if the trainer copied the model's ``config.json`` into the checkpoint
    folder, it is copied next to ``out`` (unless a different one is already there, which is
    kept), so ``from_pretrained(out.parent)`` loads the result.
    """
    folder, named = Path(ckpt).expanduser(), os.path.expanduser(os.fspath(out))  # ~ as a shell
    out = Path(named)
    if out.is_dir() or named.endswith(os.sep) or not (
            out.is_file() or out.suffix == ".safetensors"):
        out = out / "model.safetensors"
    if OWN_FILES.match(out.name) and (out.resolve().parent == folder.resolve()
                                      or (out.parent / MANIFEST).is_file()):
        raise ConfigError(f"consolidate: {out} is one of the files of the checkpoint in "
                          f"{out.parent}; write the weights under another name or outside it")
    man = read_manifest(folder)
    old = man["world_size"]
    for r in range(old):
        check_file(folder, man, rank_file(r, old))
    base = _base_tensors(man, folder)
    if base is not None and out.resolve() in {t.path.resolve() for t in base.values()}:
        raise ConfigError(f"consolidate: {out} is the frozen base this checkpoint's run reads "
                          "in place (its checkpoints need it as it is); write the weights "
                          "elsewhere")
    if (above := file_above(out)) is not None:
        raise StorageError(f"consolidate: cannot write {out}: {above} is a file, not a folder")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _write(folder, out, man, old, base)
    except OSError as e:  # where it cannot write: a read-only place, a parent that is a file
        if isinstance(e, StorageError):
            raise
        raise StorageError(f"consolidate: cannot write {out}: {e.strerror or e}") from None
    _copy_hf_config(folder, out.parent)
    sts.fsync_dir(out.parent)
    return out


def _write(folder: Path, out: Path, man: dict, old: int,
           base: dict[str, TensorEntry] | None) -> None:
    """Stream the full weights into ``out`` (its temporary file goes on a failure); ``base``:
    the frozen base's tensors where the checkpoint names its base instead of storing it."""
    reader = None if base is None else SourceReader(AioEngine(threads=4))
    with contextlib.ExitStack() as stack:
        handles = {r: stack.enter_context(safe_open(folder / rank_file(r, old), "pt"))
                   for r in range(old)}
        if reader is not None:
            stack.callback(reader.engine.close)
            stack.callback(reader.close)
        specs = [TensorSpec(n, torch.float32, tuple(e["shape"]))
                 for canon, e in man["params"].items() for n in (canon, *e["aliases"])]
        buf_dtypes = {}
        for name in man["buffers"]:
            dtype = sts.DTYPES_BY_NAME[handles[0].get_slice(f"__buffer__::{name}").get_dtype()]
            buf_dtypes[name] = torch.float32 if dtype.is_floating_point else dtype
            shape = handles[0].get_slice(f"__buffer__::{name}").get_shape()
            specs.append(TensorSpec(name, buf_dtypes[name], tuple(shape)))
        with StreamWriter(out, specs, {"format": "pt"}) as w:
            for canon, e in man["params"].items():
                n, kind = e["numel"], "master" if e["trainable"] else "values"
                full = torch.empty(n, dtype=torch.float32)
                if "base" in e and base is not None and reader is not None:  # read from its file
                    reader.read_now(base[e["base"]], 0, full)
                else:
                    sts.read_flat_range(handles, old, f"{canon}::{kind}", n, 0, n, full)
                for name in (canon, *e["aliases"]):
                    w.write(name, full.view(e["shape"]))
                del full
            for name, dtype in buf_dtypes.items():
                w.write(name, handles[0].get_tensor(f"__buffer__::{name}").to(dtype))
            w.finish()


def _base_tensors(man: dict, folder: Path) -> dict[str, TensorEntry] | None:
    """The base's tensors, where the checkpoint names its base instead of storing it
    (base_record.py's note); the base must be the one it trained over."""
    if not man.get("base"):
        return None
    tensors = base_record.named_tensors(man["base"], f"{folder} holds no copy of its frozen base")
    base_record.check(man["base"], sorted({t.path for t in tensors.values()}), folder)
    return tensors


def _copy_hf_config(folder: Path, dest: Path) -> None:
    src, dst = folder / "config.json", dest / "config.json"
    if not src.is_file() or src.resolve() == dst.resolve():
        return
    if dst.exists():
        if dst.read_bytes() != src.read_bytes():
            warnings.warn(f"kept the existing {dst}; it differs from {src}", stacklevel=3)
        return
    tmp = dst.with_name(f"config.json.tmp-{secrets.token_hex(4)}")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
