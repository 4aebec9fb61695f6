"""The training phase: what the engine is doing with the model right now.

The runtime holds it (``Runtime.phase``) so that every part can read it; only the hooks
(overlap/hooks.py, ``_sync_phase``) move it, from the frames of running modules and whether a
backward is running (zero/state.py's [Note: one state, one owner]).
"""

from __future__ import annotations

from enum import Enum


class Phase(str, Enum):
    """What the engine is doing with the model (the hooks move it)."""

    IDLE = "idle"  # between calls: user code may read and write parameters
    FORWARD = "forward"  # inside a forward (the engine's, model(...), generate's steps)
    BACKWARD = "backward"  # inside engine.backward (recomputations included)
