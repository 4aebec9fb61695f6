"""Too little memory: a placement that cannot fit is refused before the model is built, naming
the bytes needed and free and the placement that fits; ``offload auto`` fits a cgroup's limit.

The cgroup readers are tried on fake cgroup trees (v1, v2, both); the refusal and ``auto`` in a
real memory cgroup that the test creates (root only: skipped elsewhere, naming the privilege).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

import outcore
from outcore.app import models
from outcore.guard.memory import Available, available_memory, cgroup_room, memory_cgroups
from outcore.sizing import placement

GiB = 1 << 30
V1_UNLIMITED = "9223372036854771712"  # what cgroup v1 writes for "no limit"
V1_MOUNT = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
V2_MOUNT = ("29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 "
            "cgroup2 rw,nsdelegate,memory_recursiveprot\n")
HYBRID_V2_MOUNT = "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"


def _tree(tmp_path: Path, cgroup: str, mountinfo: str,
          files: dict[str, object]) -> tuple[Path, Path]:
    """A fake ``/proc/self`` and ``/`` holding ``files`` (paths relative to ``/``)."""
    proc, root = tmp_path / "proc", tmp_path / "root"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{text}\n")
    return proc, root


# -- the readers, on fake trees -------------------------------------------------------------
def test_v1_parent_limit_binds_and_inactive_page_cache_counts_as_free(tmp_path: Path) -> None:
    m = "sys/fs/cgroup/memory"
    proc, root = _tree(tmp_path, "4:memory:/outer/inner\n3:cpu:/\n0::/\n",
                       V1_MOUNT + HYBRID_V2_MOUNT, {
                           f"{m}/memory.limit_in_bytes": V1_UNLIMITED,  # the root: no limit
                           f"{m}/memory.usage_in_bytes": 20 * GiB,
                           f"{m}/outer/memory.limit_in_bytes": 4 * GiB,
                           f"{m}/outer/memory.usage_in_bytes": 3 * GiB,
                           f"{m}/outer/memory.stat": f"cache 1\ntotal_inactive_file {GiB // 2}",
                           f"{m}/outer/inner/memory.limit_in_bytes": 8 * GiB,  # looser
                           f"{m}/outer/inner/memory.usage_in_bytes": GiB,
                       })
    assert [(v, leaf.relative_to(root).as_posix()) for v, leaf, _ in memory_cgroups(proc, root)] \
        == [(1, f"{m}/outer/inner")]  # the hybrid machine's v2 mount has no such folder
    assert cgroup_room(proc, root) == 4 * GiB - (3 * GiB - GiB // 2)  # outer's room, not inner's


def test_v2_walks_up_and_max_means_no_limit(tmp_path: Path) -> None:
    c = "sys/fs/cgroup"
    proc, root = _tree(tmp_path, "0::/user.slice/job\n", V2_MOUNT, {
        f"{c}/cgroup.controllers": "cpu memory",  # the root has no memory.max
        f"{c}/user.slice/memory.max": 2 * GiB,
        f"{c}/user.slice/memory.current": GiB,
        f"{c}/user.slice/memory.stat": f"anon 1\ninactive_file {GiB // 4}\nactive_file 7",
        f"{c}/user.slice/job/memory.max": "max",
        f"{c}/user.slice/job/memory.current": GiB // 2,
    })
    assert cgroup_room(proc, root) == 2 * GiB - (GiB - GiB // 4)
    found = available_memory(proc, root)
    assert found.cgroup == 2 * GiB - 3 * GiB // 4
    assert found.bytes == min(found.machine, found.cgroup)


def test_no_limit_anywhere_is_none_and_the_machine_decides(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "4:memory:/a\n0::/a\n", V1_MOUNT + V2_MOUNT, {
        "sys/fs/cgroup/memory/a/memory.limit_in_bytes": V1_UNLIMITED,
        "sys/fs/cgroup/memory/a/memory.usage_in_bytes": GiB,
        "sys/fs/cgroup/a/memory.max": "max",
        "sys/fs/cgroup/a/memory.current": GiB,
        "sys/fs/cgroup/a/x/memory.max": 10,  # a child of ours: not on the way up
    })
    assert len(memory_cgroups(proc, root)) == 2 and cgroup_room(proc, root) is None
    found = available_memory(proc, root)
    assert found.cgroup is None and found.bytes == found.machine > 0
    assert "available on this machine" in str(found)


def test_both_hierarchies_take_the_smaller_room(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "4:memory:/a\n0::/b\n", V1_MOUNT + V2_MOUNT, {
        "sys/fs/cgroup/memory/a/memory.limit_in_bytes": 3 * GiB,
        "sys/fs/cgroup/memory/a/memory.usage_in_bytes": GiB,
        "sys/fs/cgroup/b/memory.max": 5 * GiB,
        "sys/fs/cgroup/b/memory.current": GiB,
    })
    assert cgroup_room(proc, root) == 2 * GiB


def test_a_container_mount_shows_its_own_cgroup_as_the_root(tmp_path: Path) -> None:
    """Docker without a cgroup namespace: the mount's root is the container's cgroup."""
    mount = "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"
    proc, root = _tree(tmp_path, "4:memory:/docker/abc\n", mount, {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": GiB,
        "sys/fs/cgroup/memory/memory.usage_in_bytes": GiB // 4,
    })
    assert cgroup_room(proc, root) == 3 * GiB // 4


def test_missing_or_unreadable_cgroup_files_mean_no_limit(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert memory_cgroups(empty, tmp_path) == [] and cgroup_room(empty, tmp_path) is None
    proc, root = _tree(tmp_path, "4:memory:/gone\n", V1_MOUNT, {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "garbage"})
    assert cgroup_room(proc, root) is None  # /gone is not visible; the top is unreadable


def test_over_the_limit_leaves_no_room_never_negative() -> None:
    assert Available(machine=8 * GiB, cgroup=-GiB).bytes == 0
    text = str(Available(machine=8 * GiB, cgroup=GiB))
    assert text.startswith("1.07 GB is left under this process's cgroup memory limit")


# -- pricing and the refusal, with given free bytes ------------------------------------------
@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU semantics on any machine: the device's memory is host memory."""
    monkeypatch.setattr(placement.torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("OUTCORE_DEVICE", "cpu")  # the engines built here compute there


def _cfg(tmp_path: Path, tier: str = "none", **over: object) -> outcore.Config:
    return outcore.Config.from_dict({"dtype": "fp32", "gradient_clipping": 1.0, **over,
                                     "offload": {"params": tier, "optimizer": tier,
                                                 "nvme_path": str(tmp_path)}})


def test_refused_only_when_the_states_exceed_what_is_free(tmp_path: Path, cpu_only: None) -> None:
    """fp32 with everything in memory: 16 bytes per parameter (the parameter is its own
    master, 12 bytes of AdamW state and master, a whole step's fp32 gradients for clipping)."""
    n, cfg = 10**9, _cfg(tmp_path)
    assert placement.state_bytes(n, 1, cfg, "cpu", "none", "none")["device"] == 16 * n
    with pytest.raises(outcore.ConfigError) as err:
        placement.check_fits(cfg, n, host_free=8 * 10**9)
    text = str(err.value)
    assert "offload params=none, optimizer=none: 1.00B parameters in fp32 need 16.0 GB of " \
           "model states in memory, but only 8.00 GB is available on this machine; " in text
    assert re.search(r"a placement that fits: params=nvme, optimizer=nvme|no placement fits", text)
    at_limit = placement.check_fits(cfg, n, host_free=16 * n)  # tight is not refused
    assert at_limit is not None and "100% of the 16.0 GB free: more than the 80%" in at_limit
    assert placement.check_fits(cfg, n, host_free=int(16 * n / 0.8)) is None  # USABLE.host
    assert placement.check_fits(_cfg(tmp_path, "nvme"), n, host_free=8 * 10**9) is None


def test_the_device_is_checked_apart_from_the_host(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "none", dtype="bf16")
    with pytest.raises(outcore.ConfigError, match=r"in device memory, but only 4.00 GB is free "
                       r"on the device; a placement that fits: params=none, optimizer=cpu"):
        placement.check_fits(cfg, 10**9, device_free=4 * 10**9, host_free=64 * 10**9,
                             device="cuda")


def test_auto_plans_for_the_cgroup_not_the_machine(tmp_path: Path, cpu_only: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "available_memory",
                        lambda: Available(machine=64 * GiB, cgroup=2 * GiB))
    assert placement.free_memory() == (2 * GiB, 2 * GiB)
    chosen = placement.plan(10**8, nvme_path=str(tmp_path), disk_free=100 * GiB,
                            settings=_cfg(tmp_path))  # 1.6 GB of states: not in 60% of 2 GiB
    assert (chosen.params, chosen.optimizer) != ("none", "none")
    with pytest.raises(outcore.ConfigError, match="cgroup memory limit"):
        placement.check_fits(_cfg(tmp_path), 2 * 10**8)


# -- real runs of `outcore train` -----------------------------------------------------------
@dataclass(frozen=True)
class Result:
    rc: int
    stdout: str
    stderr: str
    wall_s: float
    max_rss: int
    """Peak resident bytes of the `outcore` process (getrusage of a wrapper's only child)."""


_MEASURE = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
            "sys.exit(r.returncode if r.returncode >= 0 else 128 - r.returncode)")


