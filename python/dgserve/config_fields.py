"""The typed readers of a checkpoint's JSON configuration fields (docs/generation.md, "Configuration").

Contract: every reader takes the parsed JSON object, the key and where it sits (``text_config``, ...) and returns
the value or the default given; a value of the wrong type raises `ConfigError` (a ValueError) whose message starts
with the offending field (``text_config.head_dim: expected an integer, got '8'``). `_read_json` reads one JSON
object from a file, naming the file on any failure. Nothing here knows what the fields mean: `dgserve.config`,
`dgserve.text_config` and `dgserve.generation_config` do.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any


class ConfigError(ValueError):
    """A configuration value dgserve cannot use; the message starts with the field (e.g. `text_config.head_dim`)."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _name(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _int(d: dict[str, Any], key: str, where: str, default: Any = None, *, required: bool = False) -> Any:
    """d[key] as an int; absent -> default (or ConfigError if required). Null counts as absent only if required.
    Typed Any: the default is returned as given, None included."""
    if key not in d or (required and d[key] is None):
        if required:
            raise ConfigError(f"{_name(where, key)}: is required")
        return default
    v = d[key]
    if not _is_int(v):
        raise ConfigError(f"{_name(where, key)}: expected an integer, got {v!r}")
    return v


def _float(d: dict[str, Any], key: str, where: str, default: Any = None) -> Any:
    """d[key] as a finite float (ints accepted); absent -> default (returned as given, hence Any)."""
    if key not in d:
        return default
    v = d[key]
    if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
        raise ConfigError(f"{where}.{key}: expected a number, got {v!r}")
    return float(v)


def _optional_id(d: dict[str, Any], key: str, where: str, default: Any) -> Any:
    """A token id field: int, list of ints (eos only) or null. Lists become tuples."""
    if key not in d:
        return default
    v = d[key]
    if v is None or _is_int(v):
        return v
    if key == "eos_token_id" and isinstance(v, (list, tuple)) and all(_is_int(x) for x in v):
        return tuple(v)
    raise ConfigError(f"{where}.{key}: expected an integer or null, got {v!r}")


def _read_json(file: pathlib.Path) -> dict[str, Any]:
    """Parse a JSON object from `file`; any failure -> ConfigError naming the file."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{file}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file}: cannot parse JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def parse_hf_overrides(value: dict[str, Any] | str | None, flag: str = "hf_overrides") -> dict[str, Any]:
    """``--hf-overrides`` / ``hf_overrides=``: a JSON object (or its text) → dict; None → {}. Anything else is a
    one-line ConfigError naming ``flag``."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: expected a JSON object, got {type(value).__name__}")
    return value


def merge_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with ``overrides`` deep-merged into it: nested objects merge key by key, any other value
    (lists and null included) replaces the base's (docs/generation.md, "Configuration")."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_overrides(out[key], value)
        else:
            out[key] = value
    return out
