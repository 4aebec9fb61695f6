"""Tentative updates: the optimizer's side of a speculative step.

[Note: a speculative step]
Clipping needs the norm of every gradient before any update, and fp16's loss scaling needs
to know that no gradient overflowed anywhere, so without speculation the whole optimizer
pass, and with the state on NVMe all of its reads and writes, waits for backward to end.
Speculating, as SuperOffload does (DeepSpeed, ASPLOS 2026), each update starts during
backward as if the norm will need no clipping and nothing overflowed, and writes its
masters, moments and training copy aside (storage.py's [Note: tentative writes]), keeping
its gradients (an fp16 one is unscaled into the slot's buffer, not in place: staging.py's
[Note: the gradient an update reads]). ``step()`` then has the norm and the overflow check:
if neither objects the tentative values are exactly what the step would have computed (the
same kernel on the same gradients), so they are kept, and the step counts advance. If the
norm clips they are dropped, and the step updates every parameter from the untouched state
with clipped gradients, as without speculation; if a gradient overflowed they are dropped
and the step is skipped (precision.py's [Note: skip, then shrink]). A rollback costs the
tentative pass's disk traffic, spent while backward ran; since a clipped step tends to
follow a clipped one (early training, or fp16's scale settling), speculation runs only
after a step whose updates would have been kept: not in the first step, and not after a
clipped or skipped one until a step fits again. Until ``step()`` the stored values are the
old ones, so a ``zero_grad()`` in between takes the updates back, as torch's contract has
it, and so does a write of values (the updates were computed from the values it replaces).
The second extent per shard doubles the state's space on NVMe, reserved at the first
speculative backward (a run whose steps never fit never reserves it); where that would take
more than half of the disk's free space (checkpoints and other runs need some), or the disk
refuses it, the run goes on without speculating.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from outcore.errors import StorageError
from outcore.offload.storage import StoredShard, load_now
from outcore.offload.tier import Tier
from outcore.units import format_bytes
from outcore.zero.param import ShardedParam

log = logging.getLogger("outcore")


@dataclass(eq=False)
class ParamState:
    """What the optimizer keeps for one parameter shard, as ``torch.optim`` keeps it in
    ``optimizer.state[p]``: its step count and moment tensors (each in the state tier), plus
    the round (optimizer step) that last updated it, so no shard is updated twice a step."""

    moments: dict[str, StoredShard]
    step: int = 0
    round: int = -1
    tentative: bool = False  # this round's update was written aside (the note above)

    def free(self) -> None:
        for stored in self.moments.values():
            stored.free()
        self.moments = {}


def written(sp: ShardedParam, state: ParamState) -> list[StoredShard]:
    """The shards an update of ``sp`` writes: its master, moments and training copy (those
    it still has: a closed model's are gone)."""
    shards = [sp.master_shard, *state.moments.values(), sp.compute_shard]
    return [stored for stored in shards if stored is not None]


def release_asides(params: Iterable[ShardedParam], state: dict[ShardedParam, ParamState]) -> None:
    """Give back the room for tentative writes: at close, or once nothing speculates any more
    in this run (optim/hyperparams.py: hyper-parameters that move after backward)."""
    for sp in params:
        for stored in written(sp, state[sp]):
            stored.release_aside()


def reserve_asides(shards: list[StoredShard], disk_free: int) -> bool:
    """Room for every tentative write of ``shards``, made at once; False (speculation off
    for the run, with a warning) where it would take more than half of the ``disk_free``
    bytes, which checkpoints and other runs may need, or the disk refuses it."""
    unique = list({id(stored): stored for stored in shards}.values())  # fp32: copy is master
    need = sum(stored.nbytes for stored in unique if stored.tier is Tier.NVME)
    if need > disk_free // 2:
        why = f"it needs {format_bytes(need)}, more than half of the {format_bytes(disk_free)} free"
    else:
        try:
            for stored in unique:
                stored.reserve_aside()
            return True
        except StorageError as e:
            for stored in unique:  # what was reserved before the refusal
                stored.release_aside()
            why = str(e)
    log.warning("outcore: the speculative step is off for this run: the room for tentative "
                "updates did not fit on disk (%s); updates wait for step() "
                "(zero.speculative_step: false says so up front)", why)
    return False


def keep_tentative(states: dict[ShardedParam, ParamState]) -> int:
    """Make every tentative update the stored value, count its step and free the gradient
    it kept; returns how many parameters it kept."""
    kept = 0
    for sp, state in states.items():
        if state.tentative:
            for stored in written(sp, state):
                stored.keep_aside()
            state.step += 1
            state.tentative = False
            sp.drop_grad()
            kept += 1
    return kept


def take_back(states: dict[ShardedParam, ParamState],
              restore_copies: bool) -> list[ShardedParam]:
    """Forget every tentative update; with ``restore_copies`` cast the training copies in
    memory, which a tentative update overwrites, from the masters again. Returns the
    parameters it took back."""
    taken = []
    for sp, state in states.items():
        if not state.tentative:
            continue
        for stored in written(sp, state):
            stored.drop_aside()
        state.round, state.tentative = -1, False
        copy, master = sp.compute_shard, sp.master_shard
        assert copy is not None and master is not None  # trainable
        resident = copy.resident()
        if restore_copies and resident is not None and copy is not master:
            resident.copy_(load_now(master, resident.device))
        taken.append(sp)
    return taken
