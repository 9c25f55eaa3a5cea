"""How many CPU threads torch and the native ops run on: what the process may use, not what the host has
(docs/deployment.md, "CPU threads").

torch starts with one intra-op thread per core of the host (its OpenMP default), whatever the container may use. In
a container with a CPU quota (``--cpus 2``, a Kubernetes CPU limit) on a larger host, that many threads meet at
every op's barrier while the kernel throttles the cgroup: a thread stopped for the rest of its quota period holds
every op up. Measured on a 2-core VM in a cgroup with a one-CPU quota (bench/bench_batch.py, the shipped model): 2
threads gave 189 tok/s at one stream and 915 at 16, one thread 422 and 1,341. So the default is the smaller of

* the CPUs the process may run on (``os.sched_getaffinity``: a ``--cpuset-cpus``, taskset), and
* the tightest CPU quota over the process's cpu cgroup and every cgroup above it (``engine/cgroups.py``): cgroup v2
  ``cpu.max`` ("<quota> <period>", "max" for none), v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1 for none),
  as quota / period CPUs, rounded down (a 1.5-CPU quota runs one thread: two would be throttled every period),

and at least 1. ``OMP_NUM_THREADS`` set in the environment, or an explicit count (``--cpu-threads``), wins.

OpenMP's thread count is per thread: a thread that runs the native ops (the engine's step thread) takes torch's count
when torch first parallelises there; ``follow_torch_threads`` makes it take it now (``Engine.step`` calls it).

OpenMP also keeps a pool of worker threads for every live thread that has run a parallel region. One idle pool left
in a live thread (a loader thread of an executor) cut the engine's 16-stream throughput by 43 % on a 2-core VM
(1,620 → 916 tok/s), where a thread that did the same work and ended cost nothing (the likely reason: with more
threads than CPUs to manage, libgomp waits at a barrier by sleeping sooner, so each of a step's parallel regions pays
for waking its workers). So one-off torch work off the engine thread (loading the model, the warm-up) runs
``on_passing_thread``: a thread that ends with it, and its pool with it.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from dgserve.engine.cgroups import controller_dirs, read_text

T = TypeVar("T")


@dataclass(frozen=True)
class CpuReading:
    """What bounds the CPUs this process may use. affinity: CPUs in its affinity mask. quota: the tightest cgroup
    CPU quota in CPUs (quota / period), None without one; cgroup: that cgroup's directory."""

    affinity: int
    quota: float | None = None
    cgroup: str | None = None

    @property
    def threads(self) -> int:
        """The default thread count: min(affinity, floor(quota)), at least 1."""
        n = self.affinity if self.quota is None else min(self.affinity, math.floor(self.quota))
        return max(1, n)

    def describe(self) -> str:
        quota = "no cgroup CPU quota" if self.quota is None else f"cgroup {self.cgroup}: CPU quota {self.quota:g}"
        return f"{self.affinity} CPUs in the affinity mask, {quota}"


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count in force and why: "flag" (an explicit count), "OMP_NUM_THREADS", or "cpus" (the
    ``CpuReading``'s default, described)."""

    threads: int
    source: str
    detail: str = ""

    def describe(self) -> str:
        return f"CPU threads: {self.threads} ({self.source}{': ' + self.detail if self.detail else ''})"


def read_cpus(root: str | Path = "/", affinity: int | None = None) -> CpuReading:
    """This process's CPU reading from the files under ``root``; ``affinity``: the CPU count of the affinity mask
    (default: ``os.sched_getaffinity(0)``'s)."""
    root = Path(root)
    if affinity is None:
        affinity = len(os.sched_getaffinity(0))
    best: tuple[float, Path] | None = None
    for d, version in controller_dirs(root, "cpu"):
        quota = _quota(d, version)
        if quota is not None and (best is None or quota < best[0]):
            best = (quota, d)
    if best is None:
        return CpuReading(affinity)
    return CpuReading(affinity, best[0], str(Path("/") / best[1].relative_to(root)))


def choose_cpu_threads(
    requested: int = 0, omp_num_threads: str | None = None, reading: CpuReading | None = None
) -> ThreadChoice:
    """The thread count for this process: ``requested`` when > 0, else torch's own when ``omp_num_threads`` (the
    environment's ``OMP_NUM_THREADS``, which torch read at start-up) is set, else ``reading``'s default
    (``read_cpus()``)."""
    if requested > 0:
        return ThreadChoice(requested, "flag")
    if omp_num_threads is not None and omp_num_threads.strip():
        return ThreadChoice(torch.get_num_threads(), "OMP_NUM_THREADS")
    reading = read_cpus() if reading is None else reading
    return ThreadChoice(reading.threads, "cpus", reading.describe())


def apply_cpu_threads(requested: int = 0, omp_num_threads: str | None = None) -> ThreadChoice:
    """Set torch's intra-op thread count as ``choose_cpu_threads`` says (process-wide; each thread takes it at its
    next torch op or ``follow_torch_threads``); returns the choice for the log."""
    choice = choose_cpu_threads(requested, omp_num_threads)
    if choice.threads != torch.get_num_threads():
        torch.set_num_threads(choice.threads)
    return choice


def follow_torch_threads() -> int:
    """Make the calling thread's OpenMP count torch's (the native ops' parallel regions use the calling thread's,
    which a new thread has at the host default until torch first parallelises there); returns it."""
    return torch.get_num_threads()


async def on_passing_thread(fn: Callable[[], T], name: str) -> T:
    """``fn()`` awaited on a new thread named ``name`` that ends when ``fn`` returns, so the OpenMP pool torch made
    for it ends too (module docstring); its exception is raised here."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():  # the awaiting task was cancelled
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done


def _quota(d: Path, version: int) -> float | None:
    """One cgroup directory's CPU quota in CPUs, None without one (or when unreadable)."""
    if version == 2:
        parts = (read_text(d / "cpu.max") or "").split()
        if len(parts) != 2 or parts[0] == "max":
            return None
        quota_s, period_s = parts
    else:
        quota_s = (read_text(d / "cpu.cfs_quota_us") or "").strip()
        period_s = (read_text(d / "cpu.cfs_period_us") or "").strip()
    try:
        quota, period = int(quota_s), int(period_s)
    except ValueError:
        return None
    if quota <= 0 or period <= 0:  # v1's -1: no quota
        return None
    return quota / period
