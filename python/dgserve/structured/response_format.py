"""``ResponseFormat``: what a structured-output request asks for (docs/structured-output.md), validated once.

Pure Python (no grammar engine import), so ``SamplingParams`` can hold one. Bad values raise ValueError naming
``response_format`` and the problem; the grammar itself is compiled (and may still be rejected) by
``dgserve.structured.grammar``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dgserve.structured import schema_check
from dgserve.text import client_json

KINDS = ("json_schema", "json_object", "regex", "choice")  # what a request may send
TOOL_CALLS = "tool_calls"  # built from a request's tools (dgserve.structured.tools), never sent
MAX_SCHEMA_BYTES = 32 * 1024  # bounds compile time and grammar size before the engine sees the schema
MAX_REGEX_LENGTH = 4096
MAX_CHOICES = 256
MAX_CHOICE_LENGTH = 1024
MAX_NAME_LENGTH = 256


@dataclass(frozen=True)
class ToolSchema:
    """One function as the tool grammar sees it: its position in the request's ``tools`` (errors name
    ``tools[index]``), its name and its parameters schema (JSON text of an object schema)."""

    index: int
    name: str
    schema: str


@dataclass(frozen=True)
class ToolCallFormat:
    """The constraint of a request with tools (docs/tools.md, "The grammar"), built by
    ``dgserve.structured.tools.ToolSet``, which validates it.

    functions: every tool of the request (each schema is compiled, so a bad one is refused whichever is chosen).
    required: at least one call (tool_choice "required" or a named function); else text or calls ("auto").
    only: the one function that may be called (a named tool_choice), else None (any of them).
    parallel: more than one call may be made (parallel_tool_calls); a named function is called once.
    thinking: a thought channel may come first (the prompt enabled thinking).
    """

    functions: tuple[ToolSchema, ...]
    required: bool = False
    only: str | None = None
    parallel: bool = True
    thinking: bool = False


@dataclass(frozen=True)
class ResponseFormat:
    """A constraint on the generated text.

    type: "json_schema" (``schema``: JSON Schema text), "json_object" (any JSON object), "regex" (``regex``: the
    whole output matches it), "choice" (``choices``: the output is exactly one of them) or "tool_calls" (``tools``:
    text or calls of the request's functions in Gemma 4's call syntax, docs/tools.md; built from a request's tools,
    never sent as a response_format).
    name, strict: OpenAI's json_schema fields, kept for the record (the output always follows the schema).
    """

    type: str
    schema: str | None = None
    name: str = ""
    strict: bool = False
    regex: str | None = None
    choices: tuple[str, ...] = field(default_factory=tuple)
    tools: ToolCallFormat | None = None

    @property
    def whole_or_nothing(self) -> bool:
        """Whether only a complete output is worth anything: a JSON document, a choice, or required tool calls
        (not free text: a regex, or tool_choice auto, whose text may end anywhere). The sampler steers such an
        output to a complete end within its token budget (docs/structured-output.md §11.9)."""
        if self.type == TOOL_CALLS:
            return self.tools is not None and self.tools.required
        return self.type in ("json_schema", "json_object", "choice")

    def __post_init__(self) -> None:
        if self.type not in (*KINDS, TOOL_CALLS):
            raise ValueError(f"response_format: type must be one of {', '.join(KINDS)}, got {self.type!r}")
        object.__setattr__(self, "choices", tuple(self.choices))
        if not isinstance(self.name, str) or len(self.name) > MAX_NAME_LENGTH:
            raise ValueError(f"response_format: name must be a string of at most {MAX_NAME_LENGTH} characters")
        given = {
            "schema": self.schema is not None,
            "regex": self.regex is not None,
            "choices": bool(self.choices),
            "tools": self.tools is not None,
        }
        wanted = {"json_schema": "schema", "regex": "regex", "choice": "choices", TOOL_CALLS: "tools"}.get(self.type)
        for name, present in given.items():
            if present and name != wanted:
                raise ValueError(f"response_format: {name} is not used by type {self.type!r}")
        if self.type == "json_schema":
            _check_schema(self.schema)
        elif self.type == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError("response_format: regex must be a non-empty string")
            if len(self.regex) > MAX_REGEX_LENGTH:
                raise ValueError(f"response_format: regex is {len(self.regex)} characters; at most {MAX_REGEX_LENGTH}")
        elif self.type == "choice":
            _check_choices(self.choices)
        elif self.type == TOOL_CALLS and not isinstance(self.tools, ToolCallFormat):
            raise ValueError(
                f"response_format: type {TOOL_CALLS!r} is made from a request's tools; send tools and tool_choice"
            )

    def key(self) -> tuple:
        """The grammar cache key: everything that changes the compiled grammar."""
        return (self.type, self.schema, self.regex, self.choices, self.tools)


def _check_schema(schema: object) -> None:
    if not isinstance(schema, str) or not schema:
        raise ValueError("response_format: json_schema needs a schema (JSON text)")
    value = read_schema(schema, "response_format")
    if not isinstance(value, (dict, bool)):
        raise ValueError(f"response_format: schema must be a JSON object, got {type(value).__name__}")
    schema_check.check_productive(value)


def read_schema(text: str, field: str):
    """The JSON value of a schema's text: at most MAX_SCHEMA_BYTES and MAX_SCHEMA_DEPTH levels (ValueError naming
    ``field``), read by the one reader of a client's JSON."""
    return client_json.loads(
        text, field, max_bytes=MAX_SCHEMA_BYTES, max_depth=schema_check.MAX_SCHEMA_DEPTH, what="schema"
    )


def _check_choices(choices: tuple) -> None:
    if not choices:
        raise ValueError("response_format: choice needs at least one choice")
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"response_format: {len(choices)} choices; at most {MAX_CHOICES} are allowed")
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_LENGTH:
            raise ValueError(
                f"response_format: choices[{i}] must be a non-empty string of at most {MAX_CHOICE_LENGTH} characters"
            )
