"""The field readers every JSON door shares, each written once: a body must be an object, an optional field has
its type, an object holds only its known keys, a string field is a string; and the one rule for a body's fields,
``check_fields``: a field is known, or null, or one the door accepts only at its no-op value (``NO_OP`` tables),
else a ValueError naming it with the reason. Every ValueError starts with the field's name in the request, so
each door answers "invalid argument: <field> ...".
"""

from __future__ import annotations

import json

from dgserve.text.messages import check_unicode

from ..errors import clip


def body_object(body) -> dict:
    """The decoded body, which must be a JSON object."""
    if not isinstance(body, dict):
        raise ValueError("body: must be a JSON object")
    return body


def optional(body: dict, name: str, kind: type):
    """``body[name]``, None when absent or null, else of type ``kind`` (bool, dict or str)."""
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise ValueError(
            f"{name} must be {'a boolean' if kind is bool else 'an object' if kind is dict else 'a string'}"
        )
    return value


ITEM, OBJECT = "in this item", "in this object"  # where ``known`` says a key is not supported (Responses, Messages)


def known(value: dict, names: set[str], field: str, where: str = ITEM) -> None:
    """An object of the request (an item, a block, an option) holds only ``names`` (or nulls); ``field`` names it."""
    for key, v in value.items():
        if key not in names and v is not None:
            raise ValueError(f"{field}.{clip(str(key))}: not supported {where}")


def string(value, field: str) -> str:
    """A string field (valid Unicode)."""
    if not isinstance(value, str):
        raise ValueError(f"{field} must be a string")
    check_unicode(value, field)
    return value


def nonempty(value, field: str) -> str:
    """A non-empty string field (valid Unicode): an id or a name."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty string")
    check_unicode(value, field)
    return value


def string_or_list(value, field: str, items: str) -> str | list:
    """A field that is a string (valid Unicode) or a list (of ``items``, read by the caller)."""
    if isinstance(value, str):
        check_unicode(value, field)
        return value
    if not isinstance(value, list):
        raise ValueError(f"{field} must be a string or a list of {items}")
    return value


def check_fields(body: dict, names: set[str], no_op: dict[str, tuple[object, ...]], why: dict[str, str]) -> None:
    """The one rule for a body's fields: each is known (``names``), null, or at a value its ``no_op`` entry accepts
    (a field with no faithful meaning here, accepted where it asks for nothing); any other is a ValueError naming
    it, with the reason (``why``; "not supported by this server" by default) and the value sent."""
    for name, value in body.items():
        if name in names or value is None or (name in no_op and is_no_op(value, no_op[name])):
            continue
        reason = why.get(name, "not supported by this server")
        raise ValueError(f"{clip(name)}: {reason} (got {clip(json.dumps(value))})")


def is_no_op(value, allowed: tuple[object, ...]) -> bool:
    """``value`` is one of ``allowed``, of the same type, or the same number (``1.0`` for ``1``; never a boolean)."""
    return any((value == v and type(value) is type(v)) or _same_number(value, v) for v in allowed)


def _same_number(a, b) -> bool:
    return (
        isinstance(a, (int, float))
        and isinstance(b, (int, float))
        and not isinstance(a, bool)
        and not isinstance(b, bool)
        and a == b
    )
