"""What a request asks the model: a prompt (text, token ids, or a chat with its tools), the ``Submission`` every
door hands the engine (the prompt with the request's knobs and options), and what a chat's tools mean for the
request's output (``with_tools``; docs/tools.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dgserve.engine.request import DraftSpec
from dgserve.media.images import ImageInput
from dgserve.sampling_params import SamplingParams
from dgserve.structured.tools import ToolSet

if TYPE_CHECKING:
    from dgserve.engine.request import Request
    from dgserve.structured.chat_output import ChatOutputParser


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages ({"role", "content"} dicts, see ``Tokenizer.apply_chat_template``) as a prompt.

    ``tools`` (docs/tools.md): the request's tools, tool_choice and parallel_tool_calls. The prompt declares the
    tools (unless tool_choice is "none"), and the admission (``Admission.mint``) turns them into the request's output
    constraint (a tool_calls ``ResponseFormat``), so every call the model writes is valid. With tools it may call
    or ``enable_thinking``, the output text keeps special tokens (the markers); ``output_parser`` reads it as
    reasoning, content and tool calls. ``continue_final_message``: the last (assistant) message is left open and
    the model continues it; ``chat_template``: a template sent with the request, used instead of the checkpoint's
    (``Tokenizer.apply_chat_template``)."""

    messages: tuple[dict[str, Any], ...]
    add_generation_prompt: bool = True
    enable_thinking: bool = False
    tools: ToolSet | None = None
    continue_final_message: bool = False
    chat_template: str | None = None
    # the images of the messages' ``{"type": "image"}`` parts, in order (media.chat.read_images made them)
    images: tuple[ImageInput, ...] = ()

    @property
    def calls_tools(self) -> bool:
        """Whether the model may call tools (tools given, and tool_choice is not "none")."""
        return self.tools is not None and self.tools.calls

    @property
    def keeps_markers(self) -> bool:
        """Whether the output is decoded with special tokens kept: tools it may call, or thinking (the parsers
        read the markers)."""
        return self.calls_tools or self.enable_thinking

    def output_parser(self, request: Request) -> ChatOutputParser:
        """The parser of ``request``'s output (made from this prompt): tool calls of the functions it may call
        when it may call tools, reasoning when thinking is enabled, call ids seeded by its seed and prompt."""
        from dgserve.structured.chat_output import ChatOutputParser
        from dgserve.structured.tool_parser import call_id_seed

        seed = request.params.seed if request.params.seed is not None else 0
        names = self.tools.callable_names if self.tools is not None else None
        return ChatOutputParser(self.calls_tools, self.enable_thinking, call_id_seed(seed, request.prompt_ids), names)


@dataclass(frozen=True)
class ImagePrompt:
    """Token ids with images, as transformers' processor makes them: each image stands in ``ids`` as a run of
    ``image_token_id`` placeholders, one per soft token (BOI and EOI around it are the caller's)."""

    ids: tuple[int, ...]
    images: tuple[ImageInput, ...]


Prompt = str | Sequence[int] | torch.Tensor | ChatPrompt | ImagePrompt


@dataclass(frozen=True)
class Submission:
    """One request as a door hands it to the engine (``AsyncEngine.submit``, ``Engine.make_request``): what every
    door converts its request into, so a per-request option is added here once for all doors.

    ``params``: the knobs (None: the model's defaults). ``request_id``: the caller's id (None: the engine mints
    one). ``drafts``: the previews the caller wants. ``owner``: the caller's identity (ids are scoped by it, and
    only it may abort the request). ``fill_context``: the caller set no token limit: the server's default applies
    (``Admission.mint``). ``limit_field``: the caller's name for its output limit, named when it is refused
    (``--max-tokens-policy reject``). ``cache_salt``: reuse only prefix-cache blocks of requests
    with the same owner and salt (docs/prefix-caching.md). ``initial_canvas``: the starting canvas (text, tokenized
    as content without BOS, or token ids, -1 for a blank), laid over the request's canvases from the first;
    ``pinned``: True (every draft position) or ``[start, end)`` ranges of draft positions that keep their draft
    token to the commit (docs/edit-in-place.md). Both are request content, like the prompt. ``caller``: whose fair
    share of the running slots the request takes (docs/architecture.md, "Fair shares between callers"); None: the
    owner's."""

    prompt: Prompt
    params: SamplingParams | None = None
    request_id: str | None = None
    drafts: DraftSpec | None = None
    owner: str | None = None
    fill_context: bool = False
    cache_salt: str | None = None
    initial_canvas: str | Sequence[int] | None = None
    pinned: bool | Sequence[Sequence[int]] | None = None
    caller: str | None = None
    limit_field: str = "max_new_tokens"


def with_tools(prompt: Prompt, params: SamplingParams) -> SamplingParams:
    """``params`` with the output constraint of a ``ChatPrompt``'s tools (docs/tools.md): a tool_calls
    ``ResponseFormat`` unless tool_choice is "none". A request that may call tools cannot also ask for a
    response_format, stop strings, stop_token_ids, min_tokens or ignore_eos (ValueError naming that field): the
    tool grammar decides where the output ends (EOS after the calls, or where the text ends)."""
    if not isinstance(prompt, ChatPrompt) or prompt.tools is None:
        return params
    fmt = prompt.tools.response_format(thinking=prompt.enable_thinking)
    if fmt is None:
        return params
    why = "cannot be combined with tools unless tool_choice is none (the tool grammar shapes the output)"
    if params.response_format is not None:
        raise ValueError(f"response_format: {why}")
    if params.stop:
        raise ValueError(f"stop: {why}")
    if params.ignore_eos:
        raise ValueError(f"ignore_eos: {why}")
    for name in ("stop_token_ids", "min_tokens"):
        if getattr(params, name):
            raise ValueError(f"{name}: {why}")
    return dataclasses.replace(params, response_format=fmt)