def _train(argv: list[str], cwd: Path, prefix: tuple[str, ...] = (),
           timeout: float = 120) -> Result:
    """``outcore train ARGV`` on the CPU, through ``prefix`` (a cgroup's entry), measured."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # price against host memory, as on the CPU machines
    cmd = [*prefix, sys.executable, "-c", _MEASURE, sys.executable, "-m", "outcore", "train",
           *argv]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the wrapper and the run it started
        proc.communicate()
        raise
    wall = time.monotonic() - t0
    head, _, last = stderr.rstrip("\n").rpartition("\n")
    rss = int(last) * 1024 if last.isdigit() else -1  # -1: the wrapper itself was killed
    return Result(proc.returncode, stdout, head if rss >= 0 else stderr, wall, rss)


@dataclass
class MemoryCgroup:
    """A child memory cgroup of this process's own, with a limit."""

    path: Path
    version: int

    def entry(self) -> tuple[str, ...]:
        """A command prefix that moves the process into this cgroup before it starts."""
        return ("sh", "-c", f'echo $$ > "{self.path / "cgroup.procs"}" && exec "$@"', "sh")

    def peak(self) -> int:
        return int((self.path / ("memory.max_usage_in_bytes" if self.version == 1
                                 else "memory.peak")).read_text())

    def remove(self) -> None:
        """Kill what is left in it (only this test's runs can be), then remove it."""
        for pid in _read(self.path / "cgroup.procs").split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        for _ in range(50):  # the last process may still be leaving
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        self.path.rmdir()


