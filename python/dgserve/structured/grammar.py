"""Grammar compilation on llguidance (pinned in pyproject.toml; why: docs/structured-output.md §11.6).

``GrammarCompiler`` builds the llguidance tokenizer once from the checkpoint's tokenizer.json and compiles each
``ResponseFormat`` once (an LRU cache keyed by ``ResponseFormat.key()``); ``matcher`` hands out a fresh matcher
per request. Compile work is bounded: the schema text is capped in ``ResponseFormat`` and llguidance's parser
limits cap the grammar size and the lexer work (``LIMITS``). Every rejection is a ``GrammarError`` (a
ValueError) naming ``response_format`` (for the tool grammar of a request with tools, ``tools[i].function.parameters``
or ``tools``, docs/tools.md): the service maps it to INVALID_ARGUMENT / HTTP 400.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

import llguidance as llg
import numpy as np

from dgserve.structured.closing import Closer, allowed_tokens
from dgserve.structured.response_format import TOOL_CALLS, ResponseFormat
from dgserve.structured.tool_grammar import tool_lark
from dgserve.text.gemma4 import CHANNEL_BEGIN, CHANNEL_END, TOOL_CALL_BEGIN, TOOL_CALL_END

if TYPE_CHECKING:  # a TypedDict of the type stubs only
    from llguidance._lib import JsonCompileOptions


log = logging.getLogger("dgserve.structured")

# JSON output is compact: no whitespace between tokens (a weak model cannot spend its budget on blanks)
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
MAX_GRAMMAR_SYMBOLS = 50_000  # llguidance default 500k; a 32 KiB schema stays well below this
INITIAL_LEXER_FUEL = 500_000  # ~10 ms of regex analysis (llguidance: ~50k/ms); default 1M
CACHE_SIZE = 128
MARKERS = (TOOL_CALL_BEGIN, TOOL_CALL_END, CHANNEL_BEGIN, CHANNEL_END)  # written as tokens where they are special
# Numbers are bounded like whitespace (a weak model would otherwise write digits until max_new_tokens): a number or
# integer schema without its own bounds gets |x| <= 10^15, and a number without multipleOf at most 6 decimals (no
# exponent). Every document produced still validates against the request's schema (a subset of its numbers).
NUMBER_LIMIT = 10**15
NUMBER_STEP = 1e-6
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


class GrammarError(ValueError):
    """A response_format that cannot be compiled (the message names response_format and the problem)."""


def _limits() -> llg.LLParserLimits:
    return llg.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS, initial_lexer_fuel=INITIAL_LEXER_FUEL)


def bound_numbers(schema: object) -> object:
    """The schema with NUMBER_LIMIT / NUMBER_STEP added to every number or integer subschema that has no bound of
    its own (in place; walks only schema-valued keywords, never enum / const data)."""
    if not isinstance(schema, dict):
        return schema
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    if "number" in types or "integer" in types:
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            schema["minimum"] = -NUMBER_LIMIT
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            schema["maximum"] = NUMBER_LIMIT
        if "number" in types and "multipleOf" not in schema:
            schema["multipleOf"] = NUMBER_STEP
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                bound_numbers(sub)
    for key in _SCHEMA_VALUES:
        bound_numbers(schema.get(key))
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                bound_numbers(sub)
    return schema


def grammar_text(fmt: ResponseFormat) -> str:
    """The llguidance grammar (JSON text) of a response format."""
    if fmt.type == "json_schema":
        assert fmt.schema is not None
        schema = bound_numbers(json.loads(fmt.schema))
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    if fmt.type == "json_object":
        return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if fmt.type == "regex":
        assert fmt.regex is not None
        return llg.LLMatcher.grammar_from_regex(fmt.regex)
    # choice: a lark alternation of JSON-escaped string literals (the output is the choice's raw text)
    return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in fmt.choices))


class GrammarCompiler:
    """Compiles response formats for one tokenizer. Thread-safe (requests are added from service threads).

    tokenizer_json: the checkpoint's tokenizer.json text; vocab_size: the model's V (the bitmask width follows
    it); eos_ids: the model's EOS ids (the grammar allows them exactly where the document may end).
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Iterable[int], cache_size: int = CACHE_SIZE):
        eos = sorted(int(e) for e in eos_ids)
        if not eos:
            raise GrammarError("response_format: this model has no EOS token, so a document could never end")
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos)
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self._cache: OrderedDict[tuple, str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (cache misses), for tests and metrics

    def grammar(self, fmt: ResponseFormat) -> str:
        """The validated grammar of ``fmt`` (compiled once, then cached); GrammarError when it is invalid."""
        key = fmt.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        t0 = time.perf_counter()
        where, what = ("tools", "tool grammar") if fmt.type == TOOL_CALLS else ("response_format", fmt.type)
        try:
            text = self._tool_grammar(fmt) if fmt.type == TOOL_CALLS else grammar_text(fmt)
        except ValueError as e:
            if isinstance(e, GrammarError):
                raise
            raise GrammarError(f"{where}: invalid {what}: {e}") from None
        self._validate(text, where, what, may_be_empty=fmt.type in ("regex", TOOL_CALLS))
        log.debug("compiled a %s grammar in %.1f ms", fmt.type, 1e3 * (time.perf_counter() - t0))
        with self._lock:
            self.compiles += 1
            self._cache[key] = text
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return text

    def _validate(self, text: str, where: str, what: str, may_be_empty: bool) -> None:
        """GrammarError naming ``where`` unless llguidance accepts the grammar and its first state admits a first
        token: a grammar that fails there, admits nothing, or (unless ``may_be_empty``: JSON and choices are never
        empty) admits only the end of the output can never give a valid result, and is refused now rather than
        failing (or ending empty) mid-request."""
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer, limits=_limits())
        if failed:
            raise GrammarError(f"{where}: invalid {what}: {_first_line(messages[0])}")
        m = llg.LLMatcher(self.tokenizer, text, log_level=0, limits=_limits())
        forced = m.compute_ff_tokens() if not m.is_error() else []
        words = np.frombuffer(m.compute_bitmask(), dtype=np.int32) if not m.is_error() and not forced else None
        if m.is_error():
            raise GrammarError(f"{where}: invalid {what}: {_first_line(m.get_error())}")
        if words is None:
            return  # a forced first token: the output starts
        allowed = set(allowed_tokens(words, self.vocab_size).tolist())
        if not allowed:
            raise GrammarError(f"{where}: the {what} admits no output at all (unsatisfiable)")
        if not may_be_empty and allowed <= self.eos_ids:
            raise GrammarError(f"{where}: the {what} admits only an empty output (unsatisfiable)")

    def _tool_grammar(self, fmt: ResponseFormat) -> str:
        """The grammar of a tool_calls format (``dgserve.structured.tool_grammar``). Each function's parameters
        schema is compiled and checked on its own first, so an error names it: ``tools[i].function.parameters``."""
        assert fmt.tools is not None
        schemas: dict[str, dict] = {}
        for f in fmt.tools.functions:
            where = f"tools[{f.index}].function.parameters"
            schema = json.loads(f.schema)
            bound_numbers(schema)  # in place
            try:
                text = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
            except ValueError as e:
                raise GrammarError(f"{where}: invalid schema: {e}") from None
            self._validate(text, where, "schema", may_be_empty=False)
            schemas[f.name] = {**schema, "x-guidance": dict(JSON_OPTIONS)}
        return llg.LLMatcher.grammar_from_lark(tool_lark(fmt.tools, schemas, self.special_markers))

    @functools.cached_property
    def special_markers(self) -> frozenset[str]:
        """The Gemma 4 markers that are single special tokens of this vocabulary (the tool grammar writes those as
        tokens, the others as text)."""
        out = set()
        for marker in MARKERS:
            ids = self.tokenizer.tokenize_str(marker, parse_special=True)
            if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]):
                out.add(marker)
        return frozenset(out)

    @functools.cached_property
    def closer(self) -> Closer:
        """The search for a document's ending in this vocabulary (built once: it ranks every token)."""
        return Closer(self.tokenizer, self.vocab_size, self.eos_ids)

    def matcher(self, fmt: ResponseFormat) -> llg.LLMatcher:
        """A fresh matcher at the start of the document (one per request)."""
        m = llg.LLMatcher(self.tokenizer, self.grammar(fmt), log_level=0, limits=_limits())
        if m.is_error():
            raise GrammarError(f"response_format: invalid {fmt.type}: {_first_line(m.get_error())}")
        return m


def _first_line(msg: str) -> str:
    return msg.strip().splitlines()[0][:500] if msg.strip() else "rejected by the grammar compiler"
