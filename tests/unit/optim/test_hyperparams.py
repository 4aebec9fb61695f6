"""What counts as a hyper-parameter that moved between backward and ``step()``
(optim/hyperparams.py's [Note: hyper-parameters set after backward])."""

from __future__ import annotations

import logging

import pytest
import torch

from outcore.optim.hyperparams import HyperParamWatch, frozen


def _groups() -> list[dict]:
    return [{"params": [], "lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
            {"params": [], "lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}]


def test_the_same_values_in_another_form_did_not_move() -> None:
    """A tensor lr of the same value, betas as a list, a key the kernel never reads and a group
    added since (no update of it overlapped) are no move."""
    watch, groups = HyperParamWatch(), _groups()
    watch.backward_ended(groups)
    groups[0]["lr"] = torch.tensor(1e-3, dtype=torch.float64)
    groups[1]["betas"] = [0.9, 0.95]
    groups[0]["initial_lr"] = 5.0
    groups.append({"params": [], "lr": 1.0})
    assert not watch.moved(groups, tentative=False, applied=lambda: 2)
    assert not watch.late


@pytest.mark.parametrize(("key", "value", "shown"), [
    ("lr", 2e-3, "0.001 -> 0.002"), ("betas", (0.9, 0.99), "(0.9, 0.95) -> (0.9, 0.99)"),
    ("weight_decay", 0.05, "0 -> 0.05"), ("eps", 1e-6, "1e-08 -> 1e-06"),
    ("lr", torch.tensor(2e-3), "0.001 -> 0.002")])  # a float32 tensor: not 0.0020000000949
def test_a_moved_value_is_named_once_and_stops_the_overlap(caplog: pytest.LogCaptureFixture,
                                                           key: str, value: object,
                                                           shown: str) -> None:
    watch, groups = HyperParamWatch(), _groups()
    watch.backward_ended(groups)
    groups[1][key] = value
    with caplog.at_level(logging.WARNING, logger="outcore"):
        assert watch.moved(groups, tentative=False, applied=lambda: 3)
        assert watch.late
        watch.backward_ended(groups)  # later steps: nothing overlaps, nothing to say
        groups[1][key] = _groups()[1][key]
        watch.moved(groups, tentative=False, applied=lambda: 0)
    assert [r.getMessage() for r in caplog.records] == [
        f"outcore: param_groups[1][{key!r}] changed between backward and step() "
        f"({shown}). This step's updates of 3 parameters made "
        "during backward used the earlier values. From now on every update waits for step(), "
        "which gives up overlapping the optimizer with backward; set hyper-parameters before "
        "backward or after step() (as torch's LR schedulers do) to keep it."]


def test_a_step_without_a_boundary_backward_compares_nothing() -> None:
    watch, groups = HyperParamWatch(), _groups()
    groups[0]["lr"] = 5.0
    assert not watch.moved(groups, tentative=False, applied=lambda: 0)
    watch.backward_ended(groups)
    assert not watch.moved(groups, tentative=True, applied=lambda: 0)
    groups[0]["lr"] = 6.0  # the comparison is spent: the next step compares its own backward
    assert not watch.moved(groups, tentative=True, applied=lambda: 0)


def test_a_tensor_changed_in_place_moved() -> None:
    """torch's schedulers ``fill_`` a tensor lr: the values noted at backward's end are copies."""
    watch, groups = HyperParamWatch(), _groups()
    groups[0]["lr"] = torch.tensor(1e-3)
    watch.backward_ended(groups)
    groups[0]["lr"].fill_(2e-3)
    assert watch.moved(groups, tentative=True, applied=lambda: 0)


def test_an_update_keeps_the_values_it_was_submitted_with() -> None:
    group = {"params": [object()], "lr": torch.tensor(1e-3), "betas": (torch.tensor(0.9), 0.95)}
    copy = frozen(group)
    group["lr"].fill_(5.0)
    group["betas"][0].fill_(0.0)
    assert copy["lr"].item() == pytest.approx(1e-3)
    assert copy["betas"][0].item() == pytest.approx(0.9)
    assert copy["params"] is group["params"]  # the parameters are not copied
