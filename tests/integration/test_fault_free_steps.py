"""Steps that reuse their memory instead of faulting it in again, where the host has room.

With the optimizer state on NVMe, a host with room keeps freed memory for reuse once the
first step has shown what a step holds (offload/host_memory.py's notes). Two things a step
allocates afresh each time escaped that: the loss's tensors, larger than the heap's old
256 MiB bound on a free top, and the parameters' full-tensor memory, capped at a share of
the configured prefetch budget while the engine's budget had grown (runtime/context.py's
[Note: kept full-tensor memory follows the budget]). Malloc policies are process-wide, so
whatever applies one runs in a fresh process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.guard.memory import Available
from outcore.offload.host_memory import REUSE_TRIM_BYTES
from tests.heap import FREED_RSS, glibc_only, run_fresh, settled, step_faults

_MiB = 1 << 20


@glibc_only
@pytest.mark.cpu_only("counts the page faults of steps computed in host memory")
def test_loss_tensors_past_the_old_bound_reuse_their_pages(tmp_path: Path) -> None:
    """The loss's fp32 tensors here are 320 MB each, past ``REUSE_TRIM_BYTES``: a host with
    room reuses their pages from the second step on, as it does a narrower step's, where a
    bound of 256 MiB gave them back every step (about 80,000 faults each)."""
    nvme = {"optimizer": "nvme", "nvme_path": str(tmp_path)}
    wide = 8  # x 40 MB
    assert wide * 40_000 * 256 * 4 > REUSE_TRIM_BYTES
    roomy = step_faults(nvme, room=1 << 50, widen=wide)
    short = step_faults(nvme, room=64 << 20, widen=wide)
    assert (roomy["policy"], short["policy"]) == ("reuse", "return")
    assert settled(short["faults"]) > 200_000, short
    assert settled(roomy["faults"]) * 3 < settled(short["faults"]), (roomy, short)


@glibc_only
def test_the_heap_keeps_a_free_top_up_to_its_bound() -> None:
    """Under reuse the heap keeps a freed top up to the bound the first step sets (a quarter
    of the room left) and gives back a larger one: 512 MiB freed at the top stays under a
    1 GiB bound, not under 256 MiB (host_memory.py's [Note: reuse on a small host, when
    asked]). ``mallopt`` takes a C int: a bound of 4 GiB or more is held at its 2 GiB
    ceiling, not wrapped to 0 or to a few MiB."""
    cases = ((1 << 30, True), (0, False), (256 * _MiB, False), (4 << 30, True),
             ((4 << 30) + 100 * _MiB, True))
    for top_bytes, kept in cases:
        before, grown, after = run_fresh(FREED_RSS, "reuse", str(top_bytes))
        assert grown - before > 500 * _MiB, (top_bytes, before, grown)
        assert (after - before > 500 * _MiB) is kept, (top_bytes, before, grown, after)


@pytest.mark.cpu_only("NVMe reads land in page-aligned full tensors on a CPU device only "
                      "(plan.aligned_full)")
@pytest.mark.parametrize("reuse", [None, False, True])
def test_kept_full_tensor_memory_follows_the_engines_budget(reuse: bool | None, tmp_path: Path,
                                                            monkeypatch) -> None:
    """The memory kept for full tensors is half the engine's prefetch budget on a small host,
    the budget it grew to with params on NVMe (not the configured 128 MiB), and twice it once
    freed memory is kept for reuse: after the first step where the key is unset, from the
    start where it says ``true``; a config that refuses reuse keeps half."""
    from outcore.optim import optimizer
    from outcore.runtime import context as rt_mod
    from outcore.sizing import placement

    # nothing process-wide is applied here; the budget is what 8 GiB of free memory affords
    monkeypatch.setattr(rt_mod, "reuse_freed_memory_on_small_host", lambda: True)
    monkeypatch.setattr(rt_mod, "bound_reused_top", lambda top_bytes: True)
    monkeypatch.setattr(placement, "available_memory", lambda: Available(8 << 30, None))
    monkeypatch.setattr(optimizer, "available_memory", lambda: Available(1 << 50, None))
    cfg = outcore.Config.from_dict({
        "dtype": "auto", "optimizer": {"type": "adamw", "lr": 1e-3},
        "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path),
                    "reuse_freed_memory": reuse},
        "zero": {"resident_copies": False}})  # every copy read into full tensors
    torch.manual_seed(0)
    with outcore.initialize(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)), cfg) as engine:
        regions, budget = engine.rt.full_regions, engine.schedule.prefetch_bytes
        assert regions is not None
        assert budget == placement.prefetch_share(8 << 30) > cfg.zero.prefetch_bytes
        half, twice = max(budget // 2, 32 * _MiB), 2 * budget
        assert regions.cap_bytes == (twice if reuse else half)
        engine.backward(engine(torch.randn(8, 64)).float().pow(2).mean())
        engine.step()
        assert engine.rt.reusing is (reuse is not False)
        assert regions.cap_bytes == (half if reuse is False else twice)


@pytest.mark.parametrize("fraction, kept", [(1.0, "twice"), (0.0, "half")])
def test_a_frozen_base_on_disk_keeps_the_small_hosts_share(fraction: float, kept: str,
                                                          tmp_path: Path) -> None:
    """With the optimizer state in memory the host counts as sized for the model, unless a
    frozen base on NVMe is most of it (host_memory.py's [Note: a frozen base does not size
    the host]): then the full tensors keep the small host's half budget."""
    from outcore.runtime.context import Runtime

    cfg = outcore.Config.from_dict({"offload": {"params": "nvme", "nvme_path": str(tmp_path)}})
    rt = Runtime(cfg, trainable_fraction=fraction)
    try:
        if rt.full_regions is None:
            pytest.skip("full tensors are not read into aligned memory here (plan.aligned_full)")
        rt.adopt_prefetch_budget(512 * _MiB)
        assert rt.full_regions.cap_bytes == {"twice": 1024, "half": 256}[kept] * _MiB
    finally:
        rt.close()


