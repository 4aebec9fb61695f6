"""Profiler ranges: a trace of one offloaded step shows each phase, on whichever thread ran it."""

from __future__ import annotations

import torch
from torch import nn
from torch.profiler import ProfilerActivity

import outcore
from outcore import profiling


def test_trace_of_an_offloaded_step_shows_every_phase_and_thread(tmp_path) -> None:
    cfg = {"dtype": "fp32", "optimizer": {"type": "adamw", "lr": 1e-3},
           "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)},
           "zero": {"prefetch_bytes": 1 << 16}}
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    with outcore.initialize(model, cfg) as engine:
        for _ in range(2):  # the second step follows the trace and prefetches
            with profiling.profile(activities=[ProfilerActivity.CPU]) as prof:
                engine.backward(engine(torch.randn(4, 64).to(engine.device)).pow(2).mean())
                engine.step()
    threads: dict[str, set[int]] = {}
    for e in prof.events():
        if e.name.startswith("outcore::"):
            threads.setdefault(e.name, set()).add(e.thread)
    expect = {profiling.UNSHARD, profiling.FETCH, profiling.NVME_READ, profiling.NVME_WRITE,
              profiling.OPTIM_READ, profiling.OPTIM_UPDATE, profiling.OPTIM_WRITE, profiling.STEP}
    assert expect <= set(threads)
    main = threads[profiling.STEP]
    assert not threads[profiling.NVME_READ] & main  # I/O ran on the engine's threads
    # with the optimizer overlapped, updates ran on its worker during backward
    assert engine.plan.overlaps_optimizer
    assert threads[profiling.OPTIM_UPDATE] - main
