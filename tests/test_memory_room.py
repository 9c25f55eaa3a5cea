"""dgserve.engine.memory_room: the memory the process may still take, read from fake /proc and cgroup trees (v1,
v2, no limit, a limit above the process's own cgroup, a container's namespaced view, missing files)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_cgroups import self_cgroup, write

from dgserve.engine.memory_room import MemoryReading, read_memory

MIB = 1 << 20
GIB = 1 << 30
V1_UNLIMITED = 9223372036854771712  # what a v1 cgroup without a limit reports
V1_MOUNTS = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
V2_MOUNTS = "41 31 0:38 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n"


def proc(root: Path, cgroup: str | None, mountinfo: str | None, available=20 * GIB, rss=300 * MIB) -> None:
    write(root, "proc/meminfo", f"MemTotal: 33554432 kB\nMemFree: 1 kB\nMemAvailable: {available // 1024} kB\n")
    write(root, "proc/self/status", f"Name:\tpython\nVmPeak:\t9 kB\nVmRSS:\t{rss // 1024} kB\n")
    self_cgroup(root, cgroup, mountinfo)


def v1_group(root: Path, path: str, limit: int, usage: int | None, inactive: int = 0) -> None:
    d = f"sys/fs/cgroup/memory{path}"
    write(root, f"{d}/memory.limit_in_bytes", f"{limit}\n")
    if usage is not None:
        write(root, f"{d}/memory.usage_in_bytes", f"{usage}\n")
    write(root, f"{d}/memory.stat", f"cache 5\ninactive_file 1\ntotal_inactive_file {inactive}\n")


def v2_group(root: Path, path: str, limit: str, current: int | None, inactive: int = 0) -> None:
    d = f"sys/fs/cgroup{path}"
    write(root, f"{d}/memory.max", f"{limit}\n")
    if current is not None:
        write(root, f"{d}/memory.current", f"{current}\n")
    write(root, f"{d}/memory.stat", f"anon 7\nfile 9\ninactive_file {inactive}\nactive_file 3\n")


def test_v1_limit_on_a_parent_bounds_the_room(tmp_path):
    """The process's own cgroup has no limit; its parent's limit less the parent's working set bounds it."""
    proc(tmp_path, "4:memory:/pods/p1\n3:cpuset:/\n0::/\n", V1_MOUNTS)
    v1_group(tmp_path, "", V1_UNLIMITED, 9 * GIB)
    v1_group(tmp_path, "/pods", 2 * GIB, 900 * MIB, inactive=100 * MIB)
    v1_group(tmp_path, "/pods/p1", V1_UNLIMITED, 500 * MIB)
    r = read_memory(tmp_path)
    assert (r.cgroup, r.cgroup_limit, r.cgroup_usage) == ("/sys/fs/cgroup/memory/pods", 2 * GIB, 800 * MIB)
    assert r.available == 2 * GIB - 800 * MIB and r.bound == "cgroup" and r.rss == 300 * MIB
    assert "bounded by the cgroup" in r.describe() and "/sys/fs/cgroup/memory/pods" in r.describe()


def test_v1_the_tightest_level_wins(tmp_path):
    proc(tmp_path, "4:memory:/a/b\n", V1_MOUNTS)
    v1_group(tmp_path, "/a", 4 * GIB, 3 * GIB)  # 1 GiB of room
    v1_group(tmp_path, "/a/b", 2 * GIB, 512 * MIB)  # 1.5 GiB of room
    r = read_memory(tmp_path)
    assert r.cgroup == "/sys/fs/cgroup/memory/a" and r.available == GIB


def test_v2_limit_and_working_set(tmp_path):
    proc(tmp_path, "0::/kubepods/burstable/pod1/c1\n", V2_MOUNTS)
    v2_group(tmp_path, "/kubepods", "max", 10 * GIB)
    v2_group(tmp_path, "/kubepods/burstable/pod1/c1", str(3 * GIB), GIB, inactive=256 * MIB)
    r = read_memory(tmp_path)
    assert r.cgroup == "/sys/fs/cgroup/kubepods/burstable/pod1/c1"
    assert (r.cgroup_limit, r.cgroup_usage, r.available) == (3 * GIB, 768 * MIB, 3 * GIB - 768 * MIB)


def test_v2_max_everywhere_is_no_limit(tmp_path):
    proc(tmp_path, "0::/user.slice/session-1.scope\n", V2_MOUNTS, available=6 * GIB)
    v2_group(tmp_path, "/user.slice", "max", GIB)
    v2_group(tmp_path, "/user.slice/session-1.scope", "max", GIB)
    r = read_memory(tmp_path)
    assert r == MemoryReading(6 * GIB, 300 * MIB) and r.bound == "host" and r.available == 6 * GIB
    assert "no cgroup memory limit" in r.describe()


