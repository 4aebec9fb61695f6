"""``model.load_state_dict`` at more ranks: every rank loads, or none does
(zero/load_agreement.py's [Note: a load refused on one rank is refused on every rank])."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import outcore
from tests.distributed import run_world


def _net() -> nn.Module:
    torch.manual_seed(0)  # (the batch norm's buffers: a refused load leaves them too)
    return nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2), nn.BatchNorm1d(2))


def _load(case: str, offload: str, swap: str) -> dict:
    rank = int(os.environ["RANK"])
    model = _net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = {"dtype": "fp32", "offload": {"params": offload, "optimizer": offload,
                                        "nvme_path": f"{swap}/{rank}"}}
    engine = outcore.initialize(model, cfg)
    new = {k: torch.full_like(v, 7.0) for k, v in before.items()}
    if case == "shape" and rank == 1:
        new["0.weight"] = torch.zeros(5, 4)
    elif case == "missing" and rank == 1:
        del new["2.bias"]
    elif case == "values" and rank == 1:  # another seed's weights, another checkpoint's
        new["0.weight"] = torch.full_like(new["0.weight"], 8.0)
        new["2.bias"] = torch.full_like(new["2.bias"], 8.0)
    elif case == "reordered" and rank == 1:  # the same dict, built in another order
        new = dict(reversed(new.items()))
    strict = case != "missing-lenient"
    if case == "missing-lenient":
        del new["2.bias"]
    try:
        model.load_state_dict(new, strict=strict)
        said = None
    except (RuntimeError, outcore.ConfigError) as e:
        said = f"{type(e).__name__}: {e}"
    with engine.gathered_parameters():
        after = {k: v.clone() for k, v in model.state_dict().items()}
    engine.backward(model(torch.ones(2, 4)).sum())  # the ranks still train together
    engine.step()
    engine.close()
    return {"said": said, "unchanged": all(torch.equal(after[k], before[k]) for k in before),
            "loaded": {k: bool(torch.equal(after[k], new[k])) for k in new}}


@pytest.mark.parametrize("case", ["shape", "missing"])
@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_a_load_refused_on_one_rank_is_refused_on_every_rank(tmp_path, case: str,
                                                             offload: str) -> None:
    """Rank 1's state dict has a wrong shape (or lacks a key): it raised torch's error while
    rank 0 loaded its slices, leaving a weight half new, half old. Now rank 1 raises torch's
    error, rank 0 a ConfigError saying so, and neither rank's model changed, buffers included
    (the trial had written the batch norm's statistics)."""
    zero, one = run_world(_load, 2, case, offload, str(tmp_path))
    if case == "shape":
        assert zero["said"].startswith("ConfigError: model load_state_dict() was refused on "
                                       "another rank"), zero
        assert one["said"].startswith("RuntimeError: Error(s) in loading state_dict"), one
        assert "size mismatch for 0.weight" in one["said"]
    else:  # the keys differ between the ranks: each rank says so, naming its own
        assert "the ranks' state dicts hold different keys (this rank's: missing [], " in (
            zero["said"]), zero
        assert "(this rank's: missing ['2.bias'], unexpected [])" in one["said"], one
    assert zero["unchanged"] and one["unchanged"]


@pytest.mark.parametrize("case", ["all", "missing-lenient", "reordered"])
def test_a_load_that_every_rank_accepts_loads_everywhere(tmp_path, case: str) -> None:
    for rank in run_world(_load, 2, case, "none", str(tmp_path)):
        assert rank["said"] is None, rank
        expected = {k: not (case == "missing-lenient" and k == "2.bias") for k in rank["loaded"]}
        assert rank["loaded"] == expected


def test_a_load_of_other_values_on_each_rank_is_refused(tmp_path) -> None:
    """Each rank loaded its slice of its own state dict: a weight of rank 0's first rows and
    rank 1's last, equal to neither, with no word. Now every rank refuses, naming the keys."""
    for rank in run_world(_load, 2, "values", "none", str(tmp_path)):
        assert rank["said"].startswith("ConfigError: model load_state_dict(): the ranks' state "
                                       "dicts hold different values for 0.weight, 2.bias: "), rank
        assert rank["unchanged"]
