"""The server's CPU threads (docs/deployment.md, "CPU threads"): a real `dgserve` process in a child of this
process's cpu cgroup with a one-CPU quota runs torch on one thread, says so at start-up, and serves;
``--cpu-threads`` overrides the quota. And the model is loaded and warmed up on threads that end with the work, so
no live thread but the engine's keeps an OpenMP pool (engine/cpu_threads.py).

Needs a cpu cgroup this process may create children in (root, v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``) and at
least two CPUs in its affinity mask (with one, one thread is the default anyway); skipped otherwise, with the reason.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest
import storm
from service_helpers import base_config, child_cgroup, running

from dgserve.engine.cpu_threads import read_cpus

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("OMP_NUM_THREADS", "").strip()), reason="OMP_NUM_THREADS is set: it decides the thread count"
)


def _one_cpu(d: Path, version: int) -> None:
    if version == 2:
        (d / "cpu.max").write_text("100000 100000")
    else:
        (d / "cpu.cfs_period_us").write_text("100000")
        (d / "cpu.cfs_quota_us").write_text("100000")


def one_cpu_cgroup():
    """A new child of this process's cpu cgroup with a quota of one CPU (``child_cgroup``)."""
    if read_cpus().affinity < 2:
        pytest.skip("one CPU in the affinity mask: one thread is the default without a quota")
    return child_cgroup("cpu", _one_cpu)


def _threads_line(srv: storm.ServerProcess) -> str:
    lines = [ln for ln in srv.lines if "CPU threads:" in ln]
    assert len(lines) == 1, srv.lines[-20:]
    return lines[0]


@pytest.mark.parametrize("extra, want", [((), 1), (("--cpu-threads", "2"), 2)])
def test_server_in_a_one_cpu_quota_runs_one_thread(model_dir, extra, want):
    with one_cpu_cgroup() as (d, _):
        srv = storm.ServerProcess(model_dir, *extra, cgroup=str(d))
        try:
            line = _threads_line(srv)
            assert re.search(rf"CPU threads: {want} \(", line), line
            if not extra:  # the quota decided, and the log names the cgroup
                assert f"{d.name}: CPU quota 1)" in line, line
            else:
                assert "(flag)" in line, line
            with storm.Client(srv.target) as c:  # and it serves
                assert c.health() == "SERVING"
        finally:
            srv.kill()


def test_model_loads_and_warms_up_on_threads_that_end(model_dir):
    """The loader and the warm-up run torch work (OpenMP pools) off the engine thread: on threads that are gone once
    the server is ready, not on an executor's thread that lives on."""
    from dgserve import Engine

    seen: list[threading.Thread] = []

    def factory():
        seen.append(threading.current_thread())
        return Engine.from_pretrained(model_dir)

    with running(base_config(model_dir, warm_up=True), engine_factory=factory) as s:
        assert s.server.state.engine is not None and len(seen) == 1
        seen[0].join(10)
        assert not seen[0].is_alive(), f"the loader thread {seen[0].name} lives on"
        names = {t.name for t in threading.enumerate()}
        assert not any(n.startswith(("dgserve-load", "dgserve-warm-up")) for n in names), names
