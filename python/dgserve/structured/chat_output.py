"""A chat completion's message out of the model's text (docs/tools.md, "The output"): reasoning, content and tool
calls, all at once (``parse_chat_output``) or block by block (``ChatOutputParser``), in OpenAI's shapes.

The text goes through the reasoning splitter first (``dgserve.text.reasoning``, when the prompt enabled thinking)
and its content through the tool-call parser (``dgserve.structured.tool_parser``, when the request may call
tools), so reasoning comes first, then content and calls. The parsers need the markers in the text: a request
that may call tools or thinks decodes its output with special tokens kept (``Admission.mint`` does this for
such a ``ChatPrompt``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from dgserve.structured.tool_parser import ToolCall, ToolCallDelta, ToolCallParser
from dgserve.text.reasoning import ReasoningSplitter


@dataclass
class ChatDelta:
    """What became final in one piece of output: OpenAI's ``choices[0].delta`` fields."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)


@dataclass
class ChatMessage:
    """A whole output as OpenAI's assistant message fields."""

    content: str
    reasoning_content: str
    tool_calls: list[ToolCall]


class ChatOutputParser:
    """Splits a chat output fed piece by piece. ``tools``: read tool calls (the request may call tools);
    ``thinking``: read the thought channel (the prompt enabled thinking); ``id_seed``: the call ids' seed
    (``tool_parser.call_id_seed``; None: random ids); ``names``: the functions it may call (None: any). With
    neither, all text is content. A call is returned only whole and valid; a cut one never (``ToolCallParser``)."""

    def __init__(self, tools: bool, thinking: bool, id_seed: bytes | None = None, names: Collection[str] | None = None):
        self._reasoning = ReasoningSplitter() if thinking else None
        self._tools = ToolCallParser(id_seed, names) if tools else None
        self.reasoning_content = ""
        self.content = ""

    def push(self, text: str) -> ChatDelta:
        """Feed the next piece of the output's text (e.g. a committed block's); returns what became final."""
        reasoning, content = self._reasoning.push(text) if self._reasoning is not None else ("", text)
        return self._content(reasoning, content, final=False)

    def finish(self, cut: bool = False) -> ChatDelta:
        """The end of the output: what was held back is released. ``cut``: the output did not end on its own (the
        token budget, the context, a stop string or a cancel ended it): a held piece of a marker is dropped, not
        made text (a call it was cut in never is a call, cut or not)."""
        reasoning, content = self._reasoning.finish(cut) if self._reasoning is not None else ("", "")
        return self._content(reasoning, content, final=True, cut=cut)

    def _content(self, reasoning: str, content: str, final: bool, cut: bool = False) -> ChatDelta:
        calls: list[ToolCallDelta] = []
        if self._tools is not None:
            content, calls = self._tools.push(content)
            if final:
                more, rest = self._tools.finish(cut)
                content, calls = content + more, calls + rest
        self.reasoning_content += reasoning
        self.content += content
        return ChatDelta(content, reasoning, calls)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls read so far (complete ones; after ``finish``, all)."""
        return list(self._tools.calls) if self._tools is not None else []

    def message(self) -> ChatMessage:
        """The output read so far as one message (call after ``finish`` for the whole output)."""
        return ChatMessage(self.content, self.reasoning_content, self.tool_calls)


def parse_chat_output(
    text: str, tools: bool, thinking: bool, id_seed: bytes | None = None, cut: bool = False
) -> ChatMessage:
    """The message of a whole output: the same as feeding ``ChatOutputParser`` the text in any pieces."""
    parser = ChatOutputParser(tools, thinking, id_seed)
    parser.push(text)
    parser.finish(cut)
    return parser.message()
