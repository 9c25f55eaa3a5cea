"""glibc's malloc settings for an engine that computes on the CPU (docs/memory.md, "Host allocations").

A CPU step allocates and frees the same large tensors every step (at 32 canvases of the shipped model: logits,
processed logits and probabilities of 4 MiB each, activations of 0.4-1.5 MiB). glibc serves a block above its mmap
threshold with a fresh mapping and returns memory above its trim threshold at the heap's top to the kernel; both
thresholds move with the allocation history (the "dynamic threshold"), so in some processes every step's large
tensors are new pages again, a page fault per 4 KiB on first touch: up to ~3,000 faults and ~4 ms in a 45 ms step,
in some runs and not others. ``HOST_MALLOC`` fixes both thresholds, so those blocks come from the heap and stay
there between steps: the step's working set is kept, bounded by ``trim_threshold`` of free memory at the top.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

log = logging.getLogger("dgserve.engine")

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3


@dataclass(frozen=True)
class HostMalloc:
    """mmap_threshold: bytes; blocks up to this come from the heap (32 MiB: glibc's largest, the upper limit of its
    dynamic threshold). trim_threshold: bytes of free memory at the heap's top kept rather than returned."""

    mmap_threshold: int = 32 << 20
    trim_threshold: int = 64 << 20


HOST_MALLOC = HostMalloc()


def apply_host_malloc(settings: HostMalloc = HOST_MALLOC) -> bool:
    """Set glibc's mmap and trim thresholds for this process (every thread's arena); True when glibc took both,
    False where there is no glibc ``mallopt`` (another C library: its own allocator's behaviour stands)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, settings.mmap_threshold) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, settings.trim_threshold) == 1 and ok
    if not ok:
        log.info("host malloc: mallopt refused the thresholds; glibc's dynamic ones stand")
    return ok
