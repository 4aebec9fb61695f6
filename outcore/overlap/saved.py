"""A tensor a saved-tensor hook keeps as it is, checked at unpack as autograd checks its own.

[Note: saved-tensor hooks skip torch's version check]
When backward unpacks a tensor autograd saved itself, autograd checks that nothing changed it
in place since forward ("one of the variables needed for gradient computation has been
modified by an inplace operation"). Once a ``saved_tensors_hooks`` pair is active, what its
unpack returns is trusted instead. So every pair of ours that keeps a tensor as it is (the
engine's, around forwards that fetch parameters; activations.py's, for tensors it leaves in
memory) records the tensor's version at pack and compares it at unpack: a model changed in
place between forward and backward then fails as it does without outcore, rather than
training on gradients computed from the changed values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, final

import torch

from outcore.zero.registry import owner

if TYPE_CHECKING:
    from outcore.zero.param import ShardedParam


@final
class Kept:
    """A saved tensor left in memory, with the version it had when it was saved."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        # detached: the same storage and version counter without the grad_fn, which would
        # close a loop (output -> its grad_fn -> the saved variable -> this -> the output)
        # that autograd holds from C++, where the collector cannot see it: a graph dropped
        # without backward would never be freed
        self.tensor, self.version = tensor.detach(), tensor._version

    def get(self) -> torch.Tensor:
        """The tensor, unless it was changed in place since it was saved (torch's error)."""
        check_unchanged(self.tensor, self.version)
        return self.tensor


def check_unchanged(t: torch.Tensor, version: int) -> None:
    """Raise autograd's own error if ``t`` is past the ``version`` it was saved at."""
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: a {t.dtype} tensor of shape {list(t.shape)} saved for "
            f"backward is at version {t._version}; expected version {version} instead. Hint: "
            "clone it before changing it in place")


@final
class SavedParam:
    """A tensor autograd saved that is (a view of) a parameter's full storage."""

    __slots__ = ("tensor", "sp")

    def __init__(self, tensor: torch.Tensor, sp: ShardedParam) -> None:
        self.tensor, self.sp = tensor, sp


def pack(t: torch.Tensor) -> Kept | SavedParam:
    """What a saved-tensor hook keeps of ``t`` (see the note)."""
    sp = owner(t)
    return Kept(t) if sp is None else SavedParam(t, sp)