def test_v1_unlimited_is_no_limit(tmp_path):
    proc(tmp_path, "4:memory:/\n", V1_MOUNTS)
    v1_group(tmp_path, "", V1_UNLIMITED, 7 * GIB)
    assert read_memory(tmp_path).cgroup_limit is None


def test_namespaced_container_reads_the_mount_root(tmp_path):
    """With a cgroup namespace the process sees itself at "/": the mount's root is its cgroup."""
    proc(tmp_path, "0::/\n", V2_MOUNTS)
    v2_group(tmp_path, "", str(GIB), 400 * MIB)
    r = read_memory(tmp_path)
    assert (r.cgroup, r.available) == ("/sys/fs/cgroup", 624 * MIB)


def test_path_missing_under_the_mount_falls_back_to_its_root(tmp_path):
    proc(tmp_path, "0::/somewhere/else\n", V2_MOUNTS)
    v2_group(tmp_path, "", str(GIB), 100 * MIB)
    assert read_memory(tmp_path).cgroup == "/sys/fs/cgroup"


def test_v1_mount_root_is_stripped(tmp_path):
    """A v1 container without a cgroup namespace: /proc/self/cgroup names /docker/x, mounted as the root."""
    mounts = "35 31 0:32 /docker/x /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"
    proc(tmp_path, "9:memory:/docker/x\n", mounts)
    v1_group(tmp_path, "", 3 * GIB, GIB)
    r = read_memory(tmp_path)
    assert (r.cgroup, r.available) == ("/sys/fs/cgroup/memory", 2 * GIB)


def test_hybrid_prefers_the_v1_memory_hierarchy(tmp_path):
    mounts = V1_MOUNTS + "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    proc(tmp_path, "4:memory:/job\n0::/job\n", mounts)
    v1_group(tmp_path, "/job", 2 * GIB, GIB)
    write(tmp_path, "sys/fs/cgroup/unified/job/cgroup.procs", "1\n")
    assert read_memory(tmp_path).cgroup == "/sys/fs/cgroup/memory/job"


def test_unreadable_usage_counts_the_process_rss(tmp_path):
    proc(tmp_path, "0::/c\n", V2_MOUNTS, rss=700 * MIB)
    v2_group(tmp_path, "/c", str(GIB), None)
    r = read_memory(tmp_path)
    assert (r.cgroup_usage, r.available) == (700 * MIB, 324 * MIB)


def test_usage_over_the_limit_leaves_no_room(tmp_path):
    proc(tmp_path, "0::/c\n", V2_MOUNTS)
    v2_group(tmp_path, "/c", str(GIB), 2 * GIB)
    assert read_memory(tmp_path).available == 0


def test_host_smaller_than_the_cgroup_room(tmp_path):
    proc(tmp_path, "0::/c\n", V2_MOUNTS, available=GIB)
    v2_group(tmp_path, "/c", str(8 * GIB), GIB)
    r = read_memory(tmp_path)
    assert r.available == GIB and r.bound == "host" and r.cgroup_limit == 8 * GIB


@pytest.mark.parametrize("missing", ["cgroup", "mountinfo", "both", "limit", "garbled"])
def test_missing_or_garbled_files_bound_nothing(tmp_path, missing):
    cgroup = None if missing in ("cgroup", "both") else "0::/c\n"
    mounts = None if missing in ("mountinfo", "both") else V2_MOUNTS
    proc(tmp_path, cgroup, mounts, available=5 * GIB)
    if missing == "garbled":
        write(tmp_path, "sys/fs/cgroup/c/memory.max", "lots\n")
    elif missing != "limit":
        write(tmp_path, "sys/fs/cgroup/c/cgroup.procs", "1\n")
    r = read_memory(tmp_path)
    assert r.cgroup_limit is None and r.available == 5 * GIB


def test_without_mountinfo_the_usual_mount_points_are_tried(tmp_path):
    proc(tmp_path, "0::/c\n", None)
    v2_group(tmp_path, "/c", str(2 * GIB), GIB)
    assert read_memory(tmp_path).available == GIB


def test_no_meminfo_is_an_error(tmp_path):
    with pytest.raises(OSError, match="MemAvailable"):
        read_memory(tmp_path)


def test_this_machine_reads_without_error():
    """The real files: a reading whatever the host's cgroup layout, never more than the host has."""
    r = read_memory()
    assert 0 <= r.available <= r.host_available and r.rss > 0
