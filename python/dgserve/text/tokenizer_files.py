"""A checkpoint's tokenizer files: ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja``.

Contract: `_read_config` reads tokenizer_config.json ({} when absent); `_special_from_config` gives a special
token's text (the config's, else the Gemma default when the vocabulary has it, else None); `_template_from_files`
gives the chat template and where it came from (``chat_template.jinja`` wins); `adds_token` tells whether
tokenizer.json's post-processor adds a token; `_warn_if_files_disagree` logs one warning when the config's
``add_bos_token`` / ``add_eos_token`` disagree with the post-processor. A file or field with a bad value raises
ValueError naming the file (and field). `dgserve.text.tokenizer.Tokenizer.from_pretrained` reads with them.
"""

from __future__ import annotations

import json
import logging
import pathlib

import tokenizers

log = logging.getLogger("dgserve")


DEFAULT_SPECIAL_TOKENS = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


def adds_token(tok: tokenizers.Tokenizer, token_id: int | None, first: bool) -> bool:
    """Whether `tok`'s post-processor puts `token_id` first (`first`) or last in an encoded single sequence."""
    if token_id is None or tok.post_processor is None:
        return False
    ids = tok.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0 if first else -1] == token_id and ids != tok.encode("a", add_special_tokens=False).ids


def _warn_if_files_disagree(add_bos_token: bool, add_eos_token: bool, config: dict, root: pathlib.Path) -> None:
    """One warning when tokenizer_config.json's add_bos_token / add_eos_token disagree with what tokenizer.json's
    post-processor does (transformers 5.23 ignores the config's flags; so does dgserve)."""
    issues = []
    for key, does in (("add_bos_token", add_bos_token), ("add_eos_token", add_eos_token)):
        if key in config and config[key] != does:
            issues.append(
                f"{key} is {str(config[key]).lower()} but the post-processor "
                f"{'adds' if does else 'does not add'} {'BOS' if 'bos' in key else 'EOS'}"
            )
    if issues:
        log.warning(
            "%s disagrees with %s: %s; following %s, as transformers does",
            root / CONFIG_FILE,
            root / TOKENIZER_FILE,
            "; ".join(issues),
            TOKENIZER_FILE,
        )


def _read_config(file: pathlib.Path) -> dict:
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return config


def _special_from_config(config: dict, name: str, file: pathlib.Path, tok: tokenizers.Tokenizer) -> str | None:
    """The text of special token `name`: the config's value (a str or a {"content": str} dict), else the Gemma
    default when the vocabulary has it, else None."""
    value = config.get(name)
    if value is None:
        default = DEFAULT_SPECIAL_TOKENS[name]
        return default if tok.token_to_id(default) is not None else None
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise ValueError(f'{file}: {name} must be a string or a {{"content": string}} object')
    if tok.token_to_id(value) is None:
        raise ValueError(f"{file}: {name} {value!r} is not in the tokenizer's vocabulary")
    return value


def _template_from_files(root: pathlib.Path, config: dict) -> tuple[str | None, str]:
    """(template, source): `chat_template.jinja` wins over the config's `chat_template`, which may be a str or
    transformers' list of `{"name", "template"}` (the one named "default" is used)."""
    jinja_file = root / TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
        except UnicodeDecodeError as e:
            raise ValueError(f"{jinja_file}: not UTF-8 text ({e})") from e
    source = f"{root / CONFIG_FILE}: chat_template"
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{source}: a list of templates needs one named 'default'")
        value = named["default"]
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{source}: must be a string")
    return value, source
