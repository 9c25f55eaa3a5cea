"""A checkpoint's ``generation_config.json`` (docs/generation.md, "Configuration").

Contract: `read_generation_config` gives the file's JSON object ({} when a checkpoint directory has none) and its
path; its sampling knobs become a `SamplingParams` (``SamplingParams.from_generation_config``, the one table of
knobs). `generation_eos_token_ids` reads the end-of-sequence ids the engine stops on; `generation_output_limits`
whether the file sets an output limit (``max_new_tokens``, ``max_length``). A file that does not parse
or a bad ``eos_token_id`` raises `ConfigError` naming the field (and the file).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from dgserve.config_fields import ConfigError, _is_int, _read_json


def read_generation_config(path: str | os.PathLike[str]) -> tuple[dict[str, Any], pathlib.Path]:
    """(the generation_config.json object, its path) for a checkpoint directory or the file itself; a directory
    without one gives {} (every default). Unparsable → ConfigError naming the file. The sampling knobs in it are
    read by ``SamplingParams.from_generation_config``; ``generation_eos_token_ids`` reads the EOS ids."""
    path = pathlib.Path(path)
    file = path if path.is_file() else path / "generation_config.json"
    if not file.is_file():
        return {}, file
    return _read_json(file), file


def generation_eos_token_ids(source: dict[str, Any] | str | os.PathLike[str]) -> tuple[int, ...]:
    """generation_config's ``eos_token_id`` (an int, a list of ints, or absent/null) as a tuple, () when unset;
    anything else → ConfigError naming the field (and the file, when ``source`` is a checkpoint directory or the
    file). Not a sampling knob: the engine's end-of-sequence ids, which fall back to config.json's when empty."""
    if not isinstance(source, dict):
        d, file = read_generation_config(source)
        try:
            return generation_eos_token_ids(d)
        except ConfigError as e:
            raise ConfigError(f"{e} (in {file})") from None
    eos = source.get("eos_token_id")
    if eos is None:
        return ()
    ids = (eos,) if _is_int(eos) else eos
    if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
        raise ConfigError(
            f"generation_config.eos_token_id: expected a non-negative integer or a list of them, got {eos!r}"
        )
    return tuple(ids)


def generation_output_limits(path: str | os.PathLike[str]) -> tuple[int | None, int | None]:
    """(``max_new_tokens``, ``max_length``) as the checkpoint's generation_config.json sets them (None: absent or
    null): the server's default output limit of a request that sends none (docs/generation.md, "Limits";
    ``max_length`` counts the prompt too, as in transformers). A value that is not a positive integer →
    ConfigError naming the field and the file."""
    d, file = read_generation_config(path)
    out: list[int | None] = []
    for key in ("max_new_tokens", "max_length"):
        v = d.get(key)
        if v is not None and not (_is_int(v) and v >= 1):
            raise ConfigError(f"generation_config.{key}: expected a positive integer, got {v!r} (in {file})")
        out.append(v)
    return out[0], out[1]
