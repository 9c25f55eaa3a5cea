"""dgserve.engine.cpu_threads: torch's CPU thread count follows the CPUs the process may use (docs/deployment.md,
"CPU threads"): CPU quotas read from fake cgroup trees (v1, v2, none, a quota above the process's own cgroup, a
container's namespaced view, unreadable files), the affinity bound, the precedence of an explicit count and
OMP_NUM_THREADS, a new thread's OpenMP count (which the native ops use) following torch's, and one-off torch work
on a passing thread leaving no OpenMP pool behind (where an executor's live thread keeps one)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from fake_cgroups import self_cgroup, write

from dgserve import Engine, SamplingParams
from dgserve.engine.cpu_threads import (
    CpuReading,
    apply_cpu_threads,
    choose_cpu_threads,
    follow_torch_threads,
    on_passing_thread,
    read_cpus,
)

V1_MOUNTS = "36 31 0:33 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
V2_MOUNTS = "41 31 0:38 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n"


def v2_group(root: Path, path: str, cpu_max: str) -> None:
    write(root, f"sys/fs/cgroup{path}/cpu.max", cpu_max + "\n")


def v1_group(root: Path, path: str, quota: int, period: int = 100000) -> None:
    d = f"sys/fs/cgroup/cpu,cpuacct{path}"
    write(root, f"{d}/cpu.cfs_quota_us", f"{quota}\n")
    write(root, f"{d}/cpu.cfs_period_us", f"{period}\n")


def test_v2_fractional_quota_rounds_down(tmp_path):
    """A 1.5-CPU quota on an 8-CPU affinity runs one thread (two would be throttled every period)."""
    self_cgroup(tmp_path, "0::/pod/app\n", V2_MOUNTS)
    v2_group(tmp_path, "", "max 100000")
    v2_group(tmp_path, "/pod", "max 100000")
    v2_group(tmp_path, "/pod/app", "150000 100000")
    r = read_cpus(tmp_path, affinity=8)
    assert (r.quota, r.cgroup, r.threads) == (1.5, "/sys/fs/cgroup/pod/app", 1)
    assert "CPU quota 1.5" in r.describe() and "8 CPUs" in r.describe()


def test_v2_quota_on_a_parent_bounds_and_affinity_bounds_it_too(tmp_path):
    """The tightest quota over the process's cgroup and every one above it; the affinity mask when smaller."""
    self_cgroup(tmp_path, "0::/pod/app\n", V2_MOUNTS)
    v2_group(tmp_path, "", "max 100000")
    v2_group(tmp_path, "/pod", "400000 100000")
    v2_group(tmp_path, "/pod/app", "max 100000")
    assert read_cpus(tmp_path, affinity=16).threads == 4
    r = read_cpus(tmp_path, affinity=2)
    assert (r.quota, r.cgroup, r.threads) == (4.0, "/sys/fs/cgroup/pod", 2)


def test_v1_cpu_cpuacct_hierarchy(tmp_path):
    """v1's cpu controller, mounted with cpuacct: -1 is no quota; quota / period CPUs otherwise."""
    self_cgroup(tmp_path, "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n", V1_MOUNTS)
    v1_group(tmp_path, "", -1)
    v1_group(tmp_path, "/docker", -1)
    v1_group(tmp_path, "/docker/abc", -1)
    assert read_cpus(tmp_path, affinity=6) == CpuReading(6)
    v1_group(tmp_path, "/docker/abc", 300000, 100000)
    r = read_cpus(tmp_path, affinity=6)
    assert (r.quota, r.cgroup, r.threads) == (3.0, "/sys/fs/cgroup/cpu,cpuacct/docker/abc", 3)


def test_namespaced_container_view_reads_the_mount_root(tmp_path):
    """A container whose cgroup namespace shows its own cgroup as /: the quota is at the mount's root."""
    self_cgroup(tmp_path, "0::/\n", V2_MOUNTS)
    v2_group(tmp_path, "", "200000 100000")
    assert read_cpus(tmp_path, affinity=64).threads == 2


@pytest.mark.parametrize("cpu_max", ["", "garbage", "100000", "0 100000", "-5 100000"])
def test_unreadable_or_senseless_quota_bounds_nothing(tmp_path, cpu_max):
    self_cgroup(tmp_path, "0::/\n", V2_MOUNTS)
    v2_group(tmp_path, "", cpu_max)
    assert read_cpus(tmp_path, affinity=3) == CpuReading(3)


