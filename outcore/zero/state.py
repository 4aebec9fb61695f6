"""The named states of a parameter and of its group, and the moves allowed between them.

[Note: one state, one owner]
A parameter under outcore is in exactly one ``ParamState`` at a time, and only its
``ShardedParam`` moves it (``ShardedParam._move``), asserting that the move is in
``PARAM_MOVES``. What a user's call on the parameter means follows from the state alone
(surface.py), so there are no flags to keep in step. The group a parameter is gathered with
has its own ``GroupState`` (below), moved only by ``GatherGroup._move`` within
``GROUP_MOVES``; the group drives its parameters' GATHERED and SHARDED moves. Whether the
engine is computing is the runtime's ``Phase`` (runtime/phase.py), moved only by the hooks
(overlap/hooks.py), as FSDP2 keeps ``TrainingState`` apart from ``ShardedState``.
"""

from __future__ import annotations

from enum import Enum


class ParamState(str, Enum):
    """Where a parameter's values are, and what ``param.data`` shows."""

    SHARDED = "sharded"  # only the shards hold values; .data is a zero-byte placeholder
    FETCHING = "fetching"  # .data has storage; reads of the shards are landing in it
    GATHERED = "gathered"  # .data holds the full values in the compute dtype
    SHOWN = "shown"  # gathered_parameters: .data is the user's full fp32 copy
    BUILDING = "building"  # outcore.init opened it for construction code
    DROPPED = "dropped"  # its engine closed without keeping values; shards are gone
    HANDED_BACK = "handed_back"  # a plain parameter again, holding its values


PARAM_MOVES: dict[ParamState, frozenset[ParamState]] = {
    ParamState.SHARDED: frozenset({ParamState.FETCHING, ParamState.GATHERED, ParamState.SHOWN,
                                   ParamState.BUILDING, ParamState.DROPPED,
                                   ParamState.HANDED_BACK}),
    ParamState.FETCHING: frozenset({ParamState.GATHERED, ParamState.SHARDED}),
    ParamState.GATHERED: frozenset({ParamState.SHARDED}),
    ParamState.SHOWN: frozenset({ParamState.SHARDED}),
    ParamState.BUILDING: frozenset({ParamState.SHARDED}),
    ParamState.DROPPED: frozenset({ParamState.HANDED_BACK}),
    ParamState.HANDED_BACK: frozenset(),
}

HAS_VALUES = frozenset({ParamState.GATHERED, ParamState.SHOWN, ParamState.BUILDING})
"""States in which ``param.data`` holds the parameter's current values."""

USER_OWNED = frozenset({ParamState.SHOWN, ParamState.BUILDING})
"""States in which ``param.data`` is written back to the shards when the state ends, so user
code may read and write it directly."""


class GroupState(str, Enum):
    """Where a group's parameters are (group.py's [Note: group states and moves])."""

    SHARDED = "sharded"  # only shards exist
    FETCHING = "fetching"  # shard reads issued, not yet gathered
    UNSHARDED = "unsharded"  # every fetched parameter shows its full tensor


GROUP_MOVES: frozenset[tuple[GroupState, GroupState]] = frozenset({
    (GroupState.SHARDED, GroupState.FETCHING),  # unshard(): reads issued
    (GroupState.FETCHING, GroupState.UNSHARDED),  # wait_unshard(): gathered and shown
    (GroupState.FETCHING, GroupState.SHARDED),  # reshard() of a prefetch never used
    (GroupState.UNSHARDED, GroupState.SHARDED),  # reshard(), hide_resident()
})
"""The moves ``GatherGroup._move`` allows; anything else is a bug in outcore, asserted."""