def _make_cgroup(limit: int) -> MemoryCgroup:
    """A memory cgroup under this process's own, limited to ``limit`` bytes, or a skip that
    names the missing privilege."""
    if os.geteuid() != 0:
        pytest.skip(f"creating a memory cgroup needs root (running as uid {os.geteuid()})")
    found = {version: leaf for version, leaf, _ in memory_cgroups()}
    name = f"outcore-test-{os.getpid()}-{secrets.token_hex(4)}"
    if 1 in found:
        version, parent, limit_file = 1, found[1], "memory.limit_in_bytes"
    elif 2 in found and "memory" in _read(found[2] / "cgroup.controllers").split():
        version, parent, limit_file = 2, found[2], "memory.max"
        if "memory" not in _read(found[2] / "cgroup.subtree_control").split():
            try:
                (parent / "cgroup.subtree_control").write_text("+memory")
            except OSError as e:
                pytest.skip(f"cgroup v2: cannot give children of {parent} the memory "
                            f"controller ({e.strerror}); needs a delegated cgroup")
    else:
        pytest.skip("no cgroup memory controller here: /proc/self/mountinfo shows neither a "
                    "v1 'memory' hierarchy nor a v2 one with the memory controller")
    path = parent / name
    try:
        path.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup in {parent}: {e.strerror} (needs write "
                    "access to the cgroup filesystem)")
    cgroup = MemoryCgroup(path, version)
    try:
        (path / limit_file).write_text(str(limit))
    except OSError as e:
        cgroup.remove()
        pytest.skip(f"cannot set {limit_file} in {path}: {e.strerror}")
    return cgroup


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.fixture
def memory_cgroup() -> Iterator[Callable[[int], MemoryCgroup]]:
    """Makes limited memory cgroups; each is removed after the test, even on failure."""
    made: list[MemoryCgroup] = []

    def make(limit: int) -> MemoryCgroup:
        made.append(_make_cgroup(limit))
        return made[-1]

    try:
        yield make
    finally:
        for cgroup in made:
            cgroup.remove()


