"""The compute device the suite runs on: ``--device cuda`` or ``OUTCORE_TEST_DEVICE=cuda``.

[Note: one switch runs the suite on CUDA]
The switch sets ``OUTCORE_DEVICE`` (accel.py) for this process and every rank it spawns, so
each engine computes on the chosen device; without it the suite computes on the CPU, also on
a GPU machine. Tests build their inputs and plain-PyTorch references on the CPU and move
them to ``engine.device`` (or the ``device`` fixture, or ``default_device()`` inside a
spawned rank), so the same test runs unchanged on either device. Under CUDA:

* world size 1 computes on CUDA, in this process or in one spawned rank;
* a multi-rank world (``tests.distributed.run_world``) runs its ranks as gloo processes on
  the CPU unless there is a GPU per rank (one GPU cannot hold two NCCL ranks); the
  terminal summary lists which tests ran so. ``OUTCORE_TEST_CPU_WORLDS=skip`` skips those
  tests instead (the CPU suite runs them), for a GPU session short of time;
* tests marked ``cpu_only`` (CPU ISA checks, page-fault counts, host allocator policy) are
  skipped with their reason;
* deterministic algorithms are requested, so tests comparing two runs bit for bit compare
  the same kernels' results, not atomics' orderings.

Asking for CUDA where torch sees none stops the run at once with a usage error: a CUDA run
must never pass by silently computing on the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from outcore.device.accel import DEVICE_ENV, default_device
from tests import distributed

TEST_DEVICE_ENV = "OUTCORE_TEST_DEVICE"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", choices=("cpu", "cuda"), default=None,
                     help=f"compute device of the suite (default: ${TEST_DEVICE_ENV}, else cpu)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_only(reason): meaningful only with the CPU as the "
                            "compute device; skipped under --device cuda")
    chosen = config.getoption("--device") or os.environ.get(TEST_DEVICE_ENV, "").strip() or "cpu"
    if chosen not in ("cpu", "cuda"):
        raise pytest.UsageError(f"{TEST_DEVICE_ENV}={chosen!r}: expected cpu or cuda")
    if chosen == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"--device cuda / {TEST_DEVICE_ENV}=cuda: no CUDA device (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda or 'none'}); refusing to run the suite on the CPU")
    os.environ[DEVICE_ENV] = chosen  # inherited by every rank tests.distributed spawns
    if chosen == "cuda":
        # cuBLAS needs this for deterministic results; set before any CUDA context exists
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def pytest_report_header(config: pytest.Config) -> list[str]:
    device = default_device()
    if device.type != "cuda":
        return [f"outcore compute device: cpu ({DEVICE_ENV}=cpu)"]
    name, gpus = torch.cuda.get_device_name(device), torch.cuda.device_count()
    return [f"outcore compute device: cuda ({name}, torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}); world size 1 on CUDA; a multi-rank world on NCCL/CUDA "
            f"only with a GPU per rank ({gpus} here), else on gloo/CPU; cpu_only tests skipped"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(DEVICE_ENV) != "cuda":
        return
    for item in items:
        mark = item.get_closest_marker("cpu_only")
        if mark is not None:
            reason = mark.args[0] if mark.args else mark.kwargs.get("reason", "CPU only")
            item.add_marker(pytest.mark.skip(reason=f"cpu_only under --device cuda: {reason}"))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    runs = distributed.WORLDS
    if os.environ.get(DEVICE_ENV) != "cuda" or not runs:
        return
    tr = terminalreporter
    tr.section("outcore: where each spawned world ran")
    ones = sum(n for (_, world, _), n in runs.items() if world == 1)
    tr.write_line(f"world 1 on cuda: {ones} run(s) in "
                  f"{len({k[0] for k in runs if k[1] == 1})} test(s)")
    for (nodeid, world, device), count in sorted(runs.items()):
        if world > 1:
            how = {"cuda": "nccl", "cpu": "gloo"}.get(device, "OUTCORE_TEST_CPU_WORLDS=skip")
            tr.write_line(f"world {world} {device} ({how}) x{count}: {nodeid}")


@pytest.fixture
def device() -> torch.device:
    """The compute device engines in this process use (the switch's choice)."""
    return default_device()