_FRESH_MAPPINGS = """
import json, sys
import torch
from torch import nn
import outcore
from outcore.guard.memory import Available
from outcore.optim import optimizer
optimizer.available_memory = lambda: Available(1 << 50, None)  # a host with room
cfg = outcore.Config.from_dict({"dtype": "bf16", "optimizer": {"type": "adamw", "lr": 1e-3},
                                "offload": {"params": "nvme", "optimizer": "nvme",
                                            "nvme_path": sys.argv[1]},
                                "zero": {"resident_copies": False}})  # read into full tensors
torch.manual_seed(0)
with outcore.init(cfg):  # 9 x 4M parameters: 75 MB of bf16 full tensors, past 64 MiB
    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(9)])
engine = outcore.initialize(model, cfg)
regions = engine.rt.full_regions
x = torch.randn(4, 2048)
mapped = []
for _ in range(4):
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    mapped.append(regions.mapped)
print(json.dumps({"mapped": mapped, "fills": regions.fills, "reusing": engine.rt.reusing}))
engine.close()
"""


@glibc_only
@pytest.mark.cpu_only("NVMe reads land in page-aligned full tensors on a CPU device only "
                      "(plan.aligned_full)")
def test_steps_after_the_first_map_no_fresh_full_tensor_memory(tmp_path: Path) -> None:
    """With params and optimizer on NVMe and a host with room, every full tensor from the
    third step on is filled with memory kept from an earlier one: none is mapped afresh
    (and faulted in by the read into it). Capped at the configured budget's half, 64 MiB,
    this model's 75 MB were partly mapped afresh every step."""
    out = run_fresh(_FRESH_MAPPINGS, str(tmp_path))
    assert out["reusing"], out
    assert out["fills"] >= 4 * 9, out
    assert out["mapped"][3] == out["mapped"][1], out
    assert not any(tmp_path.iterdir())
