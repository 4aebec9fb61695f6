"""Gradients waiting for their update stay under the limit the host buffers set, also where
a tied weight's gradient waits in autograd's own buffer through the whole backward (hooks.py's
[Note: a tied weight's gradient waits unseen]). Updates are slowed so they queue up behind
backward, as they do behind a disk."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

import outcore
from outcore.optim.optimizer import ShardedOptimizer

MIB = 1 << 20
VOCAB, DIM, BLOCKS = 768, 512, 6  # the tied weight's gradient: 1.5 MiB; each block's: 1 MiB


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def test_waiting_gradients_stay_under_the_limit_with_a_tied_weight(tmp_path: Path,
                                                                   monkeypatch) -> None:
    apply = ShardedOptimizer.apply

    def slow_apply(self, work, hp) -> None:  # the update lags backward, as on a slow disk
        time.sleep(0.05)
        apply(self, work, hp)

    monkeypatch.setattr(ShardedOptimizer, "apply", slow_apply)
    limit = 2 * MIB  # twice host_buffer_bytes (optimizer.py)
    cfg = {"dtype": "fp32", "optimizer": {"type": "adamw", "lr": 1e-3},
           "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path),
                       "host_buffer_bytes": limit // 2}}
    torch.manual_seed(0)
    with outcore.initialize(TiedLM(), cfg) as engine:
        assert engine.plan.overlaps_optimizer
        idx = torch.randint(0, VOCAB, (4, 16)).to(engine.device)
        for _ in range(3):
            engine.backward(engine(idx).float().logsumexp(-1).mean())
            engine.step()
        engine.synchronize()
        peak = engine.memory_report()["by_kind"]["peak.host.grads"]
    # the queue keeps the tied weight's share free (or holds one update, whatever its size),
    # so when that gradient arrives, at most one block's waits beside it: 2.5 MiB. Before it
    # was counted: the full queue's 2 MiB and the tied 1.5 MiB on top
    tied, block = VOCAB * DIM * 4, DIM * DIM * 4
    assert 0 < peak <= max(limit, tied + block), f"{peak / MIB:.2f} MiB of gradients at once"
