"""How much memory this process may still take on the CPU: the default KV cache budget's base (docs/deployment.md,
"Memory").

The host's ``MemAvailable`` is not the figure that matters in a container: the kernel ends a process whose cgroup
goes over its memory limit, however much the host has free. So the room is the smaller of

* the host's ``MemAvailable`` (/proc/meminfo), and
* for the process's own memory cgroup and each cgroup above it up to the root of the mount: its limit less what
  it already uses. cgroup v2: ``memory.max`` ("max": none) and ``memory.current``; cgroup v1:
  ``memory.limit_in_bytes`` (a value near 2^63: none) and ``memory.usage_in_bytes``. Usage counts the page cache
  too; its inactive file pages (``inactive_file`` / ``total_inactive_file`` in ``memory.stat``) are reclaimed
  before anything is killed, so they are not counted (the working set, as the kubelet counts it). Where the usage
  cannot be read, the process's own resident set (``VmRSS``) stands for it.

The cgroup is found as ``engine/cgroups.py`` finds a controller's (the v1 hierarchy with the memory controller if
there is one, else the v2 hierarchy). Every file is optional: what cannot be read bounds nothing.

``read_memory(root)`` reads the files under ``root`` (``/``, or a fake tree in tests) and returns a
``MemoryReading``: pure reads, no side effects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dgserve.engine.cgroups import controller_dirs
from dgserve.engine.cgroups import read_text as _read

UNLIMITED_V1 = 1 << 62  # v1 reports "no limit" as PAGE_COUNTER_MAX pages, just under 2^63 bytes


@dataclass(frozen=True)
class MemoryReading:
    """What bounds the memory this process may still take.

    host_available: bytes, the host's MemAvailable. rss: this process's resident set, bytes (0 if unreadable).
    cgroup: the directory of the tightest limited cgroup, None when no limit applies. cgroup_limit, cgroup_usage:
    its limit and its usage (working set), bytes; None without a limit.
    """

    host_available: int
    rss: int = 0
    cgroup: str | None = None
    cgroup_limit: int | None = None
    cgroup_usage: int | None = None

    @property
    def cgroup_room(self) -> int | None:
        """The cgroup's limit less its usage (at least 0), None without a limit."""
        if self.cgroup_limit is None:
            return None
        return max(0, self.cgroup_limit - (self.cgroup_usage or 0))

    @property
    def bound(self) -> str:
        """Which figure is the room: "cgroup" or "host"."""
        room = self.cgroup_room
        return "cgroup" if room is not None and room < self.host_available else "host"

    @property
    def available(self) -> int:
        """Bytes this process may still take: the smaller of the host's and the cgroup's room."""
        room = self.cgroup_room
        return self.host_available if room is None else min(room, self.host_available)

    def describe(self) -> str:
        """One line for the log: the room, what bounds it, and the other figures."""
        mib = 1 << 20
        cg = (
            f"cgroup {self.cgroup}: limit {self.cgroup_limit // mib} MiB, used {(self.cgroup_usage or 0) // mib} MiB"
            if self.cgroup_limit is not None
            else "no cgroup memory limit"
        )
        return (
            f"{self.available // mib} MiB available, bounded by the {self.bound} "
            f"(host MemAvailable {self.host_available // mib} MiB; {cg}; this process's RSS {self.rss // mib} MiB)"
        )


def read_memory(root: str | Path = "/") -> MemoryReading:
    """The memory reading of this process (module docstring), from the files under ``root``. OSError when even
    /proc/meminfo has no MemAvailable (the caller then needs a budget in bytes)."""
    root = Path(root)
    return _reading(root, controller_dirs(root, "memory"))


def room_reader(root: str | Path = "/") -> Callable[[], int | None]:
    """A cheap repeated ``read_memory(root).available``: the cgroup directories are found once, each call reads
    only the limit, usage and meminfo files (a few file reads); None when they cannot be read."""
    root = Path(root)
    dirs = controller_dirs(root, "memory")

    def read() -> int | None:
        try:
            return _reading(root, dirs).available
        except OSError:
            return None

    return read


def _reading(root: Path, dirs: list[tuple[Path, int]]) -> MemoryReading:
    host = _meminfo(root / "proc/meminfo")
    if host is None:
        raise OSError(f"cannot read MemAvailable from {root / 'proc/meminfo'}")
    rss = _status_rss(root / "proc/self/status")
    best: tuple[int, Path, int, int] | None = None  # (room, dir, limit, usage)
    for d, version in dirs:
        limit, usage = _limit_and_usage(d, version)
        if limit is None:
            continue
        usage = rss if usage is None else usage
        room = max(0, limit - usage)
        if best is None or room < best[0]:
            best = (room, d, limit, usage)
    if best is None:
        return MemoryReading(host, rss)
    _, d, limit, usage = best
    return MemoryReading(host, rss, str(Path("/") / d.relative_to(root)), limit, usage)


# ---------------------------------------------------------------------- files


def _kib_field(text: str | None, key: str) -> int | None:
    """``key: N kB`` of /proc/meminfo or /proc/self/status, in bytes."""
    for line in (text or "").splitlines():
        if line.startswith(key + ":"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024
    return None


def _meminfo(path: Path) -> int | None:
    return _kib_field(_read(path), "MemAvailable")


def _status_rss(path: Path) -> int:
    return _kib_field(_read(path), "VmRSS") or 0


def _int_file(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return -1  # v2's "no limit"
    return int(text) if text.isdigit() else None


def _stat_field(d: Path, names: tuple[str, ...]) -> int:
    """The first of ``names`` found in ``d/memory.stat``, else 0."""
    fields = {}
    for line in (_read(d / "memory.stat") or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            fields[parts[0]] = int(parts[1])
    return next((fields[n] for n in names if n in fields), 0)


def _limit_and_usage(d: Path, version: int) -> tuple[int | None, int | None]:
    """(limit, working-set usage) of one cgroup directory; limit None when there is none (or it is unreadable),
    usage None when unreadable."""
    if version == 2:
        limit, usage = _int_file(d / "memory.max"), _int_file(d / "memory.current")
        inactive: tuple[str, ...] = ("inactive_file",)
    else:
        limit, usage = _int_file(d / "memory.limit_in_bytes"), _int_file(d / "memory.usage_in_bytes")
        inactive = ("total_inactive_file", "inactive_file")
        if limit is not None and limit >= UNLIMITED_V1:
            limit = -1
    if limit is None or limit < 0:
        return None, None
    if usage is None or usage < 0:
        return limit, None
    return limit, max(0, usage - _stat_field(d, inactive))
