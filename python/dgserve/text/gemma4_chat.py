"""The built-in Gemma 4 chat format, for checkpoints without a chat template of their own (docs/architecture.md,
"Chat template"; docs/tools.md).

Contract: `render_gemma4(messages, bos_token, add_generation_prompt, enable_thinking, tools)` renders validated
messages (``dgserve.text.messages.validate_messages``) and OpenAI-shaped tools as the prompt string the Gemma 4
templates write; the marker texts and tool pieces are `dgserve.text.gemma4`'s.
"""

from __future__ import annotations

from dgserve.text import gemma4
from dgserve.text.messages import message_text


def render_gemma4(
    messages: list[dict],
    bos_token: str,
    add_generation_prompt: bool,
    enable_thinking: bool,
    tools: list[dict] | None = None,
) -> str:
    """The built-in Gemma 4 turn format (docs/architecture.md, "Chat template"), for validated messages.

    `{bos}` then one `<|turn>{role}\\n{text}<turn|>\\n` per message, role "assistant" written "model"; text is
    used verbatim (not stripped). The generation prompt is `<|turn>model\\n`, followed by an empty thought channel
    `<|channel>thought\\n<channel|>` unless thinking is enabled. With `enable_thinking`, `<|think|>` opens the
    system turn, right after `<|turn>system\\n`; when there is no system message, a system turn holding only
    `<|think|>` is created (as the Gemma 4 templates do), so the model always sees the switch.

    Tools (docs/tools.md): each of `tools` (OpenAI-shaped) is declared at the end of the system turn (created when
    there is no system message) as `<|tool>declaration:NAME{...}<tool|>`. An assistant message with tool_calls
    writes its reasoning_content (only in the turn after the last user message) as a thought channel, then each
    call `<|tool_call>call:NAME{...}<tool_call|>`, then each result of the tool messages that follow it
    `<|tool_response>response:NAME{"value":...}<tool_response|>`, then its text. After results and no text the
    model's turn stays open: the next assistant message continues it (no new header), and the generation prompt is
    empty (the model goes on right after the results). Calls without results end with `<|tool_response>`, where the
    model stops after calling. Bodies are compact JSON (`dgserve.text.gemma4`).
    """
    tools = tools or []
    parts = [bos_token]
    has_system = messages[0]["role"] == "system"
    if enable_thinking or tools or has_system:
        think = "<|think|>" if enable_thinking else ""
        system = message_text(messages[0]["content"]) if has_system else ""
        declared = "".join(gemma4.declaration(t) for t in tools)
        parts.append(f"<|turn>system\n{think}{system}{declared}<turn|>\n")
    rest = messages[1:] if has_system else messages
    last_user = max((i for i, m in enumerate(rest) if m["role"] == "user"), default=-1)
    open_turn = False  # the model's turn goes on (after tool results, or calls waiting for results)
    for i, msg in enumerate(rest):
        if msg["role"] == "tool":
            continue  # written next to the call it answers
        if msg["role"] not in ("assistant", "model"):
            parts.append(f"<|turn>{msg['role']}\n{message_text(msg['content'])}<turn|>\n")
            open_turn = False
            continue
        if not open_turn:
            parts.append("<|turn>model\n")
        open_turn = _model_message(msg, rest[i + 1 :], i > last_user, parts)
    if add_generation_prompt and not open_turn:
        parts.append("<|turn>model\n")
        if not enable_thinking:
            parts.append("<|channel>thought\n<channel|>")
    return "".join(parts)


def _model_message(msg: dict, after: list[dict], current: bool, parts: list[str]) -> bool:
    """Append an assistant message's body (see `render_gemma4`) to `parts`; True when the model's turn stays open.
    `after`: the messages after it (its results are the tool messages right after it); `current`: it comes after
    the last user message (its reasoning is written back)."""
    calls = msg.get("tool_calls") or []
    reasoning = msg.get("reasoning_content")
    if calls and reasoning and current:
        parts.append(gemma4.thought(reasoning))
    parts.extend(gemma4.tool_call(c) for c in calls)
    names = {c["id"]: c["function"]["name"] for c in calls}
    results = 0
    for r in after if calls else []:
        if r["role"] != "tool":
            break
        parts.append(gemma4.tool_response(names[r["tool_call_id"]], message_text(r["content"])))
        results += 1
    text = message_text(msg.get("content"))
    parts.append(text)
    if calls and not results:
        parts.append(gemma4.TOOL_RESPONSE_BEGIN)
        return True
    if results and not text:
        return True
    parts.append("<turn|>\n")
    return False
