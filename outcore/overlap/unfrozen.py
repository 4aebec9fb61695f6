"""A parameter frozen when the engine was made and unfrozen since is refused at backward.

[Note: a parameter unfrozen after initialize]
The optimizer's members are the parameters that require grad when the engine is made; a
frozen one gets no optimizer state, no gradient hook, and in bf16 or fp16 only its
training-dtype shard (no fp32 master). ``requires_grad_(True)`` on it later would let
autograd compute its gradient into ``p.grad``, full-size, every backward, and the step would
never use it: a gradual-unfreezing schedule would silently not train what it unfroze. So
``engine.backward`` refuses before any work (the loss and its graph are untouched, so the
call can be retried after re-freezing), naming the parameters. Freezing a trained
parameter later is fine: it gets no gradient and the update skips it, as torch's skips a
parameter whose ``grad`` is None.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from outcore.errors import OutcoreError

if TYPE_CHECKING:
    from outcore.zero.param import ShardedParam


def refuse_unfrozen(born_frozen: Iterable[ShardedParam]) -> None:
    """Refuse a backward while a parameter made frozen requires grad (see the note)."""
    late = [sp.label() for sp in born_frozen if sp.alive and sp.trainable]
    if late:
        more = f" (and {len(late) - 1} more)" if len(late) > 1 else ""
        raise OutcoreError(
            f"parameter {late[0]}{more} requires grad now, but it was frozen when "
            "outcore.initialize made the engine, which keeps no optimizer state for it: "
            "it would not train. Set requires_grad_(False) on it again (this backward did "
            "not start, so it can be retried), or unfreeze it before outcore.initialize "
            "(engine.close() hands the model back with its trained values).")
