"""The per-process runtime (context.py's [Note: explicit context, one per model]): it
derives the execution plan from its config and device, resolves the dtype, gives a tensor a
home by tier (``store``: memory tiers keep the tensor, NVMe saves it to a verified extent),
creates this rank's swap store when a placement names NVMe (sweeping dead runs' swap
first) with the I/O pool charged to ``host.io_buffers``, splits one host buffer budget
between the pool and the optimizer ([Note: one host budget, two users]), and ``close()``
deletes the swap, stops its threads and takes the pool's charge off the ledger, safely
twice."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import outcore
from outcore.offload.buffers import AlignedRegions
from outcore.offload.ledger import Kind
from outcore.offload.storage import MemoryShard, NvmeShard, load_now
from outcore.offload.tier import Tier
from outcore.runtime.context import Runtime
from outcore.runtime.plan import ExecutionPlan

pytestmark = pytest.mark.cpu_only("the plans pinned here are the CPU device's")

BUDGET = 1 << 20


def _runtime(offload: dict | None = None, **cfg: object) -> Runtime:
    return Runtime(outcore.Config.from_dict({**cfg, "offload": offload or {}}))


@pytest.fixture
def nvme_rt(tmp_path: Path) -> Iterator[Runtime]:
    rt = _runtime({"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path),
                   "host_buffer_bytes": BUDGET}, dtype="fp32")
    yield rt
    rt.close()


def test_the_plan_is_derived_from_config_world_and_device() -> None:
    rt = _runtime({"params": "cpu", "optimizer": "cpu"}, dtype="fp32")
    assert rt.world_size == 1 and rt.rank == 0 and rt.device == torch.device("cpu")
    assert rt.param_tier is Tier.HOST and rt.state_tier is Tier.HOST
    assert rt.plan == ExecutionPlan.for_config(rt.cfg, 1, "cpu",
                                               aligned_regions=AlignedRegions.supported())
    assert rt.plan.inputs.dtype == "fp32" and rt.compute_dtype is torch.float32
    assert not rt.plan.streams and rt.staging_bytes == 0
    assert rt.grad_device == torch.device("cpu")
    rt.close()


def test_auto_dtype_is_resolved_in_the_kept_config() -> None:
    rt = _runtime()
    assert rt.cfg.dtype in ("bf16", "fp16", "fp32") and rt.cfg.dtype != "auto"
    assert rt.plan.inputs.dtype == rt.cfg.dtype
    rt.close()


def test_memory_tiers_keep_the_tensor_itself() -> None:
    rt = _runtime({"params": "cpu"})
    t = torch.arange(6.0)
    stored = rt.store(t, Tier.HOST, Kind.PARAMS)
    assert isinstance(stored, MemoryShard) and stored.resident() is t
    on_device = rt.store(t, Tier.DEVICE, Kind.GRADS)
    assert isinstance(on_device, MemoryShard) and on_device.tier is Tier.DEVICE
    assert on_device.resident().device == rt.device
    assert rt.ledger.snapshot()["host.params"] == 24
    assert rt.ledger.snapshot()["device.grads"] == 24
    assert rt._nvme is None  # no NVMe placement, no store
    rt.close()


def test_the_nvme_store_is_created_with_an_nvme_runtime(nvme_rt: Runtime,
                                                        tmp_path: Path) -> None:
    """Made when the runtime is, so a bad ``nvme_path`` fails the build even where nothing
    is written for a while (trainable parameters cast from masters in memory: CastShard)."""
    store = nvme_rt._nvme
    assert store is not None and nvme_rt.nvme is store  # once
    assert store.path.is_file() and store.path.parent.parent == tmp_path
    assert store.path.name == "rank0.swap"
    assert nvme_rt.ledger.snapshot()["host.io_buffers"] == store.pool.capacity_bytes > 0


def test_one_host_budget_is_split_between_pool_and_optimizer(nvme_rt: Runtime) -> None:
    assert nvme_rt.plan.streams
    assert nvme_rt.staging_bytes == BUDGET // 2
    assert nvme_rt.nvme.pool.capacity_bytes <= BUDGET - nvme_rt.staging_bytes


def test_nvme_store_saves_and_verifies(nvme_rt: Runtime) -> None:
    t = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    stored = nvme_rt.store(t, Tier.NVME, Kind.MASTER)
    assert isinstance(stored, NvmeShard) and stored.verify
    assert stored.resident() is None
    t.zero_()  # the bytes are on disk, not in ``t``
    assert torch.equal(load_now(stored),
                       torch.randn(3000, generator=torch.Generator().manual_seed(0)))
    assert nvme_rt.ledger.snapshot()["nvme.master"] == 12000


def test_verify_swap_false_reaches_the_shards(tmp_path: Path) -> None:
    rt = _runtime({"params": "nvme", "nvme_path": str(tmp_path), "verify_swap": False,
                   "host_buffer_bytes": BUDGET})
    try:
        stored = rt.store(torch.ones(10), Tier.NVME, Kind.PARAMS)
        assert isinstance(stored, NvmeShard) and stored.verify is False
    finally:
        rt.close()


def test_the_build_sweeps_dead_runs_swap(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    stale = tmp_path / f"outcore-{proc.pid}-deadbeef"
    stale.mkdir()
    (stale / "rank0.swap").write_bytes(b"\0" * 4096)
    live = tmp_path / f"outcore-{os.getpid()}-0badf00d"
    live.mkdir()
    assert stale.exists()
    rt = _runtime({"params": "nvme", "nvme_path": str(tmp_path), "host_buffer_bytes": BUDGET})
    try:
        assert not stale.exists() and live.is_dir()
    finally:
        rt.close()


def test_close_deletes_the_swap_stops_io_and_releases_the_pool_charge(
        nvme_rt: Runtime, tmp_path: Path) -> None:
    store = nvme_rt.nvme
    stored = nvme_rt.store(torch.ones(1024), Tier.NVME, Kind.PARAMS)
    folder = store.path.parent
    nvme_rt.close()
    assert nvme_rt.closed and nvme_rt._nvme is None
    assert not store.path.exists() and not folder.exists()
    assert list(tmp_path.iterdir()) == []
    assert store.closed and store.engine.closed
    assert nvme_rt.ledger.snapshot()["host.io_buffers"] == 0
    stored.free()  # a shard freed after its store closed only settles its charge
    assert nvme_rt.ledger.snapshot()["nvme.params"] == 0
    nvme_rt.close()  # twice is safe
    assert nvme_rt.ledger.snapshot()["host.io_buffers"] == 0


def test_close_without_nvme_is_harmless() -> None:
    rt = _runtime({"params": "cpu"})
    rt.close()
    rt.close()
    assert rt.closed and rt._nvme is None


def test_release_idle_io_buffers_without_a_store_is_a_no_op() -> None:
    rt = _runtime()
    rt.release_idle_io_buffers()
    assert rt._nvme is None
    rt.close()


def test_reconfigure_adopts_another_dtype_and_rederives_the_plan() -> None:
    rt = _runtime({"params": "cpu", "optimizer": "cpu"}, dtype="fp32")
    assert rt.plan.inputs.dtype == "fp32"
    cfg = rt.reconfigure(outcore.Config.from_dict({
        "dtype": "bf16", "offload": {"params": "cpu", "optimizer": "cpu"}}))
    assert cfg.dtype == "bf16" and rt.cfg is cfg
    assert rt.compute_dtype is torch.bfloat16 and rt.plan.inputs.dtype == "bf16"
    rt.close()


def test_a_swap_folder_named_from_home_is_swept_too(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``nvme_path: ~/swap``: the store expanded ``~`` and the sweep did not (it looked in a
    literal ``~`` folder), so a killed run's swap there stayed for good; found by a probe."""
    monkeypatch.setenv("HOME", str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    stale = tmp_path / "swap" / f"outcore-{proc.pid}-deadbeef"
    stale.mkdir(parents=True)
    (stale / "rank0.swap").write_bytes(b"\0" * 4096)
    rt = _runtime({"params": "nvme", "nvme_path": "~/swap", "host_buffer_bytes": BUDGET})
    try:
        assert not stale.exists()
        assert rt.nvme.path.is_relative_to(tmp_path / "swap")
    finally:
        rt.close()
