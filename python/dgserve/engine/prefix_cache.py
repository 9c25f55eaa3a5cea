"""Prefix caching: the encoder KV of prompt prefixes, kept after their request ends and copied into the slot of a
later request whose prompt starts with the same tokens, so that only the rest of its prompt is encoded
(docs/prefix-caching.md).

Granularity is the prefill chunk. A prompt is encoded in chunks of ``prefill_chunk`` tokens from position 0, and a
chunk's keys and values depend on its shape (a GEMM's rounding depends on its row count: docs/exactness.md), so a
request may only reuse whole chunks of its own chunking: then every chunk it encodes has the boundaries and the
inputs it would have had without reuse, and its tokens are the same bit for bit. One cached *block* is one full
prompt chunk: its keys and values on every layer (full and sliding), copied out of the slot right after the
chunk is encoded. A prompt's last, partial chunk is never cached.

Blocks are named by a chained hash (``prefix_hashes``): block c's key is BLAKE2b-256 of block c − 1's key and block
c's token ids, starting from a root that holds the *salt*, the caller's identity when the server authenticates
callers. A key thus names the whole prefix up to its block, and callers with different identities never share a
block (reuse across callers would tell one caller, by timing and by ``cached_tokens``, what another sent).

Memory: the blocks come out of the KV cache budget: whatever the slots leave of it (``capacity_bytes``). Restoring a
prefix of P tokens needs the sliding layers' keys and values only for the positions P − (W − 1) .. P − 1, so a
block deep inside a cached prefix needs its sliding part only if some prompt ends right there. Under pressure the
cache therefore frees memory from the least recently used block first: a leaf (no cached successor) is evicted
whole, any other block drops its sliding part and keeps its full layers (a prefix's tail goes before its head, so
no cached block is ever unreachable). A match ends at the longest run of cached blocks whose last W − 1 positions
still have their sliding part. The slots are planned first and the cache only takes what they leave, so it never
makes a request fail that would fit without it. In host memory it also yields to the process's other memory (the
``room`` it reads before each store: the container's limit less its usage), and each block lives in memory maps of
its own, so what it frees goes back to the system (``own_pages``).

Not thread-safe: the engine thread calls it (``ModelRunner``), and the lookup at admission runs under the engine's
lock inside ``Engine.step`` (between ``Scheduler.admit`` and ``Scheduler.plan``).
"""

from __future__ import annotations

import hashlib
import json
import mmap
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

_ROOT = b"dgserve prefix cache v1"


MAX_CACHE_SALT_LENGTH = 256
MAX_MAPPED_BLOCKS = 12_000  # blocks kept in maps of their own: 24,000 maps, well under Linux's default 65,530


def cache_salt(owner: str | None, salt: str | None) -> str | None:
    """The prefix-cache salt of a request: its caller's identity and the salt it chose (vLLM's ``cache_salt``), or
    None when it has neither. ValueError naming ``cache_salt`` when the chosen salt is empty or too long."""
    if salt is not None:
        if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_LENGTH:
            raise ValueError(f"cache_salt: must be a string of 1 to {MAX_CACHE_SALT_LENGTH} characters")
    if owner is None and salt is None:
        return None
    return json.dumps([owner, salt])


