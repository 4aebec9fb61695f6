"""The held-out loss ``outcore train`` prints at the end: the mean loss of the model as it
stands over fixed windows of the held-out tail, computed without gradients, in eval mode."""

from __future__ import annotations

import copy

import torch

import outcore
from outcore.app.data import BatchSampler
from outcore.app.evaluate import EVAL_BATCHES, held_out_loss
from outcore.app.models import build_model


def test_held_out_loss_is_the_models_mean_loss_on_fixed_windows() -> None:
    torch.manual_seed(0)
    model = build_model("tiny")
    plain = copy.deepcopy(model).eval()
    tail = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(1))
    sampler = BatchSampler(tail, 2, 32, seed=0)
    with torch.no_grad():
        want = sum(float(plain(*sampler.next())) for _ in range(EVAL_BATCHES)) / EVAL_BATCHES
    with outcore.initialize(model, {"dtype": "fp32"}) as engine:
        got = held_out_loss(engine, tail, 2, 32, is_hf=False)
        assert got is not None and abs(got - want) < 1e-5
        assert held_out_loss(engine, tail, 2, 32, is_hf=False) == got  # the same windows
        assert model.training  # given back in training mode
        assert held_out_loss(engine, tail[:30], 2, 32, is_hf=False) is None  # too short
