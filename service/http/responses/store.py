"""The Responses API's store (docs/responses-api.md): the responses created with ``store: true``, kept in memory for
``GET /v1/responses/{id}`` and ``previous_response_id``.

Per caller, for access and for space. An entry is keyed by (owner, id), so one caller's ids are unknown to every
other caller (the same answer as an id never seen). Each caller has its own least-recently-used list, bounded by
``max_entries_per_caller`` and ``max_bytes_per_caller`` (each entry's size is its JSON's length, an image part's
bytes counted by their size): a caller's put drops that caller's own least recently used first, never another's.
``max_entries`` / ``max_bytes`` bound the sum over callers; when a put would exceed them, the caller holding the
most (bytes; entries when only the entry count is over) gives up its least recently used, one at a time. That
caller always holds more than its fair share (the global bound over the number of callers holding entries: were
every caller within it, the sum would be within the bound), so a caller within its share loses nothing while
another is over it. When the putter is the largest holder it gives way first (ties too), and when all it holds
is the new response, that response is not kept (``put`` says False) rather than taken out of others' shares. A
response larger than a caller's byte cap is not kept. Nothing survives a restart.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

from ...images import stored_size


@dataclass(frozen=True)
class Stored:
    """One stored response: its body (what GET returns) and its conversation as chat messages (the input that a
    ``previous_response_id`` continues from: the earlier turns and this response's output, not its instructions)."""

    response: dict
    messages: tuple[dict, ...]
    size: int  # bytes of both as JSON


class ResponseStore:
    """The caller-scoped store, bounded per caller and in all (module doc). Used on the event loop only."""

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        max_entries_per_caller: int | None = None,
        max_bytes_per_caller: int | None = None,
    ):
        """The per-caller caps default to (and never exceed) the global ones."""
        self.max_entries, self.max_bytes = max_entries, max_bytes
        per_entries, per_bytes = max_entries_per_caller, max_bytes_per_caller
        self.caller_entries = max_entries if per_entries is None else min(per_entries, max_entries)
        self.caller_bytes = max_bytes if per_bytes is None else min(per_bytes, max_bytes)
        self._callers: dict[str | None, OrderedDict[str, Stored]] = {}  # each caller's entries, oldest use first
        self._held: dict[str | None, int] = {}  # each caller's bytes
        self._count = 0
        self.bytes = 0

    def __len__(self) -> int:
        return self._count

    def held(self, owner: str | None) -> tuple[int, int]:
        """``owner``'s (entries, bytes)."""
        return len(self._callers.get(owner, ())), self._held.get(owner, 0)

    def put(self, owner: str | None, response: dict, messages: list[dict]) -> bool:
        """Keep ``response`` (its ``id`` is the key) for ``owner``; False when it is not kept: larger than a
        caller's byte cap, or the global bound has no room for it without taking from others' shares."""
        # image parts (not JSON: their bytes) count by their byte size
        size = len(json.dumps(response, separators=(",", ":"))) + stored_size(messages)
        size += len(json.dumps(messages, separators=(",", ":"), default=lambda _: None))
        if size > self.caller_bytes or self.caller_entries == 0:
            return False
        rid = response["id"]
        self._drop(owner, rid)
        mine = self._callers.setdefault(owner, OrderedDict())
        mine[rid] = Stored(response, tuple(messages), size)
        self._held[owner] = self._held.get(owner, 0) + size
        self._count += 1
        self.bytes += size
        # the caller's own caps: its own least recently used go (never the new one, which fits them alone)
        while len(mine) > self.caller_entries or self._held[owner] > self.caller_bytes:
            self._drop(owner, next(iter(mine)))
        # the global bound: the largest holder gives way (always one above its fair share), the putter on a tie
        while self.bytes > self.max_bytes or self._count > self.max_entries:
            by_bytes = self.bytes > self.max_bytes
            victim = max(
                self._callers,
                key=lambda o: (self._held[o] if by_bytes else len(self._callers[o]), o == owner),
            )
            oldest = next(iter(self._callers[victim]))
            self._drop(victim, oldest)
            if (victim, oldest) == (owner, rid):
                return False  # all the putter holds is this response: it is not kept
        return True

    def get(self, owner: str | None, response_id: str) -> Stored | None:
        """``owner``'s stored response (now its most recently used), or None: unknown, dropped, or another's."""
        mine = self._callers.get(owner)
        if mine is None or response_id not in mine:
            return None
        mine.move_to_end(response_id)
        return mine[response_id]

    def delete(self, owner: str | None, response_id: str) -> bool:
        return self._drop(owner, response_id)

    def _drop(self, owner: str | None, response_id: str) -> bool:
        mine = self._callers.get(owner)
        entry = None if mine is None else mine.pop(response_id, None)
        if entry is None:
            return False
        self._held[owner] -= entry.size
        self._count -= 1
        self.bytes -= entry.size
        if not mine:
            del self._callers[owner], self._held[owner]
        return True
