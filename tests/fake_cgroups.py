"""Fake /proc and cgroup trees under a test's directory, for the readers in dgserve.engine (cgroups.py and the
readers on it: memory_room, cpu_threads), which take the tree's root."""

from __future__ import annotations

from pathlib import Path

ROOT_MOUNT = "23 1 0:21 / / rw - overlay overlay rw\n"  # the container's root filesystem, first in mountinfo


def write(root: Path, rel: str, text: str) -> None:
    """``text`` into ``root/rel``, its directories made."""
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def self_cgroup(root: Path, cgroup: str | None, mountinfo: str | None) -> None:
    """The process's ``/proc/self/cgroup`` and ``/proc/self/mountinfo`` (the root mount, then ``mountinfo``'s
    cgroup mounts); None leaves that file out."""
    if cgroup is not None:
        write(root, "proc/self/cgroup", cgroup)
    if mountinfo is not None:
        write(root, "proc/self/mountinfo", ROOT_MOUNT + mountinfo)
