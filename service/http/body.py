"""Request bodies: read with a size limit, decoded as JSON with bounded work and bounded shape.

``read_json`` reads at most the body limit (``REQUEST_TOO_LARGE`` past it) and decodes it with the one reader of a
client's JSON (``dgserve.text.client_json``): at most MAX_VALUES values, MAX_DEPTH levels, and only valid Unicode,
each a ValueError naming ``body`` or the field. Checking the request is then O(fields): a list is refused by its
length (token ids, messages) before its items are looked at, and linear in the body's size after that.

Nothing body-sized runs on the event loop: a body over INLINE_BODY_BYTES is decoded, and then
converted (``off_loop``: its messages checked and joined into the engine's prompt), in the one body thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect

from dgserve.text import client_json

from ..body_thread import in_body_thread
from ..errors import clip
from .bounded import TIMED_OUT
from .errors import HttpError

JSON_TYPE = "application/json"
INLINE_BODY_BYTES = 64 << 10  # decoded on the event loop: at most ~1 ms of json.loads, less than a thread hop
BODY_BYTES = "body_bytes"  # the request state's size of the body read_json read (off_loop's choice)
T = TypeVar("T")


async def read_json(request: Request, limit: int):
    """The request's JSON body (``decode_body``: bounded values and depth, valid Unicode), from a request whose
    Content-Type is JSON (``check_content_type``: 415 before the body is read). A body over
    INLINE_BODY_BYTES is decoded in the one body thread: json.loads holds the GIL while it runs, so decoding two
    16 MB bodies at once would only take turns at the GIL away from the event loop; one at a time, the loop gets
    it back between bodies."""
    check_content_type(request.headers.get("content-type"))
    chunks, size = await _read_body(request, limit)
    setattr(request.state, BODY_BYTES, size)
    if size <= INLINE_BODY_BYTES:
        return decode_body(b"".join(chunks))
    return await in_body_thread(_join_and_decode, chunks)  # (even joining 16 MB is ~10 ms)


async def off_loop(request: Request, convert: Callable[..., T], *args) -> T:
    """``convert(*args)``: the work on a body ``read_json`` decoded (checking it, joining its messages, rendering
    it), in the body thread when the body was over INLINE_BODY_BYTES, so that a body-sized conversion never holds
    the event loop; on the loop for a small one (less than a thread hop). ``convert`` must be safe in a worker
    thread: it reads the body and its arguments, and nothing the loop changes."""
    if getattr(request.state, BODY_BYTES, 0) <= INLINE_BODY_BYTES:
        return convert(*args)
    return await in_body_thread(convert, *args)


def check_content_type(value: str | None) -> None:
    """HttpError UNSUPPORTED_MEDIA_TYPE (415) unless ``value`` is ``application/json``, with parameters at most
    and a charset, if any, of UTF-8. Every route that reads a JSON body checks it, so a page's text/plain, form or
    multipart POST (which a browser sends cross-origin without a preflight) is refused unread
    (docs/deployment.md, "Browsers and Host names")."""
    media, _, params = (value or "").partition(";")
    if media.strip().lower() != JSON_TYPE:
        got = "none" if value is None else repr(clip(value))
        raise HttpError("UNSUPPORTED_MEDIA_TYPE", f"Content-Type: must be {JSON_TYPE}, got {got}", "Content-Type")
    for param in params.split(";"):
        key, _, charset = param.partition("=")
        if key.strip().lower() == "charset" and charset.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise HttpError(
                "UNSUPPORTED_MEDIA_TYPE",
                f"Content-Type: JSON is UTF-8, got charset {clip(charset.strip())!r}",
                "Content-Type",
            )


async def _read_body(request: Request, limit: int) -> tuple[list[bytes], int]:
    """The body's chunks as they came, and their size in bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError("REQUEST_TOO_LARGE", f"body: {declared} bytes exceed the limit of {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HttpError("REQUEST_TOO_LARGE", f"body: more than the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or cut off by the request timeout (which has answered 408: bounded.py)
        if getattr(request.state, TIMED_OUT, False):
            raise HttpError("REQUEST_TIMEOUT", "body: not complete within the request timeout") from None
        raise HttpError("CLIENT_CLOSED", "body: the client closed the connection before sending it all") from None
    return chunks, size


def _join_and_decode(chunks: list[bytes]):
    return decode_body(b"".join(chunks))


def decode_body(raw: bytes):
    """The JSON value of a request body (``client_json.loads`` with the BODY limits): ValueError naming ``body``
    when it is not UTF-8 JSON or is too big or too deep, or naming the field whose text (or field name) holds a
    lone surrogate (``messages[0].content: ...``). Safe in a worker thread."""
    return client_json.loads(raw, client_json.BODY)
