"""The encoder's KV cache, in two layouts behind one small interface (``encode_kv`` / ``decode_kv`` / ``length``).

Sliding layers expose only the most recent W − 1 encoded positions (the DynamicCache rule, spec §3.6); full layers
expose every position. The decoder's canvas keys/values are never kept (spec §3.7).

* ``RowCache``: one request's cache as a list of growing tensors (``torch.cat`` per chunk): the simple public
  path of ``DiffusionGemma.prefill`` / ``denoise`` (tests, parity).
* ``SlotCache``: the serving layout, preallocated once per scheduler slot and written in place (``ModelRunner``).
  Full layers: [S, nkv, slot_len, hd], position p at index p. Sliding layers: a *mirrored ring* of capacity
  R = W − 1 + max(prefill chunk, C) stored twice ([S, nkv, 2R, hd]; position p at p % R and p % R + R), so any R
  consecutive positions are one contiguous slice in chronological order. The keys a pass attends to are therefore
  a view of the buffer, in exactly the order of the old ``cat([cached, new])`` (a softmax's fp32 sum depends on
  the order): no per-step concatenation, no copy proportional to the context. A denoising step writes its canvas
  K/V into the positions after the committed length (scratch: the length does not move), and the next encode
  overwrites them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from dgserve.config import ModelConfig


class KVStore(Protocol):
    """What a pass of one request needs from its cache (``RowCache`` or one slot of a ``SlotCache``)."""

    @property
    def length(self) -> int: ...  # positions encoded (P)

    def encode_kv(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, keep: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, int]: ...

    def decode_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def commit(self, n: int) -> None: ...


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

    def encode_kv(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, keep: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Append k, v [nkv, T, hd] at positions length.. → (keys, values) the chunk attends to and the position
        of keys[:, 0]. ``keep`` (W − 1 on sliding layers): positions kept after the chunk's own attention."""
        first = len(self.keys) <= layer
        n_old = 0 if first else self.keys[layer].shape[1]
        keys = k if first else torch.cat([self.keys[layer], k], dim=1)
        values = v if first else torch.cat([self.values[layer], v], dim=1)
        kept_k, kept_v = keys, values
        if keep is not None:
            start = max(0, keys.shape[1] - keep)
            kept_k, kept_v = keys[:, start:], values[:, start:]
        if first:
            self.keys.append(kept_k)
            self.values.append(kept_v)
        else:
            self.keys[layer], self.values[layer] = kept_k, kept_v
        return keys, values, self.length - n_old

    def decode_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Canvas k, v [nkv, C, hd] → everything cached followed by them (nothing is stored)."""
        if not self.keys:
            return k, v
        return torch.cat([self.keys[layer], k], dim=1), torch.cat([self.values[layer], v], dim=1)

    def commit(self, n: int) -> None:
        self.length += n


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


class SlotCache:
    """KV buffers for ``num_slots`` requests, allocated once (see the module docstring for the layout).

    slot_len: positions a full layer holds per slot (the slot's context budget). chunk: the most positions one
    pass writes (max(prefill chunk, canvas length)); it sizes the sliding rings. zero: fill the buffers with
    zeros (the batched pass reads masked, never-written entries, and 0 · NaN would poison its sums).
    """

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        slot_len: int,
        chunk: int,
        dtype: torch.dtype,
        device: torch.device,
        zero: bool = False,
    ):
        self.config, self.num_slots, self.slot_len, self.chunk = config, num_slots, slot_len, chunk
        self.window = config.sliding_window
        self.ring = config.sliding_window - 1 + chunk  # R
        self.sliding = tuple(config.is_sliding(i) for i in range(config.num_hidden_layers))
        alloc = torch.zeros if zero else torch.empty
        self.keys: list[torch.Tensor] = []  # per layer [S, nkv, cap, hd]
        self.values: list[torch.Tensor] = []
        for i, sliding in enumerate(self.sliding):
            shape = (num_slots, config.num_kv_heads(i), 2 * self.ring if sliding else slot_len, config.head_dim(i))
            self.keys.append(alloc(shape, dtype=dtype, device=device))
            self.values.append(alloc(shape, dtype=dtype, device=device))
        self.lengths = [0] * num_slots  # positions encoded per slot (host copy: plans the views)

    @staticmethod
    def bytes_per_slot(config: ModelConfig, slot_len: int, chunk: int, dtype: torch.dtype) -> int:
        ring = config.sliding_window - 1 + chunk
        size = torch.tensor([], dtype=dtype).element_size()
        n = 0
        for i in range(config.num_hidden_layers):
            cap = 2 * ring if config.is_sliding(i) else slot_len
            n += 2 * config.num_kv_heads(i) * cap * config.head_dim(i)  # keys + values
        return n * size

    def view(self, slot: int) -> SlotView:
        return SlotView(self, slot)

    def write(self, slot: int, layer: int, p0: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [nkv, T, hd] → positions p0 .. p0+T−1 of ``slot`` (both ring copies on sliding layers)."""
        T = k.shape[1]
        K, V = self.keys[layer][slot], self.values[layer][slot]
        if not self.sliding[layer]:
            if p0 + T > self.slot_len:
                raise ValueError(f"slot cache: positions up to {p0 + T} exceed the slot's {self.slot_len}")
            K[:, p0 : p0 + T], V[:, p0 : p0 + T] = k, v
            return
        R = self.ring
        if T > R:
            raise ValueError(f"slot cache: a pass of {T} positions exceeds the ring's chunk of {self.chunk}")
        j0 = p0 % R
        n1 = min(T, R - j0)  # up to the wrap point, then the rest from index 0
        for base in (0, R):
            K[:, base + j0 : base + j0 + n1], V[:, base + j0 : base + j0 + n1] = k[:, :n1], v[:, :n1]
            if n1 < T:
                K[:, base : base + T - n1], V[:, base : base + T - n1] = k[:, n1:], v[:, n1:]

    def read(self, slot: int, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [nkv, end − start, hd] of positions start .. end−1 in chronological order (no copy)."""
        if self.sliding[layer]:
            if end - start > self.ring:
                raise ValueError(f"slot cache: {end - start} positions exceed the ring of {self.ring}")
            s = start % self.ring
            return self.keys[layer][slot, :, s : s + end - start], self.values[layer][slot, :, s : s + end - start]
        return self.keys[layer][slot, :, start:end], self.values[layer][slot, :, start:end]

    def visible_start(self, layer: int, length: int) -> int:
        """First cached position the next pass sees: length − (W − 1) on sliding layers, 0 on full ones."""
        return max(0, length - (self.window - 1)) if self.sliding[layer] else 0

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s cache into ``dst`` (once, when a request leaves and the last slot fills the gap)."""
        n = self.lengths[src]
        for layer, sliding in enumerate(self.sliding):
            hi = None if sliding else n
            self.keys[layer][dst, :, :hi] = self.keys[layer][src, :, :hi]
            self.values[layer][dst, :, :hi] = self.values[layer][src, :, :hi]
        self.lengths[dst] = n

    def load_row(self, slot: int, row: RowCache) -> None:
        """Copy a RowCache into ``slot`` (the public ``denoise`` path of the batched pass)."""
        n = row.length
        for layer, (k, v) in enumerate(zip(row.keys, row.values, strict=True)):
            self.write(slot, layer, n - k.shape[1], k, v)
        self.lengths[slot] = n


class SlotView:
    """One slot of a SlotCache seen through the model's cache interface (what a pass of one request uses)."""

    def __init__(self, cache: SlotCache, slot: int):
        self.cache, self.slot = cache, slot

    @property
    def length(self) -> int:
        return self.cache.lengths[self.slot]

    def encode_kv(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, keep: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        c, p0 = self.cache, self.length
        start = c.visible_start(layer, p0)
        c.write(self.slot, layer, p0, k, v)
        keys, values = c.read(self.slot, layer, start, p0 + k.shape[1])
        return keys, values, start

    def decode_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, P = self.cache, self.length
        c.write(self.slot, layer, P, k, v)  # scratch after the committed length: the next encode overwrites it
        return c.read(self.slot, layer, c.visible_start(layer, P), P + k.shape[1])

    def commit(self, n: int) -> None:
        self.cache.lengths[self.slot] += n
