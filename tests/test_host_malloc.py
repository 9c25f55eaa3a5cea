"""glibc's malloc thresholds for a CPU engine (dgserve.engine.host_malloc; docs/memory.md, "Host allocations").

Each check runs in a fresh interpreter (the settings are per process) and reads where glibc put a block: a block
inside the ``[heap]`` mapping of /proc/self/maps came from the heap, one outside it from its own mapping."""

from __future__ import annotations

import json
import pathlib
import platform
import subprocess
import sys

import pytest

SMALL = pathlib.Path(__file__).resolve().parents[1] / "python" / "dgserve" / "models" / "small"

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt"
)

PROBE = r"""
import json, sys, torch
def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            a, b = (int(v, 16) for v in line.split()[0].split("-"))
            return a, b
    return 0, 0
if sys.argv[1] == "engine":
    from dgserve import Engine
    Engine.from_pretrained(sys.argv[2], max_model_len=64)
block = torch.empty(4 << 20, dtype=torch.uint8)  # a 4 MiB block, the size of a 32-canvas step's logits
start, end = block.data_ptr(), block.data_ptr() + block.numel()
a, b = heap()
inside = a <= start and end <= b
block.fill_(1)
del block
a, b = heap()  # a trimmed heap ends below the freed block's end
print(json.dumps({"from_heap": inside, "kept_after_free": inside and a <= start and end <= b}))
"""


def _probe(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cpu_engine_keeps_large_blocks_in_the_heap():
    """glibc's defaults map a fresh 4 MiB block on its own (and unmap it when freed); after a CPU engine is built
    the block comes from the heap and its pages stay there when it is freed."""
    assert _probe("plain") == {"from_heap": False, "kept_after_free": False}
    assert _probe("engine", str(SMALL)) == {"from_heap": True, "kept_after_free": True}


def test_apply_reports_that_glibc_took_the_settings():
    from dgserve.engine.host_malloc import HOST_MALLOC, apply_host_malloc

    assert apply_host_malloc(HOST_MALLOC) is True
