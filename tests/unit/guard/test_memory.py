"""Memory this process may still use (guard/memory.py's [Note: a cgroup limit is the real
limit]): the machine's available memory, capped by the smallest room (limit - usage, inactive
file pages not counted as used) of this process's memory cgroups and their ancestors, v1 and
v2 both read where both are mounted; ``max``, "unlimited" (>= 2**60) or a missing file is no
limit, and a mount whose root is a cgroup has that prefix taken off the path. Tests run on
fake ``/proc/self`` and ``/`` trees."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from outcore.guard import memory
from outcore.guard.memory import (
    Available,
    available_memory,
    cgroup_room,
    memory_cgroups,
    v1_room,
    v2_room,
)

GiB = 1 << 30
V2_MOUNT = "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNT = ("31 25 0:27 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup "
            "rw,memory\n")
OTHER_MOUNTS = ("22 1 8:1 / / rw,relatime - ext4 /dev/vda rw\n"
                "32 25 0:28 / /sys/fs/cgroup/cpu rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n")


def _write(folder: Path, **files: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text)
    return folder


def _proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    return _write(tmp_path / "proc", cgroup=cgroup, mountinfo=mountinfo)


# -- Available --------------------------------------------------------------------------------
def test_available_is_the_smaller_figure_and_never_negative() -> None:
    assert Available(machine=8 * GiB, cgroup=None).bytes == 8 * GiB
    assert Available(machine=8 * GiB, cgroup=2 * GiB).bytes == 2 * GiB
    assert Available(machine=1 * GiB, cgroup=2 * GiB).bytes == 1 * GiB
    assert Available(machine=8 * GiB, cgroup=-5).bytes == 0  # usage above the limit


def test_available_says_where_the_bound_comes_from() -> None:
    capped = str(Available(machine=8 * GiB, cgroup=2 * GiB))
    assert "cgroup memory limit" in capped and "left under" in capped
    assert str(Available(machine=8 * GiB, cgroup=None)).endswith("is available on this machine")
    assert "cgroup" not in str(Available(machine=1 * GiB, cgroup=2 * GiB))


# -- cgroup v2 --------------------------------------------------------------------------------
def test_v2_room_is_limit_minus_usage_less_inactive_file(tmp_path: Path) -> None:
    leaf = _write(tmp_path / "job", memory__max=str(4 * GiB), memory__current=str(3 * GiB),
                  memory__stat=f"anon 100\ninactive_file {GiB}\nactive_file 5\n")
    assert v2_room(leaf, tmp_path) == 4 * GiB - 2 * GiB


def test_a_parents_limit_binds_its_child(tmp_path: Path) -> None:
    top = tmp_path
    parent = _write(top / "slice", memory__max=str(2 * GiB), memory__current=str(GiB))
    leaf = _write(parent / "job", memory__max="max", memory__current=str(GiB))
    assert v2_room(leaf, top) == GiB
    _write(leaf, memory__max=str(GiB), memory__current=str(GiB // 2))
    assert v2_room(leaf, top) == GiB // 2  # the smaller room wins


def test_ancestors_above_the_top_are_not_read(tmp_path: Path) -> None:
    _write(tmp_path, memory__max="1", memory__current="0")  # above ``top``
    top = _write(tmp_path / "mnt", memory__max="max")
    leaf = _write(top / "job", memory__max=str(GiB), memory__current="0")
    assert v2_room(leaf, top) == GiB


@pytest.mark.parametrize("limit", ["max", str(1 << 60), str((1 << 63) - 4096), "garbage"])
def test_no_limit_means_no_room_figure(tmp_path: Path, limit: str) -> None:
    leaf = _write(tmp_path / "job", memory__max=limit, memory__current=str(GiB))
    assert v2_room(leaf, tmp_path) is None


def test_a_missing_usage_file_counts_as_zero_usage(tmp_path: Path) -> None:
    leaf = _write(tmp_path / "job", memory__max=str(GiB))
    assert v2_room(leaf, tmp_path) == GiB


# -- cgroup v1 --------------------------------------------------------------------------------
def test_v1_room_reads_v1_files_and_total_inactive_file(tmp_path: Path) -> None:
    leaf = _write(tmp_path / "docker" / "abc", memory__limit_in_bytes=str(8 * GiB),
                  memory__usage_in_bytes=str(6 * GiB),
                  memory__stat=f"inactive_file 7\ntotal_inactive_file {2 * GiB}\n")
    assert v1_room(leaf, tmp_path) == 4 * GiB
    _write(leaf, memory__limit_in_bytes=str((1 << 63) - 4096))  # "unlimited"
    assert v1_room(leaf, tmp_path) is None


# -- finding the cgroups ----------------------------------------------------------------------
def test_memory_cgroups_finds_the_v2_leaf(tmp_path: Path) -> None:
    root = tmp_path / "root"
    leaf = _write(root / "sys/fs/cgroup/user.slice/job", memory__max=str(GiB))
    proc = _proc(tmp_path, "0::/user.slice/job\n", OTHER_MOUNTS + V2_MOUNT)
    assert memory_cgroups(proc, root) == [(2, leaf, root / "sys/fs/cgroup")]


def test_both_hierarchies_are_read_and_the_smaller_room_wins(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _write(root / "sys/fs/cgroup/memory/job", memory__limit_in_bytes=str(3 * GiB),
           memory__usage_in_bytes=str(GiB))
    _write(root / "sys/fs/cgroup/job", memory__max=str(5 * GiB), memory__current=str(GiB))
    proc = _proc(tmp_path, "4:cpu,cpuacct:/job\n3:memory:/job\n0::/job\n",
                 OTHER_MOUNTS + V1_MOUNT + V2_MOUNT)
    assert sorted(v for v, _, _ in memory_cgroups(proc, root)) == [1, 2]
    assert cgroup_room(proc, root) == 2 * GiB


def test_a_mount_rooted_at_a_cgroup_has_its_prefix_taken_off(tmp_path: Path) -> None:
    """A container without a cgroup namespace: /proc/self/cgroup names the host's path, the
    mount shows the hierarchy from the container's cgroup down."""
    root = tmp_path / "root"
    leaf = _write(root / "sys/fs/cgroup", memory__max=str(GiB), memory__current="0")
    mount = "40 35 0:30 /kubepods/pod1 /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n"
    proc = _proc(tmp_path, "0::/kubepods/pod1\n", mount)
    assert memory_cgroups(proc, root) == [(2, leaf, leaf)]
    assert cgroup_room(proc, root) == GiB


