"""The Responses API's store (docs/responses-api.md): the responses created with ``store: true``, kept in memory for
``GET /v1/responses/{id}`` and ``previous_response_id``.

Bounded: at most ``max_entries`` responses and ``max_bytes`` of them (each entry's size is its JSON's length), the
least recently used dropped first; a response larger than ``max_bytes`` alone is not kept. Scoped by caller as
request ids are: an entry is keyed by (owner, id), so one caller's ids are unknown to every other caller (the same
answer as an id never seen). Nothing survives a restart.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

from ..images import stored_size


@dataclass(frozen=True)
class Stored:
    """One stored response: its body (what GET returns) and its conversation as chat messages (the input that a
    ``previous_response_id`` continues from: the earlier turns and this response's output, not its instructions)."""

    response: dict
    messages: tuple[dict, ...]
    size: int  # bytes of both as JSON


class ResponseStore:
    """The bounded, caller-scoped LRU store (module doc). Used on the event loop only."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[tuple[str | None, str], Stored] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, owner: str | None, response: dict, messages: list[dict]) -> bool:
        """Keep ``response`` (its ``id`` is the key) for ``owner``; False when it is larger than the whole store."""
        # image parts (not JSON: their bytes) count by their byte size
        size = len(json.dumps(response, separators=(",", ":"))) + stored_size(messages)
        size += len(json.dumps(messages, separators=(",", ":"), default=lambda _: None))
        if size > self.max_bytes or self.max_entries == 0:
            return False
        key = (owner, response["id"])
        self._drop(key)
        self._entries[key] = Stored(response, tuple(messages), size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, owner: str | None, response_id: str) -> Stored | None:
        """``owner``'s stored response (now the most recently used), or None: unknown, dropped, or another's."""
        entry = self._entries.get((owner, response_id))
        if entry is not None:
            self._entries.move_to_end((owner, response_id))
        return entry

    def delete(self, owner: str | None, response_id: str) -> bool:
        return self._drop((owner, response_id))

    def _drop(self, key: tuple[str | None, str]) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
