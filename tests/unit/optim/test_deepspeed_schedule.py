"""``outcore.deepspeed_scheduler``: a DeepSpeed config's scheduler section for a loop of one's
own (optim/deepspeed_schedule.py's note). Rates recorded from DeepSpeed 0.19.8's classes
(its peer venv, ../shared/peers/deepspeed/) in its engine's order: optimizer.step(), then the
scheduler's, over an SGD with two groups at 1e-3 and 1e-4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore

# lr of each group at updates 1..10
DEEPSPEED = {
    # warmup_num_steps 4, no peak: each group warms up to its own rate
    "WarmupLR": [[0.0, 0.0], [0.0, 0.0], [5e-4, 5e-5], [7.924813e-4, 7.924813e-5]]
    + [[1e-3, 1e-4]] * 6,
    # total 6, warm-up 3, linear: each group's own rate, held at the floor after the end
    "WarmupCosineLR": [[0.0, 0.0], [0.0, 0.0], [3.333333e-4, 3.333333e-5],
                       [6.666667e-4, 6.666667e-5], [7.50025e-4, 7.50025e-5],
                       [2.50075e-4, 2.50075e-5]] + [[1e-7, 1e-8]] * 4,
    # total 6, warm-up 3: the default peak 1e-3 for both groups, then down to 0
    "WarmupDecayLR": [[0.0, 0.0], [0.0, 0.0], [6.309298e-4, 6.309298e-4], [1e-3, 1e-3],
                      [1e-3, 1e-3], [6.666667e-4, 6.666667e-4], [3.333333e-4, 3.333333e-4]]
    + [[0.0, 0.0]] * 3,
}
PARAMS = {"WarmupLR": {"warmup_num_steps": 4},
          "WarmupCosineLR": {"total_num_steps": 6, "warmup_num_steps": 3,
                             "warmup_type": "linear"},
          "WarmupDecayLR": {"total_num_steps": 6, "warmup_num_steps": 3}}


def _sgd() -> torch.optim.SGD:
    return torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))], "lr": 1e-3},
                            {"params": [nn.Parameter(torch.zeros(1))], "lr": 1e-4}], lr=1e-3)


@pytest.mark.parametrize("kind", list(DEEPSPEED))
def test_each_update_runs_at_deepspeeds_rate_with_its_defaults(kind: str,
                                                               tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                "scheduler": {"type": kind, "params": PARAMS[kind]}}))
    opt = _sgd()
    sched = outcore.deepspeed_scheduler(opt, path)
    used = []
    for _ in range(10):
        used.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    for got, want in zip(used, DEEPSPEED[kind], strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-12)


@pytest.mark.parametrize(("section", "said"), [
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3}},
     r"scheduler\.params\.total_num_steps is needed"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
     r"scheduler\.params\.warmup_num_steps: \"auto\" is filled from the Trainer"),
    ({"type": "OneCycle", "params": {}}, r"scheduler\.type: 'OneCycle' is not supported"),
    (None, r"no DeepSpeed 'scheduler' section"),
])
def test_what_cannot_be_built_is_named(section: dict | None, said: str) -> None:
    config = {"zero_optimization": {"stage": 3}}
    if section is not None:
        config["scheduler"] = section
    with pytest.raises(outcore.ConfigError, match=said):
        outcore.deepspeed_scheduler(_sgd(), config)


def test_a_deepspeed_loop_steps_it_on_each_update(tmp_path: Path) -> None:
    """DeepSpeed's loop calls engine.step() after every micro-batch and its engine steps the
    scheduler at each applied update: here the scheduler steps when engine.step() returns
    True, and each update runs at DeepSpeed's rate."""
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    with pytest.warns(UserWarning):  # the keys a DeepSpeed file sets that have no meaning here
        engine = outcore.initialize(model, config)
    sched = outcore.deepspeed_scheduler(engine.optimizer, config)
    used = []
    for _ in range(12):
        loss = engine(torch.randn(2, 4)).pow(2).mean()
        engine.backward(loss)
        lr = engine.get_lr()[0]
        if engine.step():
            used.append(lr)
            sched.step()
    engine.close()
    assert used == pytest.approx([row[0] for row in DEEPSPEED["WarmupLR"][:6]], rel=1e-5)


# lr of each group at updates 1..6, from DeepSpeed 0.19.8 with the groups' rates given
EDGES = {
    "cosine from a ratio above 0: the first update at 0": (
        [1e-3, 1e-4], {"type": "WarmupCosineLR", "params": {
            "total_num_steps": 5, "warmup_num_steps": 3, "warmup_min_ratio": 0.1}},
        [[0.0, 0.0], [1e-4, 1e-5], [6.678368e-4, 6.678368e-5], [1e-3, 1e-4],
         [5.0005e-4, 5.0005e-5], [1e-7, 1e-8]]),
    "a group made at rate 0 still warms up to the peak": (
        [1e-3, 0.0], {"type": "WarmupDecayLR", "params": {
            "total_num_steps": 5, "warmup_num_steps": 3, "warmup_max_lr": 2e-3,
            "warmup_type": "linear"}},
        [[0.0, 0.0], [0.0, 0.0], [6.666667e-4] * 2, [1.333333e-3] * 2, [2e-3] * 2,
         [1e-3] * 2]),
    "a warm-up type DeepSpeed does not know is log": (
        [1e-3, 1e-4], {"type": "WarmupLR", "params": {"warmup_num_steps": 3,
                                                       "warmup_type": "Linear"}},
        [[0.0, 0.0], [0.0, 0.0], [6.309298e-4, 6.309298e-5]] + [[1e-3, 1e-4]] * 3),
}


@pytest.mark.parametrize("case", list(EDGES))
def test_deepspeeds_edges(case: str) -> None:
    lrs, section, want = EDGES[case]
    opt = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))], "lr": lr}
                           for lr in lrs], lr=1e-3)
    sched = outcore.deepspeed_scheduler(opt, {"scheduler": section})
    used = []
    for _ in range(6):
        used.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    for got, row in zip(used, want, strict=True):
        assert got == pytest.approx(row, rel=1e-5, abs=1e-12)


def test_a_scheduler_made_after_a_resume_keeps_deepspeeds_rates() -> None:
    """Made after load_checkpoint (which restores the rate of the step it stopped at, and the
    group's initial_lr), then given its saved state: the rates go on as without the stop (its
    base was the resumed rate, and its first update ran at the warm-up's start); its state
    pickles (it goes into a checkpoint's client state)."""
    import io

    section = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 6}}}
    opt = _sgd()
    sched = outcore.deepspeed_scheduler(opt, section)
    want = []
    for step in range(8):
        if step == 4:
            saved = {"groups": [dict(g, params=[]) for g in opt.param_groups],
                     "sched": sched.state_dict()}
            buffer = io.BytesIO()
            torch.save(saved["sched"], buffer)
        want.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    resumed = _sgd()
    for group, old in zip(resumed.param_groups, saved["groups"], strict=True):
        group.update({k: v for k, v in old.items() if k != "params"})  # as a load restores
    again = outcore.deepspeed_scheduler(resumed, section)
    buffer.seek(0)
    again.load_state_dict(torch.load(buffer))
    got = []
    for _ in range(4):
        got.append([g["lr"] for g in resumed.param_groups])
        resumed.step()
        again.step()
    assert sum(got, []) == pytest.approx(sum(want[4:], []), rel=1e-9)