# gpt-125m's fp32 model states (16 bytes a parameter with everything in memory: 1.99 GB) are
# more than the whole limit; with auto, on NVMe, a step of it trains within the limit.
MODEL, LIMIT = "gpt-125m", 1792 << 20
STATES = 16 * models.num_params(models.PRESETS[MODEL])


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(Path(models.__file__).read_text())
    return path


def _job(out: Path, corpus: Path, offload: str) -> list[str]:
    return ["--model", MODEL, "--offload", offload, "--dtype", "fp32", "--steps", "1",
            "--batch", "1", "--seq", "32", "--data", str(corpus), "--out", str(out)]


def test_a_placement_beyond_the_cgroup_limit_is_refused_before_the_build(
        memory_cgroup: Callable[[int], MemoryCgroup], corpus: Path, tmp_path: Path) -> None:
    cgroup, out = memory_cgroup(LIMIT), tmp_path / "run"
    r = _train(_job(out, corpus, "none"), tmp_path, cgroup.entry())
    assert r.rc == 2, r.stderr[-3000:]
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    found = re.fullmatch(
        r"outcore train: error: offload params=none, optimizer=none: 124M parameters in fp32 "
        r"need 1\.99 GB of model states in memory, but only ([\d.]+) (MB|GB) is left under this "
        r"process's cgroup memory limit \(the machine has [\d.]+ GB available\); a placement "
        r"that fits: params=(\w+), optimizer=(\w+) \(what offload 'auto' picks\)", line)
    assert found, line
    left = float(found[1]) * (1e6 if found[2] == "MB" else 1e9)
    assert left < LIMIT < STATES and (found[3], found[4]) != ("none", "none")
    # never reached the build: no run folder (made just before it), no banner, and the peak
    # is the interpreter's, far below the 0.5 GB that gpt-125m's fp32 weights alone take
    assert not out.exists()
    assert 0 < r.max_rss < STATES / 4 and cgroup.peak() < STATES / 4


@pytest.mark.slow
def test_auto_fits_the_cgroup_limit_and_trains(
        memory_cgroup: Callable[[int], MemoryCgroup], corpus: Path, tmp_path: Path) -> None:
    cgroup, out = memory_cgroup(LIMIT), tmp_path / "run"
    r = _train(_job(out, corpus, "auto"), tmp_path, cgroup.entry(), timeout=600)
    assert r.rc == 0, f"rc {r.rc} (137: killed for memory)\n{r.stdout}\n{r.stderr[-3000:]}"
    chosen = re.search(r"^placement: params=(\w+), optimizer=(\w+)", r.stderr, re.M)
    assert chosen and chosen.groups() != ("none", "none"), r.stderr[-3000:]  # (the plan)
    [row] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and math.isfinite(row["loss"])
    assert cgroup.peak() <= LIMIT


GPT_3B = 16 * models.num_params(models.PRESETS["gpt-3b"])  # 51.7 GB of fp32 model states


@pytest.mark.skipif(psutil.virtual_memory().total >= GPT_3B or torch.cuda.is_available(),
                    reason="this machine has the memory (or a GPU) for gpt-3b's fp32 states")
def test_gpt_3b_with_everything_in_memory_is_refused_at_once(corpus: Path,
                                                             tmp_path: Path) -> None:
    """issue 20: on a 24 GiB machine this was killed by the kernel after 1 min 42 s, silent."""
    out = tmp_path / "run"
    r = _train(["--model", "gpt-3b", "--offload", "none", "--dtype", "fp32", "--data",
                str(corpus), "--out", str(out)], tmp_path)
    assert r.rc == 2, r.stderr[-3000:]
    assert re.fullmatch(
        r"outcore train: error: offload params=none, optimizer=none: 3\.23B parameters in fp32 "
        r"need 51\.7 GB of model states in memory, but only [\d.]+ GB is (available on this "
        r"machine|left under this process's cgroup memory limit .*); (a placement that fits: "
        r"params=\w+, optimizer=\w+ \(what offload 'auto' picks\)|no placement fits: .*)",
        r.stderr.strip()), r.stderr
    assert not out.exists() and 0 < r.max_rss < 2 * GiB  # the fp32 weights alone: 12.9 GB
