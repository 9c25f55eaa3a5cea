"""Chat templates compiled and rendered in jinja2's immutable sandbox, as transformers does (docs/architecture.md,
"Chat template").

Contract: `_compile_template(source, origin)` compiles a checkpoint's template with transformers' globals
(``raise_exception``, ``tojson``, ``strftime_now``, a ``namespace`` refusing underscore names, the
``{% generation %}`` tag), a syntax error being a ValueError naming ``origin``; `request_template(source)` does the
same for a template sent with a request (bounded in size, the last few kept compiled). `_plain_tools` copies a
request's tools into the plain JSON templates read; `_final_text` and `_cut_after` implement
``continue_final_message`` (transformers' rule). The `Tokenizer` (`dgserve.text.tokenizer`) renders with them.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag) renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja2.ext.Extension declares `tags` so (a ClassVar would clash)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace()` refusing underscore-prefixed names (transformers' hardening)."""

    def __init__(*args, **kwargs):  # jinja's signature trick, so `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _compile_template(source: str, origin: str) -> jinja2.Template:
    """Compile a chat template in an immutable sandbox with transformers' globals; ValueError naming `origin`
    on a syntax error."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"{origin}: invalid chat template ({e})") from e


MAX_REQUEST_TEMPLATE_CHARS = 64 * 1024


@functools.lru_cache(maxsize=16)
def request_template(source: str) -> jinja2.Template:
    """A chat template sent with a request, compiled in the sandbox (the last few kept compiled); ValueError
    naming ``chat_template`` when it is too long or does not compile."""
    if not isinstance(source, str) or not source:
        raise ValueError("chat_template must be a non-empty string")
    if len(source) > MAX_REQUEST_TEMPLATE_CHARS:
        raise ValueError(f"chat_template: {len(source)} characters; at most {MAX_REQUEST_TEMPLATE_CHARS}")
    return _compile_template(source, "chat_template")


def _final_text(messages: list[dict], add_generation_prompt: bool) -> str:
    """The text of the last message, which continue_final_message leaves open: an assistant's, with text."""
    if add_generation_prompt:
        raise ValueError("continue_final_message: cannot be combined with add_generation_prompt")
    if messages[-1]["role"] not in ("assistant", "model"):
        raise ValueError("continue_final_message: the last message must be an assistant message")
    content = messages[-1].get("content")
    if isinstance(content, list):  # the last text part (transformers' rule)
        content = next((p.get("text") for p in reversed(content) if isinstance(p, dict) and "text" in p), None)
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message: the last message has no text to continue")
    return content


def _cut_after(rendered: str, final: str) -> str:
    """The rendered chat cut right after the final message's text (its last occurrence), as transformers does:
    with the text's trailing spaces when the template kept them."""
    at = rendered.rfind(final.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not write the last message's text")
    if rendered[at : at + len(final.lstrip())] == final.lstrip():
        return rendered[: at + len(final.lstrip())]
    return rendered[: at + len(final.strip())]


def _plain_tools(tools: Sequence[dict] | None) -> list[dict]:
    """A plain-JSON copy of `tools`, each checked for the shape templates read (`tools[i].function.name` a str);
    the full checks of a request's tools are `dgserve.structured.tools`'."""
    if not tools:
        return []
    if not isinstance(tools, (list, tuple)):
        raise ValueError("tools must be a list of function tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name": str, ...}}}}')
    try:
        return json.loads(json.dumps(list(tools)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"tools must hold only JSON data ({e})") from e
