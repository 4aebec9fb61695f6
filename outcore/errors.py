"""Errors a user can act on.

[Note: user errors versus bugs]
Anything raised as an ``OutcoreError`` is a problem with the user's input or machine (a bad
config key, a missing folder, a full disk). Its message names the key, path or value and what
would be accepted, so the CLI prints it as one line with no traceback. Every other exception
is a bug in outcore or torch and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import resource
import sys

import torch


class OutcoreError(Exception):
    """Base class for errors caused by input or environment, not by outcore itself."""


class ConfigError(OutcoreError, ValueError):
    """A config key or command-line option has a value outcore cannot use."""


class DataError(OutcoreError, ValueError):
    """Training data is missing, empty, or not text."""


class StorageError(OutcoreError, OSError):
    """A swap or checkpoint path cannot be used: missing, read-only, full, or corrupt."""


class CorruptCheckpointError(StorageError):
    """A checkpoint's file does not match its manifest: missing, cut short, or its bytes
    changed since the save (a disk's bit flip, a copy gone wrong)."""


class FolderInUseError(StorageError):
    """Another live run holds the folder (``--out``, a checkpoint root): guard/lock.py."""


class CommError(OutcoreError, RuntimeError):
    """A collective failed: another rank died, or did not answer within ``comm.timeout_s``."""


class ParamAccessError(OutcoreError, RuntimeError):
    """User code touched a sharded parameter in a way its state cannot honour (a read at
    W > 1 outside ``gathered_parameters``, a write inside the forward, a value dropped at
    ``close()``); the message names the parameter and what to do instead
    (zero/surface.py's [Note: a sharded parameter answers every call])."""


class EngineClosedError(OutcoreError, RuntimeError):
    """The engine was closed, or handed its model to a newer engine; use the new one."""


class GradReadWarning(UserWarning):
    """Code read ``p.grad`` of a parameter outcore shards between a backward and ``step()``,
    where torch would show a gradient and outcore shows None (zero/surface.py's [Note: p.grad
    stays None, and says so])."""


def _package_dir(name: str) -> str | None:
    """Where package ``name`` lives, found without importing it; None if absent."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return None if spec is None or not spec.origin else os.path.dirname(spec.origin)


# outcore's, torch's and accelerate's (whose helpers a loop calls in place of torch's:
# accelerator.clip_grad_norm_), and contextlib's, through which outcore's own context
# managers (the engine's backward) run
_SKIPPED = tuple(os.path.abspath(d) + os.sep for d in (
    os.path.dirname(__file__), os.path.dirname(torch.__file__), _package_dir("accelerate"))
    if d is not None) + (os.path.abspath(contextlib.__file__),)


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised by this function's caller at the first
    frame outside outcore, torch and accelerate: the user's line, however deep the call came
    through (``outcore.initialize``, ``torch.nn.utils.clip_grad_norm_``, a tensor property)."""
    frame, level = sys._getframe(1), 1  # the caller's frame is level 1 for its warnings.warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_SKIPPED):
        frame, level = frame.f_back, level + 1
    return level


_LIMITS = {errno.EFBIG: ("RLIMIT_FSIZE", "the file-size limit (ulimit -f)"),
           errno.EMFILE: ("RLIMIT_NOFILE", "the open-file limit (ulimit -n)"),
           errno.ENOMEM: ("RLIMIT_AS", "the address-space limit (ulimit -v)")}


def limit_hint(e: BaseException) -> str:
    """For an error a process limit may have caused (a file too large, too many open files,
    no memory), the limit and its value, as ``"; the file-size limit (ulimit -f) is 9.8
    MiB"``; else ``""``. A full disk and a process limit can read alike in ``strerror``
    alone ("File too large"); this tells the user which one it was."""
    code = errno.ENOMEM if isinstance(e, MemoryError) else getattr(e, "errno", None)
    if code not in _LIMITS:
        return ""
    name, what = _LIMITS[code]
    soft = resource.getrlimit(getattr(resource, name))[0]
    if soft == resource.RLIM_INFINITY:
        return ""
    value = str(soft) if code == errno.EMFILE else (
        f"{soft / 2**30:.2f} GiB" if soft >= 2**30 else f"{soft / 2**20:.1f} MiB")
    return f"; {what} is {value}"


def out_of_memory(e: BaseException) -> str | None:
    """The one line the CLI prints for memory that ran out (a ``MemoryError``, an ``OSError``
    ENOMEM from a mapping, torch's allocator refusing), naming the limit that refused it;
    None for any other error, which keeps its traceback."""
    text = " ".join(str(e).split())
    if isinstance(e, torch.OutOfMemoryError):
        return (f"out of device memory: {'. '.join(text.split('. ')[:2])}; use a smaller batch, or "
                "offload more (offload.params / offload.optimizer: cpu or nvme)")
    if not (isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno == errno.ENOMEM)
            or (isinstance(e, RuntimeError) and "can't allocate memory" in text)):
        return None
    hint = limit_hint(MemoryError())
    return (f"out of memory: {text or type(e).__name__}{hint or '; the host ran out'}; "
            + ("raise the limit, or " if hint else "")
            + "use a smaller batch or offload.host_buffer_bytes")
