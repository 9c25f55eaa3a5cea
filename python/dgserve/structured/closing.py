"""A short way to end a document from a grammar state (docs/structured-output.md §11.9): the plan the sampler
steers to when the token budget is about to cut a grammar-constrained answer.

``Closer.plan(matcher, limit, where)`` looks for a token sequence that the grammar accepts from the matcher's state
and that ends with an EOS, of at most ``limit`` tokens. llguidance has no "shortest completion" query, so this is a
search over the matcher's states, fewest moves first (then fewest tokens), with these moves:

* the tokens the grammar forces (``compute_ff_tokens``): taken at no move, as the sampler commits them;
* closing strings, each one move of its canonical tokens: ``"``, ``}``, ``]``, ``"}`` and the end markers of a
  tool call and of a thought channel (text or special token, as the vocabulary has them);
* the ``BRANCH`` best single tokens the grammar allows, best first: digits and the first characters of ``true`` /
  ``false`` / ``null`` / ``[`` / ``{`` / ``-`` (a value to start), then other one-character tokens, then longer
  ones; and the longest token it allows (progress through a ``minLength`` or a fixed-length pattern).

A move after which the grammar allows the same tokens as before is no progress (more of a free string or text)
and is not taken; except a closing string where the grammar admits few tokens (``}`` closing an inner object
leaves the mask of its outer one). States are told apart by the grammar's mask and forced bytes and by where the
text stands as JSON (``scan``: inside a string or not, brackets open; the caller gives it for the text written so
far), so the same state is searched once. The search expands at most ``MAX_NODES`` states, so its work is bounded
(milliseconds). It is a heuristic: the plan is short, not always the shortest, and a grammar whose ending needs
moves it does not try gets no plan; then nothing is steered and the budget cuts the answer as before (finish
reason ``length``). It never changes what the grammar admits: every plan is consumed by the grammar as it is
searched.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from dgserve.text.gemma4 import CHANNEL_END, TOOL_CALL_END

if TYPE_CHECKING:
    import llguidance as llg

BRANCH = 4  # single-token moves tried per state
MAX_NODES = 64  # states expanded per search
CLOSING = ('"', "}", "]", '"}', TOOL_CALL_END, CHANNEL_END)
STARTS = "0123456789tfn[{-"  # one-character tokens that start a short value, best first
Scan = tuple[bool, bool, int]  # where JSON text stands: inside a string, after a backslash there, brackets open
START: Scan = (False, False, 0)


def allowed_tokens(words: np.ndarray, V: int) -> np.ndarray:
    """The token ids in [0, V) that a mask of int32 words (bit t of word t // 32: token t) allows, ascending."""
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:V])


