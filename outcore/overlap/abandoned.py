"""A forward left by an exception that torch's hooks do not see.

[Note: a forward left without its post hooks]
Every forward outcore opens is closed by forward hooks registered with ``always_call=True``
(hooks.py's frames, entry.py's context). torch runs those for an ``Exception`` only: a
``KeyboardInterrupt`` (or any ``BaseException`` that is not an ``Exception``) raised inside
the forward leaves the module call without them. A loop that catches Ctrl-C to evaluate or
save and then goes on (a common pattern) then used an engine that still believed itself
inside that forward: writes between steps were refused as writes inside the forward, the
access mode stayed on torch's mode stack, and ``close()`` failed to reshard its groups and
left parameters on freed memory, so a later ``model.state_dict()`` crashed the process.

So the outermost module call of each forward is remembered by its frame of torch's
``Module._call_impl``, and the next thing that asks whether a forward is running (a module
call, a write of a parameter, ``close()``) checks that this frame is still on the stack. If
it is not, the forward was left: its frames are released and the engine is between steps
again, as after a forward that raised an ``Exception``. The forward's context (the access
mode on torch's stack, the saved-tensor hooks) cannot be exited from inside a torch call,
where a write finds it, so the mode passes every call through until the next call of the
model or ``close()`` exits it (entry.py's ``abandon``). Inside a forward the check walks
only from the asking call up to the outermost one.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING

from torch import nn

from outcore.runtime.phase import Phase

if TYPE_CHECKING:
    from outcore.overlap.hooks import Hooks

_CALL = nn.Module._call_impl.__code__


class OuterCall:
    """The frame of torch's module call that opened the forward now running (if any)."""

    def __init__(self) -> None:
        self.frame: FrameType | None = None
        self.thread = 0

    def note(self) -> None:
        """Remember the nearest module call on the stack as the forward's outermost."""
        f = sys._getframe(1)
        while f is not None and f.f_code is not _CALL:
            f = f.f_back  # type: ignore[assignment]
        self.frame, self.thread = f, threading.get_ident()

    def clear(self) -> None:
        self.frame = None  # (a frame keeps its locals, the call's inputs, alive)

    def running(self) -> bool:
        """Whether the remembered call is still on its thread's stack (True if none is, or
        if the asking thread is another: its stack says nothing of that one's)."""
        if self.frame is None or threading.get_ident() != self.thread:
            return True
        f: FrameType | None = sys._getframe(1)
        while f is not None:
            if f is self.frame:
                return True
            f = f.f_back
        return False


def drop(hooks: Hooks) -> bool:
    """Close a forward that was left without its post hooks (see the note); True if one was."""
    if hooks.rt.phase is not Phase.FORWARD or hooks.outer.running():
        return False
    hooks.outer.clear()
    hooks.release_frames()  # the access mode, on torch's stack still, passes calls through
    return True  # until the next entry or close() exits the context (entry.py's abandon)
