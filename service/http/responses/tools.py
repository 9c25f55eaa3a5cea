"""The Responses API's ``tools`` (docs/responses-api.md, "Tools"): function tools, ``namespace`` tools (groups of
function tools, as Codex CLI sends its sub-agent tools) and hosted tools, → the chat door's one ``ToolSet``.

* A function tool is offered under its name.
* A namespace's function tools are offered one by one: each under its own name when no other tool of the request
  has that name, else under ``<namespace>__<name>`` (the namespace's trailing underscores dropped, so an MCP
  namespace ``mcp__server__`` gives ``mcp__server__<name>``). A call of one comes back with the tool's own
  ``name`` and its ``namespace`` (what Codex looks a call up by), and a ``function_call`` input item with a
  ``namespace`` is read back the same way.
* A hosted tool (``HOSTED``: run by OpenAI's platform, or a call item this server does not make) is left out of
  the prompt, not refused: the response's ``tools`` echo leaves it out too and ``dgserve.tools_left_out`` lists
  its type, and the route logs the types once per request.
* Any other type is a 400 naming ``tools[i].type``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dgserve.structured.tools import ToolSet

from ...errors import clip
from ..fields import known, nonempty

# OpenAI's tool types the server cannot run or answer with a call item of its own: left out (module doc)
HOSTED = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer",
        "computer_use",
        "computer_use_preview",
        "local_shell",
        "shell",
        "apply_patch",
        "mcp",
        "tool_search",
    }
)
FUNCTION_KEYS = {"type", "name", "description", "parameters", "strict"}
NAMESPACE_KEYS = {"type", "name", "description", "tools"}


@dataclass(frozen=True)
class ResponsesTools:
    """A request's tools read: the ``ToolSet`` (None: no tools asked for), the namespace tools by the name the
    prompt gives them (→ namespace, own name), the hosted types left out, and the tools a response echoes."""

    tools: ToolSet | None = None
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    left_out: tuple[str, ...] = ()
    echo: tuple[dict, ...] = ()

    def prompt_name(self, namespace: str | None, name: str) -> str:
        """The name the prompt knows a call by (a ``function_call`` input item's ``namespace`` and ``name``)."""
        if namespace is None:
            return name
        for prompt, (ns, own) in self.namespaced.items():
            if ns == namespace and own == name:
                return prompt
        return qualified(namespace, name)

    def wire(self, prompt_name: str) -> dict:
        """A call's ``name`` (and ``namespace``) in a ``function_call`` output item."""
        if prompt_name in self.namespaced:
            namespace, name = self.namespaced[prompt_name]
            return {"name": name, "namespace": namespace}
        return {"name": prompt_name}


def qualified(namespace: str, name: str) -> str:
    return f"{namespace.rstrip('_')}__{name}"


def read_tools(body: dict) -> ResponsesTools:
    """The body's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (module doc). ValueError naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools must be a list of function tools")
    functions: list[tuple[str, dict, str | None]] = []  # (field, function tool, its namespace)
    left_out: list[str] = []
    echo: list[dict] = []
    for i, tool in enumerate(tools or ()):
        at = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in HOSTED:
            if kind not in left_out:
                left_out.append(kind)
            continue
        echo.append(tool)
        if kind == "namespace":
            functions += _namespace(tool, at)
        else:
            functions.append((at, _function(tool, at), None))
    flat, fields, namespaced = _named(functions)
    if isinstance(choice, dict):
        known(choice, {"type", "name"}, "tool_choice")
        if choice.get("type") != "function":
            raise ValueError(f'tool_choice.type must be "function", got {clip(str(choice.get("type")))!r}')
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    try:
        tool_set = ToolSet.from_openai(flat if tools is not None else None, choice, body.get("parallel_tool_calls"))
    except ValueError as e:
        raise ValueError(_renamed(str(e), fields)) from None
    return ResponsesTools(tool_set, namespaced, tuple(left_out), tuple(echo))


def _function(tool, at: str) -> dict:
    if not isinstance(tool, dict):
        raise ValueError(f'{at} must be an object {{"type": "function", "name": ...}}')
    if tool.get("type") != "function":
        got = clip(str(tool.get("type")))
        raise ValueError(f'{at}.type: only "function", "namespace" and hosted tools are supported, got {got!r}')
    known(tool, FUNCTION_KEYS, at)
    return {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}


def _namespace(tool: dict, at: str) -> list[tuple[str, dict, str | None]]:
    known(tool, NAMESPACE_KEYS, at)
    namespace = nonempty(tool.get("name"), f"{at}.name")
    inner = tool.get("tools")
    if not isinstance(inner, list):
        raise ValueError(f"{at}.tools must be a list of function tools")
    return [(f"{at}.tools[{j}]", _function(t, f"{at}.tools[{j}]"), namespace) for j, t in enumerate(inner)]


def _named(functions: list[tuple[str, dict, str | None]]) -> tuple[list[dict], list[str], dict]:
    """The chat door's function tools under the names the prompt gives them (module doc), each tool's field, and
    the namespaced tools by prompt name."""
    counts: dict[object, int] = {}
    for _, fn, _ in functions:
        counts[fn.get("name")] = counts.get(fn.get("name"), 0) + 1
    flat, fields, namespaced = [], [], {}
    for at, fn, namespace in functions:
        name = fn.get("name")
        if namespace is not None and isinstance(name, str):
            prompt = name if counts[name] == 1 else qualified(namespace, name)
            namespaced[prompt] = (namespace, name)
            fn = {**fn, "name": prompt}
        flat.append({"type": "function", "function": fn})
        fields.append(at)
    return flat, fields, namespaced


def _renamed(message: str, fields: list[str]) -> str:
    """A ToolSet message (``tools[k].function.name: …``) with the tool's field in this request."""

    def field_of(m: re.Match) -> str:
        k = int(m.group(1))
        return (fields[k] if k < len(fields) else m.group(0)) + "."

    message = re.sub(r"^tools\[(\d+)\]\.function\.", field_of, message)
    message = re.sub(
        r"is also the name of tools\[(\d+)\]", lambda m: "is also the name of " + field_of(m)[:-1], message
    )
    return re.sub(r"^tool_choice\.function\.", "tool_choice.", message)
