"""The named states of a parameter and of its group, and the moves allowed between them
(zero/state.py's [Note: one state, one owner]): ``PARAM_MOVES`` and ``GROUP_MOVES`` hold
exactly the moves docs/design.md draws, and the one owner of each state
(``ShardedParam._move``, ``GatherGroup._move``) makes every allowed move and asserts on any
other, naming the parameter or group and the move, with the state left as it was."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from torch import nn

import outcore
from outcore.runtime.context import Runtime
from outcore.zero.group import GatherGroup
from outcore.zero.param import ShardedParam
from outcore.zero.registry import register, unregister
from outcore.zero.state import (
    GROUP_MOVES,
    HAS_VALUES,
    PARAM_MOVES,
    USER_OWNED,
    GroupState,
    ParamState,
)

P, G = ParamState, GroupState

# the edges of docs/design.md's "Parameter states" diagram
DOCUMENTED_PARAM_MOVES = {
    (P.SHARDED, P.BUILDING), (P.BUILDING, P.SHARDED),
    (P.SHARDED, P.FETCHING), (P.FETCHING, P.GATHERED),
    (P.SHARDED, P.GATHERED), (P.GATHERED, P.SHARDED),
    (P.FETCHING, P.SHARDED),
    (P.SHARDED, P.SHOWN), (P.SHOWN, P.SHARDED),
    (P.SHARDED, P.HANDED_BACK), (P.SHARDED, P.DROPPED), (P.DROPPED, P.HANDED_BACK),
}
# zero/state.py's comments on GROUP_MOVES (design.md's SHARDED -> UNSHARDED edge is
# wait_unshard() running unshard() first: two moves, tested in test_group.py)
DOCUMENTED_GROUP_MOVES = {
    (G.SHARDED, G.FETCHING), (G.FETCHING, G.UNSHARDED),
    (G.FETCHING, G.SHARDED), (G.UNSHARDED, G.SHARDED),
}


def test_param_moves_are_exactly_the_documented_ones() -> None:
    assert set(PARAM_MOVES) == set(ParamState), "every state has its row"
    allowed = {(a, b) for a, tos in PARAM_MOVES.items() for b in tos}
    assert allowed == DOCUMENTED_PARAM_MOVES
    assert PARAM_MOVES[P.HANDED_BACK] == frozenset(), "a handed-back parameter is plain again"
    assert all(a is not b for a, b in allowed), "no move to the same state"


def test_group_moves_are_exactly_the_documented_ones() -> None:
    assert GROUP_MOVES == DOCUMENTED_GROUP_MOVES
    assert (G.SHARDED, G.UNSHARDED) not in GROUP_MOVES


def test_states_with_values_and_those_the_user_owns() -> None:
    assert {P.GATHERED, P.SHOWN, P.BUILDING} == HAS_VALUES
    assert {P.SHOWN, P.BUILDING} == USER_OWNED
    assert USER_OWNED <= HAS_VALUES


def test_states_are_strings_by_their_value() -> None:
    assert P("sharded") is P.SHARDED and G("unsharded") is G.UNSHARDED
    assert P.HANDED_BACK == "handed_back" and G.FETCHING.value == "fetching"


@pytest.fixture
def rt() -> Runtime:
    return Runtime(outcore.Config.from_dict(
        {"dtype": "fp32", "offload": {"params": "cpu", "optimizer": "cpu"}}))


def _every_move(owner: Any, states: Iterable[Any], documented: set[Any] | frozenset[Any],
                label: str) -> None:
    """Try every (from, to) pair on ``owner._move``: the documented ones move, the others
    raise an AssertionError naming ``label`` and the move, and leave the state."""
    for a, b in itertools.product(states, repeat=2):
        owner.state = a
        if (a, b) in documented:
            owner._move(b)
            assert owner.state is b
        else:
            with pytest.raises(AssertionError, match=f"{label}: {a.value} -> {b.value}$"):
                owner._move(b)
            assert owner.state is a, "a refused move leaves the state"


def test_a_parameter_makes_every_allowed_move_and_asserts_on_the_others(rt: Runtime) -> None:
    param = nn.Parameter(torch.ones(3, 2))
    sp = ShardedParam(param, rt)
    sp.name = "w"
    register(param, sp)
    assert sp.state is P.SHARDED
    _every_move(sp, ParamState, DOCUMENTED_PARAM_MOVES, "parameter w")
    sp.state = P.SHARDED
    unregister(param)


def test_an_unnamed_parameter_is_named_by_its_shape_in_the_assertion(rt: Runtime) -> None:
    sp = ShardedParam(nn.Parameter(torch.ones(3, 2)), rt)
    with pytest.raises(AssertionError, match=r"parameter of shape \[3, 2\]: sharded -> sharded"):
        sp._move(P.SHARDED)


def test_a_group_makes_every_allowed_move_and_asserts_on_the_others(rt: Runtime) -> None:
    param = nn.Parameter(torch.ones(4))
    sp = ShardedParam(param, rt)
    register(param, sp)
    sp.prepare_for_training()
    group = GatherGroup(0, "block.fc", [sp], rt, persistence_threshold_bytes=0)
    assert group.state is G.SHARDED and sp.group is group
    _every_move(group, GroupState, DOCUMENTED_GROUP_MOVES, "group block.fc")
    group.state = G.SHARDED
    unregister(param)
