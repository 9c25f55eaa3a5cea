"""The Messages API's system and messages → OpenAI chat messages (docs/messages-api.md), checked with the block's
field in each message (``messages[3].content[0].tool_use_id: …``): ``system`` is the system message, a user
message's ``tool_result`` blocks are tool messages (they come first, answering the ``tool_use`` blocks of the
assistant message before), its text the user message after them; an assistant message's ``thinking`` is its
``reasoning_content``, its ``tool_use`` blocks its ``tool_calls``. Bounded work: messages and blocks are refused
by their count before they are read.
"""

from __future__ import annotations

import json

from dgserve.text.messages import check_unicode

from ...errors import clip
from ...images import anthropic_image
from ..fields import OBJECT, known, nonempty, string, string_or_list

USER_BLOCKS = ("text", "image", "tool_result")
ASSISTANT_BLOCKS = ("text", "thinking", "redacted_thinking", "tool_use")
MEDIA_BLOCKS = ("document",)  # refused as not supported yet (a 400 naming the block), not as unknown


class Conversation:
    """Anthropic's system and messages as OpenAI chat messages (module doc). ``pending``: the tool_use ids of the
    assistant turn just read, which the next user message's tool_result blocks answer (each once)."""

    def __init__(self):
        self.turns: list[dict] = []  # the chat messages after the system message
        self.system: list[str] = []  # the system texts, joined once by ``messages`` (linear in their size)
        self.tool_uses: set[str] = set()  # every tool_use id of the conversation (they are unique)
        self.pending: set[str] = set()

    @property
    def messages(self) -> list[dict]:
        """The chat messages: the one system message (every system text, joined by a blank line), then the turns."""
        if not self.system:
            return list(self.turns)
        return [{"role": "system", "content": "\n\n".join(self.system)}, *self.turns]

    def add_system(self, value) -> None:
        """``system``: a string or a list of text blocks (joined by a blank line), the one system message."""
        if value is not None:
            self._system(value, "system")

    def _system(self, value, field: str) -> None:
        """System text (a string or text blocks), appended to the one system message, which opens the chat (the
        chat template has one system turn)."""
        if isinstance(value, str):
            check_unicode(value, field)
            text = value
        elif isinstance(value, list):
            text = "\n\n".join(_text_block(b, f"{field}[{i}]") for i, b in enumerate(value))
        else:
            raise ValueError(f"{field} must be a string or a list of text blocks")
        if text:
            self.system.append(text)  # joined once at the end: joining as they come is quadratic in their size

    def add_messages(self, value, max_len: int | None) -> None:
        if not isinstance(value, list) or not value:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        if max_len is not None:  # refused by their count, unread: each message and block renders to a token or more
            blocks = sum(len(m["content"]) for m in value if isinstance(m, dict) and isinstance(m.get("content"), list))
            if len(value) > max_len or blocks > max_len:
                raise ValueError(
                    f"messages: {len(value)} messages of {blocks} blocks exceed the context window of {max_len} "
                    "positions"
                )
        for i, message in enumerate(value):
            self.add(message, f"messages[{i}]")
        if not self.turns or self.turns[-1]["role"] not in ("user", "tool"):
            raise ValueError(
                f"messages[{len(value) - 1}].role: the last message must be the user's (continuing a final "
                "assistant message, a prefill, is not supported)"
            )

    def add(self, message, field: str) -> None:
        if not isinstance(message, dict):
            raise ValueError(f"{field} must be an object {{role, content}}")
        known(message, {"role", "content"}, field, OBJECT)
        role = message.get("role")
        content = message.get("content")
        if isinstance(content, list) and not content:
            raise ValueError(f"{field}.content must not be empty")
        if not isinstance(content, (str, list)):
            raise ValueError(f"{field}.content must be a string or a list of content blocks")
        if role == "system":  # Claude Code's mid-conversation system text: joins the one system message
            self._system(content, f"{field}.content")
        elif role == "user":
            self._user(content, f"{field}.content")
        elif role == "assistant":
            self._assistant(content, f"{field}.content")
        else:
            got = clip(str(role))
            raise ValueError(f"{field}.role must be user, assistant or system; got {got!r}")

    def _user(self, content: str | list, field: str) -> None:
        answered: set[str] = set()
        parts: list[dict] = []
        if isinstance(content, str):
            check_unicode(content, field)
            parts.append({"type": "text", "text": content})
            content = []
        for j, block in enumerate(content):
            at = f"{field}[{j}]"
            kind = _block_type(block, at, USER_BLOCKS)
            if kind == "text":
                parts.append({"type": "text", "text": _text_block(block, at)})
                continue
            if kind == "image":
                parts.append(anthropic_image(block, at))
                continue
            if parts:
                raise ValueError(f"{at}: tool_result blocks must come before any other content of the message")
            self.turns.append(self._tool_result(block, at, answered))
        self.pending = set()
        if parts:
            self.turns.append({"role": "user", "content": parts})

    def _tool_result(self, block: dict, at: str, answered: set[str]) -> dict:
        known(block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, at, OBJECT)
        use_id = nonempty(block.get("tool_use_id"), f"{at}.tool_use_id")
        if use_id not in self.pending:
            where = "an earlier turn" if use_id in self.tool_uses else "no tool_use of the conversation"
            raise ValueError(
                f"{at}.tool_use_id: {clip(use_id)!r} answers {where}; a tool_result must answer a tool_use block of "
                "the assistant message right before its message"
            )
        if use_id in answered:
            raise ValueError(f"{at}.tool_use_id: {clip(use_id)!r} is answered twice")
        answered.add(use_id)
        error = block.get("is_error")
        if error is not None and not isinstance(error, bool):
            raise ValueError(f"{at}.is_error must be a boolean")
        text = _result_content(block.get("content"), f"{at}.content")
        return {"role": "tool", "tool_call_id": use_id, "content": f"Error: {text}" if error else text}

    def _assistant(self, content: str | list, field: str) -> None:
        if isinstance(content, str):
            check_unicode(content, field)
            content = [{"type": "text", "text": content}]
        texts, thoughts, calls = [], [], []
        for j, block in enumerate(content):
            at = f"{field}[{j}]"
            kind = _block_type(block, at, ASSISTANT_BLOCKS)
            if kind == "text":
                texts.append(_text_block(block, at))
            elif kind == "thinking":
                known(block, {"type", "thinking", "signature", "cache_control"}, at, OBJECT)
                thoughts.append(string(block.get("thinking"), f"{at}.thinking"))
            elif kind == "tool_use":
                calls.append(self._tool_use(block, at))
            # redacted_thinking: opaque to us (never made here); dropped
        message: dict = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
        if thoughts:
            message["reasoning_content"] = "\n".join(thoughts)
        if calls:
            message["tool_calls"] = calls
        self.turns.append(message)
        self.pending |= {c["id"] for c in calls}

    def _tool_use(self, block: dict, at: str) -> dict:
        known(block, {"type", "id", "name", "input", "cache_control"}, at, OBJECT)
        use_id = nonempty(block.get("id"), f"{at}.id")
        if use_id in self.tool_uses:
            raise ValueError(f"{at}.id: {clip(use_id)!r} is the id of an earlier tool_use block")
        self.tool_uses.add(use_id)
        name = nonempty(block.get("name"), f"{at}.name")
        args = block.get("input")
        if not isinstance(args, dict):
            raise ValueError(f"{at}.input must be an object (the tool's arguments)")
        arguments = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
        return {"id": use_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _block_type(block, at: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(block, dict):
        raise ValueError(f"{at} must be a content block object")
    kind = block.get("type")
    if kind in MEDIA_BLOCKS:
        raise NotImplementedError(f"{at}.type: {kind} blocks are not supported yet (text only)")
    if kind not in allowed:
        got = clip(str(kind))
        raise ValueError(f"{at}.type: {got!r} is not supported in this message (supported: {', '.join(allowed)})")
    return kind


def _text_block(block, at: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise ValueError(f'{at} must be a text block {{"type": "text", "text": string}}')
    known(block, {"type", "text", "cache_control", "citations"}, at, OBJECT)
    return string(block.get("text"), f"{at}.text")


def _result_content(value, at: str) -> str:
    """A tool_result's content: absent, a string, or a list of text blocks (joined)."""
    if value is None:
        return ""
    value = string_or_list(value, at, "text blocks")
    if isinstance(value, str):
        return value
    texts = []
    for k, block in enumerate(value):
        _block_type(block, f"{at}[{k}]", ("text",))
        texts.append(_text_block(block, f"{at}[{k}]"))
    return "".join(texts)