def prefix_hashes(
    ids: Sequence[int],
    block_tokens: int,
    salt: str | None = None,
    images: Sequence[tuple[int, int, bytes]] = (),
) -> tuple[bytes, ...]:
    """The keys of the full blocks of ``ids`` (``len(ids) // block_tokens`` of them), chained: key c names tokens
    0 .. (c + 1)·block_tokens − 1 and the salt. ``salt`` None and "" are different salts. ``images``: (start,
    end, digest) of each image's placeholders: a block that holds any of an image's placeholders also names its
    digest, so the same placeholders with other pixels never share KV (docs/images.md)."""
    h = hashlib.blake2b(_ROOT + (b"\0" if salt is None else b"\1" + salt.encode()), digest_size=32).digest()
    out = []
    for c in range(len(ids) // block_tokens):
        lo, hi = c * block_tokens, (c + 1) * block_tokens
        chunk = array("q", ids[lo:hi]).tobytes()
        chunk += b"".join(b"\2" + d for s, e, d in images if s < hi and e > lo)
        h = hashlib.blake2b(h + chunk, digest_size=32).digest()
        out.append(h)
    return tuple(out)


def own_pages(
    keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], sliding: Sequence[bool]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copies of a block's host tensors in two anonymous memory maps, one for its full layers and one for its
    sliding layers, each freed (its pages unmapped) when the last tensor viewing it goes.

    Why: the blocks are the one long-lived allocation whose count churns. Copies made by ``malloc`` leave holes in
    its heap when evicted; other allocations split the holes, the next blocks take fresh memory, and the process
    grows with no bound although the cache stays within its capacity. A block in maps of its own gives its pages
    back on eviction, and the sliding part on its own gives its pages back when it is dropped."""
    out_k: list[torch.Tensor] = list(keys)
    out_v: list[torch.Tensor] = list(values)
    for group in (True, False):
        layers = [i for i, s in enumerate(sliding) if bool(s) == group]
        parts = [t for i in layers for t in (keys[i], values[i])]
        if not parts:
            continue
        private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # as malloc maps a large block (not shared memory)
        buf = torch.frombuffer(mmap.mmap(-1, sum(t.nbytes for t in parts), flags=private), dtype=torch.uint8)
        off = 0
        for i in layers:
            for out, t in ((out_k, keys[i]), (out_v, values[i])):
                view = buf[off : off + t.nbytes].view(t.dtype).view(t.shape)
                view.copy_(t)
                out[i] = view
                off += t.nbytes
    return out_k, out_v


@dataclass(frozen=True)
class PrefixCacheStats:
    """What the prefix cache holds (for metrics): bytes held and the capacity, the blocks cached, the blocks
    evicted whole and the blocks that dropped their sliding part, since start."""

    held_bytes: int
    capacity_bytes: int
    blocks: int
    evicted_blocks: int
    dropped_sliding: int


KV = tuple[list[torch.Tensor | None], list[torch.Tensor | None]]  # per layer keys, values; None: dropped


@dataclass(eq=False)
class PrefixChunk:
    """One cached prompt chunk: per layer [nkv, block_tokens, hd] keys and values (``SlotCache.copy_out``); the
    sliding layers' entries are None once ``sliding`` is dropped."""

    key: bytes
    parent: PrefixChunk | None
    keys: list[torch.Tensor | None] = field(repr=False)
    values: list[torch.Tensor | None] = field(repr=False)
    sliding: bool = True  # the sliding layers' keys and values are held
    children: int = 0  # cached blocks whose parent this is: only a block without any may be evicted


class PrefixCache:
    """The cached blocks of one model runner, within ``capacity_bytes`` (see the module docstring).

    block_tokens: the prefill chunk. layer_bytes[l]: one block's keys and values on layer l. sliding[l]: layer l
    is a sliding-window layer (window W). page_backed (host memory): each stored block is copied into memory maps
    of its own (``own_pages``), so what eviction frees goes back to the system. room: the bytes the process may
    still take (``memory_room.room_reader``), read before each store: blocks are freed until storing leaves it
    ``min_room`` (None: capacity alone bounds the cache). Counters for metrics and tests:
    ``queried_tokens`` (prompt tokens looked up), ``hit_tokens`` (of those, found cached), ``evicted_blocks``,
    ``dropped_sliding`` (blocks that gave up their sliding part).
    """

    def __init__(
        self,
        block_tokens: int,
        layer_bytes: Sequence[int],
        sliding: Sequence[bool],
        window: int,
        capacity_bytes: int,
        page_backed: bool = False,
        room: Callable[[], int | None] | None = None,
        min_room: int = 0,
    ):
        if block_tokens < 1 or not layer_bytes or len(layer_bytes) != len(sliding) or min(layer_bytes) < 1:
            raise ValueError(f"prefix cache: block of {block_tokens} tokens, layer bytes {list(layer_bytes)}")
        self.block_tokens, self.window = block_tokens, window
        self.sliding_layers = tuple(bool(x) for x in sliding)
        self.block_bytes = sum(layer_bytes)  # a whole block
        self.sliding_bytes = sum(b for b, s in zip(layer_bytes, self.sliding_layers, strict=True) if s)
        self.capacity_bytes = max(0, capacity_bytes)
        self.page_backed = page_backed
        self.room, self.min_room = room, min_room
        self.held_bytes = 0
        self._blocks: OrderedDict[bytes, PrefixChunk] = OrderedDict()  # least recently used first
        self.queried_tokens = self.hit_tokens = self.evicted_blocks = self.dropped_sliding = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def touch(self, key: bytes) -> bool:
        """Mark a cached block as just used; False when ``key`` is not cached."""
        if key not in self._blocks:
            return False
        self._blocks.move_to_end(key)
        return True

    def _first_needed(self, end: int) -> int:
        """The first block whose sliding part a prefix of ``end`` blocks needs (the one holding P − (W − 1))."""
        return max(0, end * self.block_tokens - (self.window - 1)) // self.block_tokens

    def match(self, hashes: Sequence[bytes], prompt_tokens: int) -> list[KV]:
        """The keys and values of the longest run of cached blocks from the start of a prompt with these block keys
        (``prefix_hashes``) that a slot can be restored from, marked as just used; counts ``prompt_tokens`` as
        queried and the run's tokens as hit."""
        run: list[PrefixChunk] = []
        for key in hashes:
            block = self._blocks.get(key)
            if block is None:
                break
            run.append(block)
        end = len(run)
        if self.sliding_bytes:  # the run must end where the last W − 1 positions still have their sliding part
            while end and not all(b.sliding for b in run[self._first_needed(end) : end]):
                end -= 1
        run = run[:end]
        for block in reversed(run):  # the head ends most recent: it is what the most prompts share
            self._blocks.move_to_end(block.key)
        self.queried_tokens += prompt_tokens
        self.hit_tokens += end * self.block_tokens
        return [(list(b.keys), list(b.values)) for b in run]

    def store(self, key: bytes, parent_key: bytes | None, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """Cache one block (its keys and values, already copied) under ``key`` after ``parent_key`` (None: the
        prompt's first block). False when it is not kept: its parent is no longer cached (it could never be
        reached), or there is no room even after freeing what may be freed. A key already cached is only marked
        as used."""
        if self.touch(key):
            return True
        parent = None
        if parent_key is not None:
            parent = self._blocks.get(parent_key)
            if parent is None:
                return False
        if not self._make_room(keep=parent):
            return False
        if self.page_backed:  # the runner passed views of its slot: copy them
            keys, values = self._copy(keys, values)
        self._blocks[key] = PrefixChunk(key, parent, list(keys), list(values))
        self.held_bytes += self.block_bytes
        if parent is not None:
            parent.children += 1
        return True

    def _copy(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        """A block's own copies: in maps of its own (``own_pages``) while the process's map count allows (two
        maps a block, at most ``MAX_MAPPED_BLOCKS`` blocks), else ordinary copies."""
        if len(self._blocks) < MAX_MAPPED_BLOCKS:
            try:
                return own_pages(keys, values, self.sliding_layers)
            except OSError:  # out of maps (vm.max_map_count) or address space: an ordinary copy still works
                pass
        return [k.clone() for k in keys], [v.clone() for v in values]

    def _free_some(self, keep: PrefixChunk | None) -> int:
        """Free memory from the least recently used block that has some to give: evict it if it is a leaf (other
        than ``keep``), else drop its sliding part. The bytes freed; 0 when nothing can be freed."""
        for block in self._blocks.values():
            if block.children == 0 and block is not keep:
                del self._blocks[block.key]
                freed = self.block_bytes if block.sliding else self.block_bytes - self.sliding_bytes
                self.held_bytes -= freed
                if block.parent is not None:
                    block.parent.children -= 1
                self.evicted_blocks += 1
                return freed
            if block.sliding and self.sliding_bytes:
                block.keys = [None if s else k for k, s in zip(block.keys, self.sliding_layers, strict=True)]
                block.values = [None if s else v for v, s in zip(block.values, self.sliding_layers, strict=True)]
                block.sliding = False
                self.held_bytes -= self.sliding_bytes
                self.dropped_sliding += 1
                return self.sliding_bytes
        return 0

    def _make_room(self, keep: PrefixChunk | None) -> bool:
        """Free blocks until one more fits the capacity and, with ``room``, leaves the process ``min_room`` bytes
        (one reading of the room; freed maps go back at once). False when that cannot be done."""
        while self.held_bytes + self.block_bytes > self.capacity_bytes:
            if not self._free_some(keep):
                return False
        room = self.room() if self.room is not None else None
        if room is None:
            return True
        short = self.min_room + self.block_bytes - room
        while short > 0:
            freed = self._free_some(keep)
            if not freed:
                return False
            short -= freed
        return True

    def clear(self) -> None:
        self._blocks.clear()
        self.held_bytes = 0
