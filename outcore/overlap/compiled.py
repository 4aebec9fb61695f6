"""outcore's module hooks and ``torch.compile``.

[Note: hooks run outside a compiled graph]
``torch.compile(model)`` traces a module's hooks with it. Dynamo would guard on state that
outcore's fetch and release hooks change on every call (the swap's finalizers, the
schedule) and fail the guard on the very frame that made it ("Guard failed on the same frame
it was created"), so the hooks are left out of the graph: it breaks at each module whose
parameters outcore fetches, and the layers between run compiled. The hook methods are
decorated, not wrapped at registration: a hook must stay a bound method of its owner, so that
a deep copy of the model gets the owner's inert copy (hooks.py's ``inert_copy``).
``torch.compiler.disable`` imports dynamo when it decorates, which took ``import outcore``
from about 1.6 to 2.9 s (every CLI command and torchrun worker pays it); torch's own lazy
form, ``torch._disable_dynamo`` (what torch's optimizers use), imports it at the first call
of the hook and keeps the disabled function from then on. That import still costs a run
that never compiles 72 MB of resident memory (``import torch`` peaks at 224 MB, with dynamo
at 296 MB; the default ``outcore train`` at 685 MiB against 618 MiB without the guard,
2026-11-28), though not a Hugging Face model's run, whose ``transformers`` imports dynamo
anyway. Calling the disabled form only once dynamo is in ``sys.modules`` was tried and
dropped: the deciding wrapper is outcore code, which dynamo then compiles as a frame of its
own, recompiling it up to its limit (8, with a warning) and adding graph breaks (37 to 45 on
a 4-layer Llama). torch's wrapper lives in a file dynamo skips; ours cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["uncompiled"]

_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def uncompiled(hook: _Hook) -> _Hook:
    """``hook``, run outside any graph ``torch.compile`` makes (see the note)."""
    return cast(_Hook, torch._disable_dynamo(hook))  # type: ignore[attr-defined]
