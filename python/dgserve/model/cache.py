"""The encoder's KV cache: per request row, per layer, keys and values in the model dtype.

Sliding layers keep only the most recent W − 1 encoded positions (the DynamicCache rule, spec §3.6);
full layers keep every position. The decoder reads the cache and never writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RowCache:
    """One request's cache. keys[l], values[l]: [nkv_l, T_l, hd_l] in md; length: tokens encoded so far (P)."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0

    def layer_len(self, layer: int) -> int:
        return self.keys[layer].shape[1] if self.keys else 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass
class KVCache:
    """A batch of row caches (one per request row). Rows are independent: batching rows from different
    requests is just listing their RowCaches together, so a row's result never depends on its neighbours."""

    rows: list[RowCache]

    @property
    def lengths(self) -> list[int]:
        return [r.length for r in self.rows]

    def select(self, indices: list[int]) -> KVCache:
        return KVCache([self.rows[i] for i in indices])
