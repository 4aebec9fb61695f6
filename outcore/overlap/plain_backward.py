"""A backward the engine did not start, refused.

[Note: loss.backward() is refused]
A backward the engine did not start (``loss.backward()`` instead of
``engine.backward(loss)``) would reduce gradients into the shards while ``step()``,
which counts the engine's backwards, sees nothing to apply: a loop written that way
would train nothing, without a word, and a later ``engine.backward`` would add the
stale gradients to its own. Nor can it be taken as the engine's: its loss was not
scaled for fp16, and the updates that overlap backward are decided before it starts.
So the first gradient it accumulates into a parameter refuses it, or, earlier, a
checkpointed block's recomputation (whose weights would be released under it as a
forward's): the gradients and groups it left are dropped (as after a failed
``engine.backward``) and the error says what to call. ``torch.autograd.grad``
accumulates nothing and is not refused, except through a checkpointed block. While
another engine's backward runs (a GAN's generator loss through the discriminator),
gradients reaching this model are reduced as before, for its ``zero_grad()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

from outcore.errors import OutcoreError

if TYPE_CHECKING:
    from outcore.overlap.hooks import Hooks


def refuse_plain_backward(hooks: Hooks) -> NoReturn:
    """Drop what the backward left (its gradients, its groups) and refuse it (the note)."""
    for g in hooks.groups:
        for sp in g.trainable:
            sp.param.grad = None
    with hooks.mode.suspended():
        hooks.abort_backward()
    raise OutcoreError(
        "loss.backward() on a model outcore trains: call engine.backward(loss) instead "
        "(OutcoreTrainer does); it reduces the gradients into the engine's shards, scales "
        "the loss for fp16 and gradient accumulation, and gives step() the update to "
        "apply. This backward was dropped (torch.autograd.grad through a checkpointed "
        "block is refused the same way).")
