"""What ``client_state`` stores (io/client_state.py): JSON, and the values JSON would change
on the way, tagged and made again equal (tuples, dicts with keys that are not strings, a
``Counter`` or ``OrderedDict``, small tensors, NumPy scalars); what has no faithful form is
refused naming where it is, before any folder is made."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import outcore
from outcore.io.client_state import MAX_TENSOR_ELEMENTS, check_client_state, decode


def _round_trip(value: dict) -> dict:
    return decode(json.loads(json.dumps(check_client_state(value))))


def test_values_json_would_change_come_back_equal_and_of_their_type() -> None:
    value = {"milestones": collections.Counter({2: 1, 5: 1}),
             "order": collections.OrderedDict([("b", 1), ("a", 2)]),
             "by_epoch": {1: "warm", 2.5: None, (3, 4): [True]},
             "pair": (0.9, 0.95), "nested": [{"t": (1, (2, 3))}],
             "lr": torch.tensor(3e-4, dtype=torch.float64), "mask": torch.tensor([True, False]),
             "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) / 3,
             "np": np.float32(0.5), "np_int": np.int64(7), "np_bool": np.bool_(True),
             "tagged": {"__outcore__": "tuple", "items": [1]}, "inf": float("inf")}
    back = _round_trip(value)
    for key in ("milestones", "order", "by_epoch", "pair", "nested", "tagged", "inf"):
        assert back[key] == value[key] and type(back[key]) is type(value[key]), key
    assert list(back["order"]) == ["b", "a"]
    for key in ("lr", "mask", "half"):
        assert back[key].dtype == value[key].dtype and torch.equal(back[key], value[key]), key
    assert (back["np"], back["np_int"], back["np_bool"]) == (0.5, 7, True)
    assert type(back["np_bool"]) is bool


def test_another_dict_type_comes_back_a_dict() -> None:
    """What JSON took before (a dict subclass, a defaultdict) is still stored, as a dict."""
    class Settings(dict):
        pass

    back = _round_trip({"a": Settings(x=1), "b": collections.defaultdict(int, {2: 3})})
    assert back == {"a": {"x": 1}, "b": {2: 3}} and type(back["b"]) is dict


@pytest.mark.parametrize("stored", [{"__outcore__": "tuple", "items": [1], "more": 2},
                                    {"__outcore__": ["x"]}, {"__outcore__": "dict"},
                                    {"__outcore__": "tensor", "dtype": "nope", "shape": [],
                                     "values": 1}])
def test_a_manifests_plain_dict_with_the_tag_key_reads_as_it_is(stored: dict) -> None:
    """A dict an older outcore stored as it was, that happens to hold the tag's key."""
    assert decode(stored) == stored


def test_a_plain_json_state_is_stored_as_it_is() -> None:
    """Manifests stay readable by a person, and those written before read the same."""
    value = {"step": 3, "data": {"epoch": 1, "seen": [1, 2]}, "name": "run"}
    assert check_client_state(value) == value and decode(value) == value


@pytest.mark.parametrize(("value", "where"), [
    ({"fn": print}, r"client_state\['fn'\] \(builtin_function_or_method\)"),
    ({"d": {"k": {1, 2}}}, r"client_state\['d'\]\['k'\] \(set\)"),
    ({"l": [1, object()]}, r"client_state\['l'\]\[1\] \(object\)"),
    ({"big": torch.zeros(MAX_TENSOR_ELEMENTS + 1)}, r"client_state\['big'\] is a tensor of"),
    ({"z": torch.zeros(2, dtype=torch.complex64)}, r"client_state\['z'\] is a torch.complex64"),
    ({1: "x"}, r"client_state key 1 is not a string"),
])
def test_what_has_no_faithful_form_is_refused_naming_where(value: dict, where: str) -> None:
    with pytest.raises(outcore.ConfigError, match=where):
        check_client_state(value)


def test_a_scheduler_with_a_tensor_learning_rate_is_saved_and_loaded(tmp_path: Path) -> None:
    """torch takes a tensor ``lr``; its scheduler's state then holds tensors (refused before)."""
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    engine = outcore.initialize(model, {"dtype": "fp32"}, optimizer=opt)
    saved = sched.state_dict()
    assert isinstance(saved["base_lrs"][0], torch.Tensor)
    engine.save_checkpoint(tmp_path / "c", client_state={"sched": saved})
    assert not list(tmp_path.glob("*.partial*"))
    back = engine.load_checkpoint(tmp_path / "c")["sched"]
    assert back.keys() == saved.keys()
    assert torch.equal(back["base_lrs"][0], saved["base_lrs"][0])
    engine.close()


def test_a_param_groups_own_keys_are_saved_and_loaded_as_they_were(tmp_path: Path) -> None:
    """A user's key in a group (torch keeps any) came back a list for a tuple, a number for
    a tensor, string keys for int ones; one with no stored form is said, not lost quietly."""
    model = nn.Linear(4, 2)
    own = {"pair": (1, 2), "scale": torch.tensor(3.0), "by_id": {1: 2}, "thing": object(),
           "mask": torch.ones(100)}
    engine = outcore.initialize(model, {"dtype": "fp32"},
                                [{"params": list(model.parameters()), **own}])
    with pytest.warns(UserWarning, match=r"param_groups\[0\]\['thing'\] \(object\) cannot be "
                                         r"stored.*a load keeps the engine's own value"):
        engine.save_checkpoint(tmp_path / "c")
    group = engine.optimizer.param_groups[0]
    group.update(pair=(0, 0), scale=torch.tensor(0.0), by_id={}, thing="changed",
                 mask=torch.zeros(100))
    engine.load_checkpoint(tmp_path / "c")
    assert group["pair"] == (1, 2) and group["by_id"] == {1: 2} and group["thing"] == "changed"
    assert isinstance(group["scale"], torch.Tensor) and group["scale"].item() == 3.0
    assert torch.equal(group["mask"], torch.ones(100))
    engine.close()
