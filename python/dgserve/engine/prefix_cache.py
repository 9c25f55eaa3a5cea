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

Memory: the blocks come out of the KV cache budget: whatever the slots leave of it (``capacity_bytes``). When a
new block does not fit, the least recently used block with no cached successor is evicted (a leaf: a prefix's
tail goes before its head, so no cached block is ever unreachable). The slots are planned first and the cache
only takes what they leave, so it never makes a request fail that would fit without it.

Not thread-safe: the engine thread calls it (``ModelRunner``), and the lookup at admission runs under the engine's
lock inside ``Scheduler.schedule``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

_ROOT = b"dgserve prefix cache v1"


def prefix_hashes(ids: Sequence[int], block_tokens: int, salt: str | None = None) -> tuple[bytes, ...]:
    """The keys of the full blocks of ``ids`` (``len(ids) // block_tokens`` of them), chained: key c names tokens
    0 .. (c + 1)·block_tokens − 1 and the salt. ``salt`` None and "" are different salts."""
    h = hashlib.blake2b(_ROOT + (b"\0" if salt is None else b"\1" + salt.encode()), digest_size=32).digest()
    out = []
    for c in range(len(ids) // block_tokens):
        chunk = array("q", ids[c * block_tokens : (c + 1) * block_tokens]).tobytes()
        h = hashlib.blake2b(h + chunk, digest_size=32).digest()
        out.append(h)
    return tuple(out)


@dataclass(eq=False)
class PrefixBlock:
    """One cached prompt chunk: per layer [nkv, block_tokens, hd] keys and values (``SlotCache.copy_out``)."""

    key: bytes
    parent: PrefixBlock | None
    keys: list[torch.Tensor] = field(repr=False)
    values: list[torch.Tensor] = field(repr=False)
    children: int = 0  # cached blocks whose parent this is: only a block without any may be evicted


class PrefixCache:
    """The cached blocks of one model runner, LRU-evicted within ``capacity_bytes``.

    block_tokens: the prefill chunk. block_bytes: one block's keys and values over every layer. Counters for
    metrics and tests: ``queried_tokens`` (prompt tokens looked up), ``hit_tokens`` (of those, found cached),
    ``evicted_blocks``.
    """

    def __init__(self, block_tokens: int, block_bytes: int, capacity_bytes: int):
        if block_tokens < 1 or block_bytes < 1:
            raise ValueError(f"prefix cache: block of {block_tokens} tokens and {block_bytes} bytes")
        self.block_tokens, self.block_bytes = block_tokens, block_bytes
        self.capacity_blocks = max(0, capacity_bytes) // block_bytes
        self._blocks: OrderedDict[bytes, PrefixBlock] = OrderedDict()  # least recently used first
        self.queried_tokens = self.hit_tokens = self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    @property
    def held_bytes(self) -> int:
        return len(self._blocks) * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.block_bytes

    def match(self, hashes: Sequence[bytes], prompt_tokens: int) -> list[PrefixBlock]:
        """The longest run of cached blocks from the start of a prompt with these block keys (``prefix_hashes``),
        marked as just used; counts ``prompt_tokens`` as queried and the run's tokens as hit."""
        run: list[PrefixBlock] = []
        for key in hashes:
            block = self._blocks.get(key)
            if block is None:
                break
            run.append(block)
        for block in reversed(run):  # the head ends most recent: it is what the most prompts share
            self._blocks.move_to_end(block.key)
        self.queried_tokens += prompt_tokens
        self.hit_tokens += len(run) * self.block_tokens
        return run

    def store(self, key: bytes, parent_key: bytes | None, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """Cache one block (its keys and values, already copied) under ``key`` after ``parent_key`` (None: the
        prompt's first block). False when it is not kept: its parent is no longer cached (it could never be
        reached), or there is no room even after evicting every other leaf. A key already cached is only marked
        as used."""
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return True
        parent = None
        if parent_key is not None:
            parent = self._blocks.get(parent_key)
            if parent is None:
                return False
        while len(self._blocks) >= self.capacity_blocks:
            if not self._evict_one(keep=parent):
                return False
        self._blocks[key] = PrefixBlock(key, parent, keys, values)
        if parent is not None:
            parent.children += 1
        return True

    def _evict_one(self, keep: PrefixBlock | None) -> bool:
        """Drop the least recently used leaf other than ``keep``; False when there is none."""
        for block in self._blocks.values():
            if block.children == 0 and block is not keep:
                del self._blocks[block.key]
                if block.parent is not None:
                    block.parent.children -= 1
                self.evicted_blocks += 1
                return True
        return False

    def clear(self) -> None:
        self._blocks.clear()
