"""The KV cache budget (``--kv-cache-memory``): configuration as data, no torch (the service's flags parse it).

The ``ModelRunner`` turns it into a number of cache slots: as many requests of ``max_model_len`` positions as the
budget holds (at most ``max_num_seqs``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_CACHE_FRACTION = 0.9  # of the free device memory (CUDA) or of the available memory (CPU)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache budget: ``memory`` bytes, or None for ``fraction`` of the free memory at start-up."""

    memory: int | None = None
    fraction: float = DEFAULT_CACHE_FRACTION

    def __post_init__(self) -> None:
        if self.memory is not None and (isinstance(self.memory, bool) or self.memory < 1):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.memory!r}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"kv_cache_memory fraction must be in (0, 1], got {self.fraction!r}")

    @classmethod
    def parse(cls, text: str) -> CacheConfig:
        """ "2GiB", "512MB", "1000000" (bytes) or "0.5" (a fraction of free memory) → CacheConfig; ValueError."""
        t = text.strip().lower()
        if re.fullmatch(r"0?\.\d+|1(\.0*)?", t):
            return cls(fraction=float(t))
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]i?b|b)?", t)
        if m is None:
            raise ValueError(f"kv_cache_memory: expected bytes such as 2GiB or 512MB, or a fraction, got {text!r}")
        return cls(memory=int(float(m.group(1)) * _UNITS[m.group(2) or ""]))


def kv_cache_memory(text: str) -> CacheConfig:
    """The flag's parser: ``CacheConfig.parse``."""
    return CacheConfig.parse(text)
