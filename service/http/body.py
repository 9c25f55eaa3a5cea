"""Request bodies: read with a size limit, decoded as JSON with bounded work and bounded shape.

``read_json`` reads at most the body limit (``REQUEST_TOO_LARGE`` past it) and decodes it with ``decode_body``:
at most MAX_JSON_VALUES values, MAX_JSON_DEPTH levels, and only valid Unicode (a JSON ``"\\ud800"`` escape
decodes to a lone surrogate, which no tokenizer, regex engine or UTF-8 encoder accepts), each a ValueError naming
``body`` or the field. Checking the request is then O(fields): a list is refused by its length (token ids,
messages) before its items are looked at.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import json.decoder
import json.scanner
from typing import Any, cast

from fastapi import Request

from dgserve.text.tokenizer import check_unicode

from ..errors import clip
from .errors import HttpError

INLINE_BODY_BYTES = 64 << 10  # decoded on the event loop: at most ~1 ms of json.loads, less than a thread hop
# the shape of a body: json.loads holds the GIL for its whole call (~70 ns a value), so a 16 MB body of 8 million
# small values stalled every other caller for 0.6 s even in a worker thread; a real request has a few thousand
# values (token ids and messages are bounded by the context window) and a few levels of nesting (a JSON schema's
# included), and deeper structures only end in RecursionError in json, jinja or a grammar compiler
MAX_JSON_VALUES = 1 << 18
MAX_JSON_DEPTH = 128


async def read_json(request: Request, limit: int):
    """The request's JSON body (``decode_body``: bounded values and depth, valid Unicode). A body over
    INLINE_BODY_BYTES is decoded in the one body thread: json.loads holds the GIL while it runs, so decoding two
    16 MB bodies at once would only take turns at the GIL away from the event loop; one at a time, the loop gets
    it back between bodies."""
    raw = await _read_body(request, limit)
    if len(raw) <= INLINE_BODY_BYTES:
        return decode_body(raw)
    return await asyncio.get_running_loop().run_in_executor(_body_thread(), decode_body, raw)


@functools.cache
def _body_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dgserve-body")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError("REQUEST_TOO_LARGE", f"body: {declared} bytes exceed the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError("REQUEST_TOO_LARGE", f"body: more than the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_body(raw: bytes):
    """The JSON value of a request body (UTF-8, RFC 8259). ValueError naming ``body`` when it is not UTF-8 JSON,
    has more than MAX_JSON_VALUES values or more than MAX_JSON_DEPTH levels, or naming the field whose text (or
    field name) holds a lone surrogate (``messages[0].content: ...``). Builds at most about MAX_JSON_VALUES
    values; safe in a worker thread."""
    try:
        text = raw.decode("utf-8")  # strict: json.loads(bytes) would let UTF-8-encoded surrogates through
    except UnicodeDecodeError as e:
        raise ValueError(f"body: not valid UTF-8 (byte {e.start}: {e.reason})") from None
    opens = text.count("[") + text.count("{")
    try:
        # commas and brackets bound the number of values from above (strings' own included): below the cap, the
        # fast C parser; above, the Python one, which counts as it goes and gives the GIL up between values
        value = json.loads(text) if text.count(",") + opens <= MAX_JSON_VALUES else _counted_loads(text)
    except RecursionError:
        raise ValueError(f"body: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except _TooManyValues:
        raise ValueError(f"body: more than {MAX_JSON_VALUES} JSON values") from None
    except ValueError as e:
        raise ValueError(f"body: not valid JSON ({e})") from None
    # a lone surrogate can only come from a \uD800-\uDFFF escape (the text itself is strict UTF-8)
    escapes = "\\ud" in text or "\\uD" in text
    if escapes or opens > MAX_JSON_DEPTH:
        _check_shape(value, escapes)
    return value


class _TooManyValues(Exception):
    pass


def _counted_loads(text: str):
    """json.loads with the pure-Python scanner, stopping with _TooManyValues after MAX_JSON_VALUES values."""
    count = 0

    def counted(scan_once):
        def scan(s, idx):
            nonlocal count
            count += 1
            if count > MAX_JSON_VALUES:
                raise _TooManyValues
            return scan_once(s, idx)

        return scan

    # the pure-Python parser's hooks: json.decoder / json.scanner internals (unchanged since Python 2.7, untyped)
    pure: Any = json.decoder
    decoder: Any = json.JSONDecoder()
    decoder.parse_array = lambda s_and_end, scan_once: pure.JSONArray(s_and_end, counted(scan_once))
    decoder.parse_object = lambda s_and_end, strict, scan_once, *hooks: pure.JSONObject(
        s_and_end, strict, counted(scan_once), *hooks
    )
    decoder.scan_once = cast(Any, json.scanner).py_make_scanner(decoder)
    return decoder.decode(text)


def _check_shape(value, text: bool) -> None:
    """ValueError when ``value`` nests deeper than MAX_JSON_DEPTH (naming ``body``) or, with ``text``, holds a
    string or field name that is not valid Unicode (naming its field). Iterative: no recursion on client data."""
    stack: list[tuple[object, int, tuple]] = [(value, 1, ())]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, (dict, list)) and depth > MAX_JSON_DEPTH:
            raise ValueError(f"body: nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            for key, child in item.items():
                if text and not key.isascii():  # (the field name is built only for a suspect text)
                    check_unicode(key, field_name(path), "field name")
                stack.append((child, depth + 1, (path, key)))
        elif isinstance(item, list):
            stack.extend((child, depth + 1, (path, i)) for i, child in enumerate(item))
        elif text and isinstance(item, str) and not item.isascii():
            check_unicode(item, field_name(path), "text")


def field_name(path: tuple) -> str:
    """``messages[0].content`` for the linked path ((((), "messages"), 0), "content"); ``body`` for ()."""
    keys = []
    while path:
        path, key = path
        keys.append(key)
    name = ""
    for key in reversed(keys):
        name += f"[{key}]" if isinstance(key, int) else (f".{clip(key)}" if name else clip(key))
    return name or "body"
