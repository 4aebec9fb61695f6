"""DeepSpeed's schedulers under OutcoreTrainer (hf/schedule.py): the rate of each update as
DeepSpeed's own classes give it in its engine's order (optimizer.step(), then the
scheduler's), recorded from DeepSpeed 0.19.8 (its peer venv, ../shared/peers/deepspeed/)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from outcore.hf.schedule import deepspeed_scheduler

DEEPSPEED = {  # lr of updates 1..12: warm-up 5, total 12, peak 1e-3
    "WarmupLR": [0.0, 0.0, 4.307e-4, 6.826e-4, 8.614e-4] + [1e-3] * 7,
    "WarmupDecayLR": [0.0, 0.0, 2e-4, 4e-4, 6e-4, 8e-4, 1e-3, 8.571e-4, 7.143e-4, 5.714e-4,
                      4.286e-4, 2.857e-4],
    "WarmupCosineLR": [0.0, 0.0, 2e-4, 4e-4, 6e-4, 8e-4, 9.505e-4, 8.118e-4, 6.113e-4,
                       3.888e-4, 1.883e-4, 4.961e-5],
}


@pytest.mark.parametrize("kind", list(DEEPSPEED))
def test_each_update_runs_at_deepspeeds_rate(kind: str) -> None:
    """One update ahead of DeepSpeed before: its first two updates both run at the curve's
    first value."""
    params = {"warmup_num_steps": 5, "total_num_steps": 12}
    if kind != "WarmupCosineLR":
        params |= {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3}
    if kind != "WarmupLR":
        params["warmup_type"] = "linear"
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    args = SimpleNamespace(learning_rate=1e-3, get_warmup_steps=lambda n: 5)
    sched = deepspeed_scheduler({"type": kind, "params": params}, opt, args, 12)
    used = []
    for _ in range(12):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert used == pytest.approx(DEEPSPEED[kind], rel=1e-3, abs=1e-9)