class Closer:
    """The search for one vocabulary. tokenizer: the llguidance tokenizer; vocab_size: V; eos_ids: the tokens that
    end a document (a plan ends with the lowest one the grammar allows)."""

    def __init__(self, tokenizer: llg.LLTokenizer, vocab_size: int, eos_ids: Iterable[int]):
        self.V = vocab_size
        self.eos = sorted(int(e) for e in eos_ids)
        self.tokenizer = tokenizer
        moves = (tokenizer.tokenize_str(s, parse_special=True) for s in CLOSING)
        self.closing = [list(m) for m in dict.fromkeys(tuple(m) for m in moves if m)]
        self.rank, self.length = _ranks(tokenizer, vocab_size)  # [V] int64 each: lower rank is tried first

    def plan(self, matcher: llg.LLMatcher, limit: int, where: Scan = START) -> list[int] | None:
        """A short token sequence (at most ``limit`` tokens, the last an EOS) that the grammar accepts from
        ``matcher``'s state, or None when none was found. ``where``: the text written so far as JSON (``scan``).
        ``matcher`` is left as it was (the search works on copies)."""
        if limit <= 0:
            return None
        order = itertools.count()
        root = matcher.deep_copy()
        heap: list[tuple[int, int, int, list[int], llg.LLMatcher, Scan]] = [(0, 0, next(order), [], root, where)]
        seen = {self._key(root, where)}
        for _ in range(MAX_NODES):
            if not heap:
                return None
            moves, cost, _, path, m, at = heapq.heappop(heap)
            forced = m.compute_ff_tokens()
            if forced:  # a forced run is no decision: taken in place, at no move
                if cost + len(forced) >= limit or not m.consume_tokens(forced):
                    continue
                at = scan(at, self.tokenizer.decode_bytes(forced))
                heapq.heappush(heap, (moves, cost + len(forced), next(order), path + forced, m, at))
                continue
            words = np.frombuffer(m.compute_bitmask(), dtype=np.int32)
            eos = next((e for e in self.eos if (int(words[e >> 5]) >> (e & 31)) & 1), None)
            if eos is not None:  # popped fewest moves first: the first state that may end gives the plan
                return path + [eos]
            if cost + 1 >= limit:
                continue  # no room for one more token and the EOS
            here = self._key(m, at)
            allowed = allowed_tokens(words, self.V)
            free = 2 * allowed.size > self.V  # free text or a string: a closing string may be mere content
            for move, closing in self._moves(allowed):
                child = m.deep_copy()
                if cost + len(move) >= limit or child.try_consume_tokens(move) != len(move):
                    continue
                there = scan(at, self.tokenizer.decode_bytes(move))
                key = self._key(child, there)
                if key in seen or ((free or not closing) and key[0] == here[0]):
                    continue  # a state reached already, or a move that changed nothing the grammar sees
                seen.add(key)
                heapq.heappush(heap, (moves + 1, cost + len(move), next(order), path + move, child, there))
        return None

    def _key(self, m: llg.LLMatcher, where: Scan) -> tuple[bytes, Scan]:
        """What tells states apart: the grammar's mask and forced bytes, and where the text stands as JSON (so
        ``{"a":{"b":1`` and ``{"a":1``, alike to the mask, stay apart)."""
        return bytes(m.compute_bitmask()) + bytes(m.compute_ff_bytes()), where

    def _moves(self, allowed: np.ndarray) -> list[tuple[list[int], bool]]:
        """(move, is a closing string): the closing strings, then the BRANCH best of the ``allowed`` tokens (ids,
        ascending) and the longest."""
        if allowed.size == 0:
            return []
        longest = int(allowed[np.argmax(self.length[allowed])])
        if allowed.size > BRANCH:
            best = allowed[np.argpartition(self.rank[allowed], BRANCH)[:BRANCH]]
            allowed = best[np.argsort(self.rank[best], kind="stable")]
        singles = [int(t) for t in allowed] + ([longest] if longest not in allowed else [])
        return [(m, True) for m in self.closing] + [([t], False) for t in singles]


def scan(where: Scan, data: bytes) -> Scan:
    """Where JSON text stands after ``data``: (inside a string, after a backslash in one, brackets open)."""
    inside, escaped, depth = where
    for c in data:
        if inside:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:  # quote
                inside = False
        elif c == 0x22:
            inside = True
        elif c in b"{[":
            depth += 1
        elif c in b"}]":
            depth -= 1
    return inside, escaped, depth


def _ranks(tokenizer: llg.LLTokenizer, V: int) -> tuple[np.ndarray, np.ndarray]:
    """([V] rank, [V] length in bytes) of each token as a single-token move: STARTS in their order, then other
    one-character tokens, then longer tokens by length; special tokens last (length 0)."""
    rank = np.empty(V, dtype=np.int64)
    length = np.zeros(V, dtype=np.int64)
    for t in range(V):
        text = b"" if tokenizer.is_special_token(t) else tokenizer.decode_bytes([t])
        length[t] = len(text)
        if len(text) == 1 and chr(text[0]) in STARTS:
            rank[t] = STARTS.index(chr(text[0]))
        elif len(text) == 1:
            rank[t] = len(STARTS) + text[0]
        elif text:
            rank[t] = 1024 + len(text) * V + t
        else:
            rank[t] = 1 << 40
    return rank, length