def test_no_cgroup_at_all_is_the_affinity(tmp_path):
    assert read_cpus(tmp_path, affinity=5).threads == 5
    assert CpuReading(4, 0.25, "/x").threads == 1  # a quarter CPU still runs one thread


def test_precedence_flag_then_omp_num_threads_then_cpus():
    reading = CpuReading(8, 2.0, "/sys/fs/cgroup")
    assert choose_cpu_threads(3, "7", reading).threads == 3
    assert choose_cpu_threads(3, None, reading).source == "flag"
    omp = choose_cpu_threads(0, "7", reading)  # torch read OMP_NUM_THREADS itself at start-up: its count stands
    assert (omp.threads, omp.source) == (torch.get_num_threads(), "OMP_NUM_THREADS")
    auto = choose_cpu_threads(0, "", reading)
    assert (auto.threads, auto.source) == (2, "cpus") and "CPU quota 2" in auto.describe()


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_apply_sets_torch_threads(torch_threads):
    choice = apply_cpu_threads(torch_threads + 1)
    assert choice.threads == torch.get_num_threads() == torch_threads + 1
    assert choice.describe() == f"CPU threads: {torch_threads + 1} (flag)"


def _omp_max_threads() -> int:
    """The calling thread's OpenMP thread count, from the OpenMP runtime torch and dgserve._C share."""
    return ctypes.CDLL("libgomp.so.1").omp_get_max_threads()


def test_engine_step_thread_takes_torch_count(torch_threads, tiny_checkpoint):
    """A thread that has run no torch op has the host's OpenMP default; ``follow_torch_threads`` makes its count
    torch's, and a step run on a new thread (as the async engine's) leaves that thread at torch's count (the native
    ops' parallel regions use the calling thread's; ``Engine.step`` follows before its first op)."""
    eng = Engine.from_pretrained(tiny_checkpoint("base"))
    seen: dict[str, int] = {}
    probe = threading.Thread(target=lambda: seen.setdefault("fresh", _omp_max_threads()))
    probe.start()
    probe.join()
    target = max(seen["fresh"], torch_threads) + 1  # differs from a fresh thread's default and from torch's now
    torch.set_num_threads(target)

    def fresh(name, work):
        seen[name + " before"] = _omp_max_threads()
        work()
        seen[name] = _omp_max_threads()

    def step():
        eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, max_denoising_steps=2, seed=1))
        eng.step()

    for name, work in (("follow", follow_torch_threads), ("step", step)):
        t = threading.Thread(target=fresh, args=(name, work))
        t.start()
        t.join()
    while eng.has_unfinished():
        eng.step()
    assert seen["follow before"] != target and seen["step before"] != target, seen
    assert seen["follow"] == seen["step"] == target, seen


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settles_within(count: int, tries: int = 200) -> int:
    """The process's thread count once it is at most ``count`` (threads that ended may take a moment to go)."""
    for _ in range(tries):
        now = _threads()
        if now <= count:
            return now
        time.sleep(0.05)
    return _threads()


def _parallel_work() -> str:
    torch.randn(1 << 22).exp_()  # above torch's grain size: an OpenMP parallel region on this thread
    return threading.current_thread().name


def test_on_passing_thread_leaves_no_openmp_pool(torch_threads):
    """A live thread that ran a parallel region keeps OpenMP workers (an executor's thread: itself and one worker
    for two threads); ``on_passing_thread`` runs the work on a thread that ends, and its workers end with it."""
    torch.set_num_threads(2)
    _parallel_work()  # this thread's own pool, made before the baseline
    base = _threads()
    with ThreadPoolExecutor(1) as kept:
        kept.submit(_parallel_work).result()
        assert _threads() >= base + 2, "the executor's live thread and its OpenMP worker"
    base = _settles_within(base)
    assert asyncio.run(on_passing_thread(_parallel_work, "dgserve-probe")) == "dgserve-probe"
    assert _settles_within(base) <= base


def test_on_passing_thread_raises_the_work_error():
    def fail():
        raise ValueError("no checkpoint")

    with pytest.raises(ValueError, match="no checkpoint"):
        asyncio.run(on_passing_thread(fail, "dgserve-probe"))
