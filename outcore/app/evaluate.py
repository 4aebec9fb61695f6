"""The held-out loss at the end of ``outcore train``.

The job holds out the last 1% of its token stream (``data.split_tokens``); the loss on it,
with no gradient, is the one number that says whether the model learned the text or only
the batches it saw. It is measured once, when the run completes (not when it is stopped):
``EVAL_BATCHES`` batches of the training shape from that tail, the same windows on every
run of the job (a seed of their own), each rank its share, averaged over the ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from outcore.app.data import BatchSampler
from outcore.app.ranks import global_mean

__all__ = ["EVAL_BATCHES", "held_out_loss"]

EVAL_BATCHES = 8
"""Batches of the held-out tail measured: a few seconds on 2 cores for the default job."""


def held_out_loss(engine: Any, tokens: torch.Tensor, batch: int, seq: int,
                  is_hf: bool) -> float | None:
    """The mean loss over ``EVAL_BATCHES`` batches of ``tokens`` (every rank calls: each
    forward is a collective), or None where the tail is shorter than one sequence."""
    if len(tokens) < seq + 2:
        return None
    sampler = BatchSampler(tokens, batch, seq, seed=0, rank=engine.rank,
                           world_size=engine.world_size)
    total = 0.0
    was_training = engine.module.training
    engine.eval()
    try:
        with torch.no_grad():
            for _ in range(EVAL_BATCHES):
                x, y = (t.to(engine.device) for t in sampler.next())
                out = engine(input_ids=x, labels=x) if is_hf else engine(x, y)
                total += float((out.loss if is_hf else out).detach().float())
    finally:
        engine.train(was_training)
    return global_mean(engine, total / EVAL_BATCHES)
