"""The one reader of a client's JSON: request bodies, string fields that hold JSON (a tool call's ``arguments``, a
``response_format`` or tool schema, gRPC's ``parameters_json``) — decoded with bounded work and bounded shape.

``loads(text, field, ...)`` refuses, each with a ValueError whose message starts with the field (so both doors
report it as 400 / INVALID_ARGUMENT naming it; docs/structured-output.md, "Bounds"):

* text over ``max_bytes`` (UTF-8), or bytes that are not strict UTF-8;
* text that is not JSON (RFC 8259);
* more than ``max_values`` values: ``json.loads`` holds the GIL for its whole call (~70 ns a value), so 8 million
  small values would stall every other caller for 0.6 s; a real request has a few thousand;
* more than ``max_depth`` levels of nesting (``[]`` is one level): deeper structures only end in RecursionError in
  json itself (about 1,000 levels), in jinja, in ``json.dumps`` or in a grammar compiler. The C parser's own
  RecursionError is caught here, and the depth of what it built is measured without recursion;
* a string or field name that is not valid Unicode: a ``"\\ud800"`` escape decodes to a lone surrogate, which no
  tokenizer, regex engine or UTF-8 encoder accepts. The message names the field inside the value
  (``messages[0].content``, ``…function.arguments.city``).

Pure Python, no dgserve imports: every layer may use it.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
from typing import Any, cast

BODY = "body"  # the field of a whole request body: fields inside it are named from its top (``messages[0]``)
MAX_DEPTH = 128  # a request's data (bodies, tool call arguments); a JSON schema's included
MAX_VALUES = 1 << 18  # values in one document
MAX_KEY_ECHO = 80  # characters of a field name an error message quotes


class InvalidJSONError(ValueError):
    """Text that is not JSON at all (as opposed to JSON over a limit): a caller may keep such text as text."""


def loads(
    text: str | bytes,
    field: str = BODY,
    *,
    max_bytes: int | None = None,
    max_depth: int = MAX_DEPTH,
    max_values: int = MAX_VALUES,
    what: str = "JSON",
) -> Any:
    """The JSON value of ``text`` from a client (module doc), or ValueError naming ``field`` (``what`` names the
    value in the depth message, e.g. "schema"). ``bytes`` are decoded as strict UTF-8 first. Builds at most about
    ``max_values`` values and never recurses on the value; safe in a worker thread."""
    if isinstance(text, bytes):
        if max_bytes is not None and len(text) > max_bytes:
            raise ValueError(f"{field}: {len(text)} bytes; at most {max_bytes} are allowed")
        try:
            text = text.decode("utf-8")  # strict: json.loads(bytes) would let UTF-8-encoded surrogates through
        except UnicodeDecodeError as e:
            raise ValueError(f"{field}: not valid UTF-8 (byte {e.start}: {e.reason})") from None
    else:
        check_unicode(text, field)
        if max_bytes is not None and len(text) > max_bytes // 4:  # (a character is at most 4 UTF-8 bytes)
            n = len(text.encode())
            if n > max_bytes:
                raise ValueError(f"{field}: {n} bytes; at most {max_bytes} are allowed")
    opens = text.count("[") + text.count("{")
    too_deep = f"{field}: {what} nests too deep; at most {max_depth} levels are allowed"
    try:
        # commas and brackets bound the number of values from above (strings' own included): below the cap, the
        # fast C parser; above, the Python one, which counts as it goes and gives the GIL up between values
        small = text.count(",") + opens <= max_values
        value = json.loads(text) if small else _counted_loads(text, max_values)
    except RecursionError:
        raise ValueError(too_deep) from None
    except _TooManyValues:
        raise ValueError(f"{field}: more than {max_values} JSON values") from None
    except ValueError as e:
        raise InvalidJSONError(f"{field}: not valid JSON ({e})") from None
    # a lone surrogate can only come from a \uD800-\uDFFF escape (the text itself is valid Unicode)
    escapes = "\\ud" in text or "\\uD" in text
    if escapes or opens > max_depth:
        _check_shape(value, field, max_depth, escapes, too_deep)
    return value


def check_unicode(text: str, field: str, what: str = "") -> None:
    """ValueError naming ``field`` when ``text`` holds a lone surrogate (a str can, e.g. from a JSON "\\ud800"
    escape; it has no UTF-8 form, so a tokenizer, a regex engine or a log line would fail on it). ``what`` names
    the text within the field when that is not plain (e.g. "field name")."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{field}: {f'{what} is ' if what else ''}not valid Unicode (lone surrogate U+{ord(text[e.start]):04X} "
            f"at character {e.start})"
        ) from None


def field_name(field: str, path: tuple) -> str:
    """The name of the value at the linked ``path`` (((((), "messages"), 0), "content")) inside ``field``:
    ``messages[0].content`` inside BODY, ``x.arguments.city`` inside ``x.arguments``; ``field`` itself for ()."""
    keys = []
    while path:
        path, key = path
        keys.append(key)
    name = "" if field == BODY else field
    for key in reversed(keys):
        name += f"[{key}]" if isinstance(key, int) else (f".{_clip(key)}" if name else _clip(key))
    return name or field


class _TooManyValues(Exception):
    pass


def _counted_loads(text: str, max_values: int) -> Any:
    """json.loads with the pure-Python scanner, stopping with _TooManyValues after ``max_values`` values."""
    count = 0

    def counted(scan_once):
        def scan(s, idx):
            nonlocal count
            count += 1
            if count > max_values:
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


def _check_shape(value: Any, field: str, max_depth: int, text: bool, too_deep: str) -> None:
    """ValueError ``too_deep`` when ``value`` nests deeper than ``max_depth`` or, with ``text``, naming the field
    whose string or field name is not valid Unicode. Iterative: no recursion on client data."""
    stack: list[tuple[object, int, tuple]] = [(value, 1, ())]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, (dict, list)) and depth > max_depth:
            raise ValueError(too_deep)
        if isinstance(item, dict):
            for key, child in item.items():
                if text and not key.isascii():  # (the field name is built only for a suspect text)
                    check_unicode(key, field_name(field, path), "field name")
                stack.append((child, depth + 1, (path, key)))
        elif isinstance(item, list):
            stack.extend((child, depth + 1, (path, i)) for i, child in enumerate(item))
        elif text and isinstance(item, str) and not item.isascii():
            check_unicode(item, field_name(field, path), "text")


def _clip(key: str) -> str:
    return key if len(key) <= MAX_KEY_ECHO else f"{key[:MAX_KEY_ECHO]}… ({len(key)} characters)"
