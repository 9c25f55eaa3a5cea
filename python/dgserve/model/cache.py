"""The encoder's KV cache: ``SlotCache`` holds the keys/values of a fixed number of rows (slots), written in
place; ``SlotView`` is one slot seen as the cache of one row's passes (``length`` / ``encode_kv`` /
``cached_kv`` / ``commit``). One layout serves both users:

* the ModelRunner: one slot per scheduler slot, preallocated once from the KV cache budget;
* the public ``DiffusionGemma.prefill`` / ``denoise``: one slot per batch row, created by ``prefill`` and grown
  in place (``reserve``: reallocate and copy) when a pass would not fit.

Sliding layers expose only the most recent W − 1 encoded positions (transformers' DynamicCache rule); full layers
expose every position. The decoder's canvas keys/values are never kept (docs/generation.md).

Full layers: [S, nkv, slot_len, hd], position p at index p. Sliding layers: a *mirrored ring* of capacity
R = W − 1 + chunk (chunk: the most positions one pass writes) stored twice ([S, nkv, 2R, hd]; position p at
p % R and p % R + R), so any R consecutive positions are one contiguous slice in chronological order. The keys a
pass attends to are therefore a view of the buffer, in exactly the order of a concatenation ``cat([cached, new])``
(a softmax's fp32 sum depends on the order): no per-step concatenation, no copy proportional to the context. A
denoising step reads the cached view (``cached_kv``) and its canvas's K/V where the projections left them
(``ops.decode_attention``); the accelerators' batched pass (model/batched.py) writes its canvas K/V into the
positions after the committed length instead (scratch: the length does not move, and the next encode overwrites
them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dgserve.config import ModelConfig


class SlotCache:
    """KV buffers for ``num_slots`` rows, allocated at once (see the module docstring for the layout).

    slot_len: positions a full layer holds per slot (the slot's context budget). chunk: the most positions one
    pass writes (max(prefill chunk, canvas length)); it sizes the sliding rings. zero: fill the buffers with
    zeros (the batched pass reads masked, never-written entries, and 0 · NaN would poison its sums).
    lengths[s]: positions encoded in slot s (a host list: it plans the views).
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
        self.config, self.num_slots, self.dtype, self.device, self.zero = config, num_slots, dtype, device, zero
        self.window = config.sliding_window
        self.sliding = tuple(config.is_sliding(i) for i in range(config.num_hidden_layers))
        self._allocate(slot_len, chunk)
        self.lengths = [0] * num_slots

    def _allocate(self, slot_len: int, chunk: int) -> None:
        self.slot_len, self.chunk = slot_len, chunk
        self.ring = self.window - 1 + chunk  # R
        alloc = torch.zeros if self.zero else torch.empty
        self.keys: list[torch.Tensor] = []  # per layer [S, nkv, cap, hd]
        self.values: list[torch.Tensor] = []
        for i, sliding in enumerate(self.sliding):
            cap = 2 * self.ring if sliding else slot_len
            shape = (self.num_slots, self.config.num_kv_heads(i), cap, self.config.head_dim(i))
            self.keys.append(alloc(shape, dtype=self.dtype, device=self.device))
            self.values.append(alloc(shape, dtype=self.dtype, device=self.device))

    @staticmethod
    def bytes_per_slot(config: ModelConfig, slot_len: int, chunk: int, dtype: torch.dtype) -> int:
        ring = config.sliding_window - 1 + chunk
        per_position = SlotCache.layer_position_bytes(config, dtype)
        return sum(b * (2 * ring if config.is_sliding(i) else slot_len) for i, b in enumerate(per_position))

    @staticmethod
    def layer_position_bytes(config: ModelConfig, dtype: torch.dtype) -> list[int]:
        """Per layer, the bytes of one position's keys and values (what a prefix block holds per token)."""
        size = torch.tensor([], dtype=dtype).element_size()
        return [2 * config.num_kv_heads(i) * config.head_dim(i) * size for i in range(config.num_hidden_layers)]

    @staticmethod
    def position_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of one position's keys and values over every layer."""
        return sum(SlotCache.layer_position_bytes(config, dtype))

    @classmethod
    def stack(cls, caches: Sequence[SlotCache]) -> SlotCache:
        """A new cache holding the slots of ``caches`` in order, copied, each with its own length: a batch of
        rows from different requests (of different lengths) for ``DiffusionGemma.denoise``."""
        if not caches:
            raise ValueError("SlotCache.stack needs at least one cache")
        c0 = caches[0]
        n = sum(c.num_slots for c in caches)
        slot_len, chunk = max(c.slot_len for c in caches), max(c.chunk for c in caches)
        out = cls(c0.config, n, slot_len, chunk, c0.dtype, c0.device, zero=True)
        dst = 0
        for c in caches:
            for s in range(c.num_slots):
                out.load(c, s, dst)
                dst += 1
        return out

    def view(self, slot: int) -> SlotView:
        return SlotView(self, slot)

    def layer_lengths(self, slot: int) -> list[int]:
        """Per layer, the cached positions the next pass of ``slot`` sees: the last W − 1 on sliding layers,
        all on full ones (the per-layer lengths of transformers' DynamicCache)."""
        n = self.lengths[slot]
        return [n - self.visible_start(layer, n) for layer in range(len(self.sliding))]

    def reserve(self, end: int, chunk: int) -> None:
        """Make every slot able to hold positions below ``end`` and passes of ``chunk`` positions: when the
        buffers are too small, reallocate them (at least doubling ``slot_len``) and copy what each slot's next
        pass sees. The object (and its views) stay valid; used by the public prefill/denoise, never by serving."""
        if end <= self.slot_len and chunk <= self.chunk:
            return
        slot_len = max(end, 2 * self.slot_len) if end > self.slot_len else self.slot_len
        grown = SlotCache(
            self.config, self.num_slots, slot_len, max(chunk, self.chunk), self.dtype, self.device, self.zero
        )
        for s in range(self.num_slots):
            grown.load(self, s, s)
        self.slot_len, self.chunk, self.ring = grown.slot_len, grown.chunk, grown.ring
        self.keys, self.values = grown.keys, grown.values

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

    def cached_span(self, slot: int, layer: int) -> tuple[int, int, int]:
        """(slot, index, count): what the next pass of ``slot`` sees on ``layer`` (``SlotView.cached_kv``) as positions
        index .. index + count − 1 of the layer's buffers (``keys[layer][slot]``), for ``ops.decode_attention``."""
        n = self.lengths[slot]
        start = self.visible_start(layer, n)
        return slot, start % self.ring if self.sliding[layer] else start, n - start

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

    def load(self, other: SlotCache, src: int, dst: int) -> None:
        """Copy slot ``src`` of ``other`` (a cache of the same model, any slot_len and chunk) into ``dst``: the
        positions its next pass sees, at the same positions (ring indices follow this cache's ring)."""
        n = other.lengths[src]
        for layer in range(len(self.sliding)):
            start = other.visible_start(layer, n)
            k, v = other.read(src, layer, start, n)
            self.write(dst, layer, start, k, v)
        self.lengths[dst] = n

    def copy_out(
        self, slot: int, start: int, end: int, copy: bool = True
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of positions start .. end−1 of ``slot`` on every layer: (keys, values), each a per-layer list of
        [nkv, end − start, hd] tensors. The positions must still be held (on sliding layers: within the ring).
        ``copy`` False: views (``read``), for a caller that copies them before the slot changes."""
        keys, values = [], []
        for layer in range(len(self.sliding)):
            k, v = self.read(slot, layer, start, end)
            keys.append(k.clone() if copy else k)
            values.append(v.clone() if copy else v)
        return keys, values

    def copy_in(
        self,
        slot: int,
        blocks: Sequence[tuple[Sequence[torch.Tensor | None], Sequence[torch.Tensor | None]]],
        block_len: int,
    ) -> None:
        """Fill ``slot`` with a prefix given as consecutive blocks of ``block_len`` positions from 0 (each as
        ``copy_out`` returns it) and set its length to their total: full layers get every position, sliding layers
        only the blocks that hold the last W − 1 positions (all the next pass sees); a sliding layer's entry may be
        None in the blocks before those."""
        n = len(blocks) * block_len
        for c, (keys, values) in enumerate(blocks):
            p0 = c * block_len
            for layer, sliding in enumerate(self.sliding):
                if sliding and p0 + block_len <= self.visible_start(layer, n):
                    continue
                k, v = keys[layer], values[layer]
                if k is None or v is None:
                    raise ValueError(f"slot cache: block {c} lacks layer {layer}, which a prefix of {n} needs")
                self.write(slot, layer, p0, k, v)
        self.lengths[slot] = n


class SlotView:
    """One slot of a SlotCache seen as one row's cache: what ``DiffusionGemma.encode_row`` / ``decode_row`` use."""

    def __init__(self, cache: SlotCache, slot: int):
        self.cache, self.slot = cache, slot

    @property
    def length(self) -> int:
        """Positions encoded (P)."""
        return self.cache.lengths[self.slot]

    def encode_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Write k, v [nkv, T, hd] at positions length.. → (keys, values) the chunk attends to, chronological
        (cached then new), and the position of keys[:, 0]."""
        c, p0 = self.cache, self.length
        start = c.visible_start(layer, p0)
        c.write(self.slot, layer, p0, k, v)
        keys, values = c.read(self.slot, layer, start, p0 + k.shape[1])
        return keys, values, start

    def cached_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [nkv, P_vis, hd] of what the next pass sees of this slot on ``layer`` (the last W − 1 positions on
        sliding layers, all on full ones), chronological; the decoder attends to them, then to its canvas's."""
        c, P = self.cache, self.length
        return c.read(self.slot, layer, c.visible_start(layer, P), P)

    def commit(self, n: int) -> None:
        self.cache.lengths[self.slot] += n