def test_no_visible_hierarchy_means_no_cgroup_room(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    assert memory_cgroups(tmp_path / "no-proc", root) == []
    proc = _proc(tmp_path, "0::/job\n", OTHER_MOUNTS + V2_MOUNT)  # mounted, folder missing
    assert memory_cgroups(proc, root) == []
    assert cgroup_room(proc, root) is None


def test_a_v1_mount_without_the_memory_controller_is_not_used(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _write(root / "sys/fs/cgroup/cpu/job", memory__limit_in_bytes=str(GiB))
    proc = _proc(tmp_path, "4:cpu,cpuacct:/job\n", OTHER_MOUNTS)
    assert memory_cgroups(proc, root) == []


def test_available_memory_caps_the_machine_by_the_cgroup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class _VM:
        available = 64 * GiB

    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: _VM())
    root = tmp_path / "root"
    _write(root / "sys/fs/cgroup/job", memory__max=str(3 * GiB), memory__current=str(GiB))
    proc = _proc(tmp_path, "0::/job\n", V2_MOUNT)
    got = available_memory(proc, root)
    assert got == Available(machine=64 * GiB, cgroup=2 * GiB)
    assert got.bytes == 2 * GiB


def test_available_memory_on_this_machine_is_at_most_psutils() -> None:
    got = available_memory()
    assert 0 <= got.bytes <= max(got.machine, psutil.virtual_memory().available)
