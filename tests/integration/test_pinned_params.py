"""Training copies and kept gradient buffers in host memory on a GPU: page-locked.

runtime/context.py's [Note: training copies in host memory are page-locked on an
accelerator]. Meaningful only with CUDA as the compute device (``pytest --device cuda``);
skipped on the CPU, where nothing is page-locked and nothing crosses a link.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.runtime import context
from outcore.zero.registry import managed
from tests.common import square_loss_steps


def _engine(tmp_path: Path, dtype: str) -> tuple[nn.Module, outcore.Engine]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                          nn.Linear(512, 8))
    cfg = {"dtype": dtype, "gradient_clipping": 1.0,
           "optimizer": {"type": "adamw", "lr": 1e-3},
           "offload": {"params": "cpu", "optimizer": "cpu", "nvme_path": str(tmp_path)}}
    return model, outcore.initialize(model, cfg)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_host_training_copies_are_page_locked_and_train_as_pageable_ones(
        tmp_path: Path, device: torch.device, dtype: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if device.type != "cuda":
        pytest.skip("page-locked host shards exist only with a CUDA compute device")
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    model, engine = _engine(tmp_path, dtype)
    shards = [managed(p).compute_shard.resident() for p in model.parameters()]
    assert all(s.device.type == "cpu" and s.is_pinned() for s in shards)
    # cut from one page-locked block, not one rounded-up allocation each (pinned.py's note)
    assert len({s.untyped_storage().data_ptr() for s in shards}) == 1
    pinned = square_loss_steps(engine, x, 4)
    # the gradient buffers kept from step to step in host memory are page-locked too
    grads = [managed(p)._grad_buffer for p in model.parameters()]
    assert all(g is not None and g.device.type == "cpu" and g.is_pinned() for g in grads)
    engine.close()

    # the same run with pageable host shards: synchronous copies, the same values
    monkeypatch.setattr(context, "_page_locked", lambda t, arena: t.to("cpu"))
    model, engine = _engine(tmp_path, dtype)
    assert not any(managed(p).compute_shard.resident().is_pinned() for p in model.parameters())
    pageable = square_loss_steps(engine, x, 4)
    engine.close()
    assert pinned == pageable
    assert pinned[-1] < pinned[0]
