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
form, ``torch._disable_dynamo`` (what torch's optimizers use), imports it at the hook's first
call instead, which still cost every run that never compiles: 72 MB of resident memory
(``import torch`` 224 MB, with dynamo 296 MB, measured 2026-11-28) and the import's second at
the first forward; the default ``outcore train`` peaked at 685 MiB against 618 before. So a
hook goes through the disabled form only once dynamo has been imported (by
``torch.compile``, or anything else): before that nothing can be compiling, and the hook is
called as it is.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["uncompiled"]

_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def uncompiled(hook: _Hook) -> _Hook:
    """``hook``, run outside any graph ``torch.compile`` makes (see the note)."""
    disabled = torch._disable_dynamo(hook)  # type: ignore[attr-defined]
    modules = sys.modules

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" in modules:
            return disabled(*args, **kwargs)
        return hook(*args, **kwargs)

    return cast(_Hook, run)
