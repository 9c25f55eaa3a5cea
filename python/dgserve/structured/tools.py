"""A request's tools (docs/tools.md): OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, validated
once, and what they mean for the prompt (the declarations a chat template gets) and for the output (the grammar
constraint, a ``ResponseFormat`` of type tool_calls).

Pure data and checks (no grammar engine import). Errors are ValueError naming the field as the doors report it:
``tools[1].function.name: …``, ``tools[0].function.parameters: …``, ``tool_choice.function.name: …``. A parameters
schema is judged here as far as it can be without a grammar engine (JSON, an object schema, size, nesting, a finite
document: ``schema_check``); the engine's ``GrammarCompiler`` compiles it and refuses what llguidance cannot
compile, naming the same field.

tool_choice:

* ``"auto"`` (the default with tools): the model writes text or calls; every call it writes is valid;
* ``"required"``: one call or more (one with ``parallel_tool_calls`` false);
* ``{"type": "function", "function": {"name": F}}``: exactly one call, of F;
* ``"none"`` (the default without tools): no call is made. The declarations are then left out of the prompt and
  the output is free text: the model is not told about functions it may not call, and no grammar runs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from dgserve.structured import schema_check
from dgserve.structured.response_format import TOOL_CALLS, ResponseFormat, ToolCallFormat, ToolSchema, read_schema
from dgserve.structured.schema_check import MAX_SCHEMA_DEPTH
from dgserve.text.client_json import check_unicode

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit
EMPTY_PARAMETERS = '{"type":"object","properties":{},"additionalProperties":false}'  # no parameters: arguments {}
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class FunctionTool:
    """One function the model may call. Validated at construction (ValueError naming ``function.<field>``).

    name: 1 to 64 letters, digits, ``_`` or ``-``. description: free text for the model. parameters: the JSON
    Schema (text) of the arguments, an object schema (``"type": "object"`` is added when absent; omitted: no
    parameters, the arguments are ``{}``); stored as compact JSON. strict: OpenAI's flag, kept for the record
    (the arguments always follow the schema).
    """

    name: str
    description: str = ""
    parameters: str = EMPTY_PARAMETERS
    strict: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            raise ValueError(
                "function.name: must be 1 to 64 letters, digits, underscores or dashes, got "
                f"{_clip(self.name) if isinstance(self.name, str) else type(self.name).__name__}"
            )
        if not isinstance(self.description, str):
            raise ValueError("function.description: must be a string")
        check_unicode(self.description, "function.description")
        if not isinstance(self.strict, bool):
            raise ValueError("function.strict: must be a boolean")
        object.__setattr__(self, "parameters", _checked_parameters(self.parameters))

    def to_openai(self) -> dict:
        """The tool as OpenAI writes it (parameters an object): what a chat template gets."""
        fn = {"name": self.name, "description": self.description, "parameters": json.loads(self.parameters)}
        return {"type": "function", "function": fn}

    @classmethod
    def from_openai(cls, tool: object, field: str = "tools[0]") -> FunctionTool:
        """``{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}`` → a tool;
        errors name ``field`` (the tool's place in the request)."""
        if not isinstance(tool, dict):
            raise ValueError(f'{field}: must be an object {{"type": "function", "function": {{...}}}}')
        if tool.get("type") != "function":
            raise ValueError(f'{field}.type: only "function" tools are supported, got {_clip(tool.get("type"))}')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{field}.function: must be an object with a name")
        params = fn.get("parameters")
        try:
            return cls(
                name=fn.get("name"),  # type: ignore[arg-type]  # checked in __post_init__
                description="" if fn.get("description") is None else fn["description"],
                parameters=EMPTY_PARAMETERS if params is None else _schema_text(params),
                strict=False if fn.get("strict") is None else fn["strict"],
            )
        except ValueError as e:
            raise ValueError(f"{field}.{e}") from None


@dataclass(frozen=True)
class ToolChoice:
    """tool_choice: kind "none", "auto", "required", or "function" with ``name`` (module doc)."""

    kind: str = "auto"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "function":
            if not isinstance(self.name, str) or not self.name:
                raise ValueError("tool_choice.function.name: must be the name of one of the tools")
        elif self.kind in CHOICES:
            if self.name is not None:
                raise ValueError(f"tool_choice: {self.kind!r} names no function")
        else:
            raise ValueError(f"tool_choice: must be one of none, auto, required or a function, got {_clip(self.kind)}")

    @classmethod
    def from_openai(cls, value: object) -> ToolChoice:
        """``"none"`` | ``"auto"`` | ``"required"`` | ``{"type": "function", "function": {"name": F}}``."""
        if isinstance(value, str):
            if value not in CHOICES:
                raise ValueError(f"tool_choice: must be none, auto, required or a function, got {_clip(value)}")
            return cls(value)
        if not isinstance(value, dict):
            raise ValueError('tool_choice: must be a string or {"type": "function", "function": {"name": ...}}')
        if value.get("type") != "function":
            raise ValueError(f'tool_choice.type: must be "function", got {_clip(value.get("type"))}')
        fn = value.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError("tool_choice.function.name: must be the name of one of the tools")
        return cls("function", fn["name"])


@dataclass(frozen=True)
class ToolSet:
    """What a request says about tools: the functions, the choice and whether calls may be parallel. Validated at
    construction: function names unique, a named choice one of them, "required" or a named choice only with tools.
    """

    tools: tuple[FunctionTool, ...]
    choice: ToolChoice = field(default_factory=ToolChoice)
    parallel: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools", tuple(self.tools))
        if len(self.tools) > MAX_TOOLS:
            raise ValueError(f"tools: {len(self.tools)} tools; at most {MAX_TOOLS} are allowed")
        seen: dict[str, int] = {}
        for i, t in enumerate(self.tools):
            if not isinstance(t, FunctionTool):
                raise ValueError(f"tools[{i}]: must be a FunctionTool")
            if t.name in seen:
                raise ValueError(f"tools[{i}].function.name: {t.name!r} is also the name of tools[{seen[t.name]}]")
            seen[t.name] = i
        if not isinstance(self.choice, ToolChoice):
            raise ValueError("tool_choice: must be a ToolChoice")
        if self.choice.kind in ("required", "function") and not self.tools:
            raise ValueError(f"tool_choice: {self.choice.kind!r} needs tools, and the request has none")
        if self.choice.kind == "function" and self.choice.name not in seen:
            raise ValueError(f"tool_choice.function.name: {_clip(self.choice.name)} is not the name of any tool")
        if not isinstance(self.parallel, bool):
            raise ValueError("parallel_tool_calls: must be a boolean")

    @classmethod
    def from_openai(
        cls, tools: object = None, tool_choice: object = None, parallel_tool_calls: object = None
    ) -> ToolSet | None:
        """The request's OpenAI fields (None: absent) → a ToolSet, or None when they ask for no tools at all (no
        tools, and tool_choice absent, "none" or "auto")."""
        if tools is None:
            tools = []
        if not isinstance(tools, list):
            raise ValueError("tools: must be a list of function tools")
        if len(tools) > MAX_TOOLS:
            raise ValueError(f"tools: {len(tools)} tools; at most {MAX_TOOLS} are allowed")
        parsed = tuple(FunctionTool.from_openai(t, f"tools[{i}]") for i, t in enumerate(tools))
        choice = ToolChoice.from_openai(tool_choice) if tool_choice is not None else None
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ValueError("parallel_tool_calls: must be a boolean")
        if not parsed and (choice is None or choice.kind in ("none", "auto")):
            return None
        default = ToolChoice("auto") if parsed else ToolChoice("none")
        return cls(parsed, choice or default, True if parallel_tool_calls is None else parallel_tool_calls)

    @property
    def calls(self) -> bool:
        """Whether calls may be made (tool_choice is not "none")."""
        return self.choice.kind != "none"

    @property
    def callable_names(self) -> frozenset[str]:
        """The functions a call may name: the named one, else every tool (none with tool_choice "none")."""
        if not self.calls:
            return frozenset()
        return frozenset([self.choice.name] if self.choice.name is not None else [t.name for t in self.tools])

    def rendered(self) -> list[dict]:
        """The tools the prompt declares (OpenAI-shaped, for ``Tokenizer.apply_chat_template``): none with
        tool_choice "none" (module doc)."""
        return [t.to_openai() for t in self.tools] if self.calls else []

    def response_format(self, thinking: bool = False) -> ResponseFormat | None:
        """The output constraint (docs/tools.md, "The grammar"), or None with tool_choice "none". ``thinking``: the
        prompt enabled thinking, so a thought channel may come before the calls."""
        if not self.calls:
            return None
        named = self.choice.name if self.choice.kind == "function" else None
        fmt = ToolCallFormat(
            functions=tuple(ToolSchema(i, t.name, t.parameters) for i, t in enumerate(self.tools)),
            required=self.choice.kind != "auto",
            only=named,
            parallel=self.parallel and named is None,
            thinking=thinking,
        )
        return ResponseFormat(TOOL_CALLS, tools=fmt)


def _schema_text(params: object) -> str:
    """A parameters value as JSON text (a dict from a JSON request, or text already)."""
    if isinstance(params, str):
        return params
    try:
        return json.dumps(params, ensure_ascii=False, separators=(",", ":"))
    except RecursionError:  # (a request's JSON is bounded before it gets here; an API caller's object is not)
        raise ValueError(
            f"function.parameters: schema nests too deep; at most {MAX_SCHEMA_DEPTH} levels are allowed"
        ) from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"function.parameters: not JSON data ({e})") from None


def _checked_parameters(text: object) -> str:
    """The parameters schema checked (module doc) and normalised: compact JSON with ``"type": "object"``."""
    where = "function.parameters"
    if not isinstance(text, str):
        raise ValueError(f"{where}: must be a JSON schema (an object)")
    schema = read_schema(text, where)
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: must be a JSON schema object, got {type(schema).__name__}")
    kind = schema.setdefault("type", "object")
    if kind != "object":
        raise ValueError(f'{where}: the arguments are an object, so the schema\'s type must be "object", got {kind!r}')
    schema_check.check_productive(schema, where)
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _clip(value: object, n: int = 64) -> str:
    """A short repr of a value from a request, for error messages."""
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."
