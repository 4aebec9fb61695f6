"""Memory this process may still use: the machine's available memory, capped by its cgroup.

``placement.free_memory()`` reads host memory here, so ``Config.auto`` plans for, and
``placement.check_fits`` refuses against, the limit the kernel enforces, not the machine's size.

[Note: a cgroup limit is the real limit]
psutil's ``available`` is the machine's. Inside a container, a systemd slice or a batch job
with a memory limit, the kernel kills the process as soon as its cgroup's usage reaches the
limit, however much the machine still has free. So the bytes this process may still use are
the smaller of the machine's available memory and the room its memory cgroup leaves,
limit - usage, taken over the cgroup and every ancestor up to the top of the mounted
hierarchy, since a parent's limit binds its children too:
* cgroup v1: the ``memory`` controller's hierarchy (``memory:<path>`` in
  ``/proc/self/cgroup``), files ``memory.limit_in_bytes`` and ``memory.usage_in_bytes``;
* cgroup v2: the unified hierarchy (``0::<path>``), files ``memory.max`` and
  ``memory.current``.
A machine can mount both (v1 for memory, an empty v2 beside it); both are read and the smaller
room wins. Mount points come from ``/proc/self/mountinfo``, and a mount whose root is a
cgroup (a container without a cgroup namespace) has that prefix taken off the path.
Usage includes page cache, which the kernel reclaims before it kills anyone; like the
kubelet's "working set", the inactive file pages (``total_inactive_file`` in v1's
``memory.stat``, ``inactive_file`` in v2's) are not counted as used. A limit of ``max`` or of
at least 2**60 bytes (v1 writes "unlimited" as 2**63 - 4096) is no limit. Swap is not
counted: spilling model states to swap is what the NVMe tier does, with O_DIRECT and overlap.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from outcore.units import format_bytes

__all__ = ["Available", "available_memory", "cgroup_room", "memory_cgroups", "v1_room",
           "v2_room"]

UNLIMITED = 1 << 60
"""A cgroup limit of this or more is no limit (see [Note: a cgroup limit is the real limit])."""


@dataclass(frozen=True)
class Available:
    """What this process may still allocate, and where the bound comes from."""

    machine: int
    """The machine's available memory (psutil: free plus reclaimable)."""
    cgroup: int | None
    """The smallest limit - usage of this process's memory cgroups; None when none is limited."""

    @property
    def bytes(self) -> int:
        """The binding figure: the smaller of the two, never negative."""
        return max(0, self.machine if self.cgroup is None else min(self.machine, self.cgroup))

    def __str__(self) -> str:
        if self.cgroup is not None and self.cgroup < self.machine:
            return (f"{format_bytes(self.bytes)} is left under this process's cgroup memory "
                    f"limit (the machine has {format_bytes(self.machine)} available)")
        return f"{format_bytes(self.bytes)} is available on this machine"


def available_memory(proc: Path = Path("/proc/self"), root: Path = Path("/")) -> Available:
    """The bytes this process may still use (see [Note: a cgroup limit is the real limit]).

    ``proc`` and ``root`` stand for ``/proc/self`` and ``/``, for tests on fake trees.
    """
    return Available(psutil.virtual_memory().available, cgroup_room(proc, root))


def cgroup_room(proc: Path = Path("/proc/self"), root: Path = Path("/")) -> int | None:
    """The smallest room (limit - usage) left by this process's memory cgroups, v1 and v2, and
    their ancestors; None when no limit is set or no cgroup hierarchy is visible."""
    rooms = [(v1_room if version == 1 else v2_room)(leaf, top)
             for version, leaf, top in memory_cgroups(proc, root)]
    found = [room for room in rooms if room is not None]
    return min(found) if found else None


def memory_cgroups(proc: Path = Path("/proc/self"),
                   root: Path = Path("/")) -> list[tuple[int, Path, Path]]:
    """``(version, folder of this process's cgroup, top of its mounted hierarchy)`` for the v1
    memory hierarchy and the v2 unified one, where mounted and visible."""
    try:
        groups = (proc / "cgroup").read_text()
        mounts = (proc / "mountinfo").read_text()
    except OSError:
        return []
    found = []
    for version, path in _memory_cgroups(groups):
        for mount_root, mount_point in _mounts(mounts, version):
            top = root / mount_point.lstrip("/")
            leaf = top / _under(path, mount_root)
            if leaf.is_dir():
                found.append((version, leaf, top))
                break
    return found


def v1_room(leaf: Path, top: Path) -> int | None:
    """Room left in a cgroup v1 memory cgroup ``leaf`` and its ancestors up to ``top``."""
    return _room(leaf, top, "memory.limit_in_bytes", "memory.usage_in_bytes",
                 "total_inactive_file")


def v2_room(leaf: Path, top: Path) -> int | None:
    """Room left in a cgroup v2 cgroup ``leaf`` and its ancestors up to ``top``."""
    return _room(leaf, top, "memory.max", "memory.current", "inactive_file")


def _room(leaf: Path, top: Path, limit_file: str, usage_file: str,
          inactive_key: str) -> int | None:
    rooms = []
    for level in _up(leaf, top):
        limit = _read_int(level / limit_file)
        if limit is None or limit >= UNLIMITED:
            continue  # no limit here (or the root, which has no limit file)
        usage = _read_int(level / usage_file) or 0
        rooms.append(limit - max(0, usage - _stat(level / "memory.stat", inactive_key)))
    return min(rooms) if rooms else None


def _up(leaf: Path, top: Path) -> Iterator[Path]:
    """``leaf``, its parent, ... up to and including ``top``."""
    level = leaf
    while True:
        yield level
        if level == top or level == level.parent:
            return
        level = level.parent


def _read_int(path: Path) -> int | None:
    """The number in a cgroup file; None for ``max`` or a file that is missing or unreadable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _memory_cgroups(text: str) -> Iterator[tuple[int, str]]:
    """``(version, path)`` of this process's memory cgroups in ``/proc/self/cgroup``."""
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            yield 2, path
        elif "memory" in controllers.split(","):
            yield 1, path


def _under(path: str, mount_root: str) -> str:
    """``path`` relative to a mount showing the hierarchy from ``mount_root`` down."""
    base = mount_root.rstrip("/")
    inside = path == base or path.startswith(base + "/")
    return (path[len(base):] if inside else path).strip("/")


def _mounts(text: str, version: int) -> Iterator[tuple[str, str]]:
    """``(root, mount point)`` of each mount of the v1 memory or the v2 hierarchy."""
    for line in text.splitlines():
        fields, _, tail = line.partition(" - ")
        fields, tail = fields.split(), tail.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        if (version == 2 and fstype == "cgroup2") or (
                version == 1 and fstype == "cgroup" and "memory" in options):
            yield fields[3], fields[4]
