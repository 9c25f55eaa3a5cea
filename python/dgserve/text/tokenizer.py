"""Tokenizer and chat template for DiffusionGemma checkpoints (docs/architecture.md, "Chat template").

`Tokenizer` wraps a Hugging Face `tokenizers` tokenizer read from a checkpoint's `tokenizer.json`, plus the special
tokens and chat template of `tokenizer_config.json` / `chat_template.jinja` (read by `dgserve.text.tokenizer_files`).
A checkpoint's own chat template is authoritative and is rendered in a sandboxed jinja2 environment, as
transformers does (`dgserve.text.chat_template`); checkpoints without one get the built-in Gemma 4 turn format
(`render_gemma4`, from `dgserve.text.gemma4_chat`). `IncrementalDecoder` (`dgserve.text.incremental_decoder`)
turns committed blocks of token ids into text deltas for streaming and stop strings. Both are importable from
here too.

v1 is text-only: a non-text content part (an image, audio, ...) raises NotImplementedError.

Bounded work: `encode(text, max_tokens=n)` never tokenizes a text that cannot fit in full. A text whose byte length
already exceeds n times the most bytes one token can cover (`max_token_bytes`) is rejected before any tokenizing;
a long text that passes is first counted in bounded chunks, stopping as soon as the count is over n.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
from collections.abc import Iterable, Sequence

import jinja2
import tokenizers

from dgserve.text import inert
from dgserve.text.chat_template import _compile_template, _cut_after, _final_text, _plain_tools, request_template
from dgserve.text.gemma4_chat import render_gemma4 as render_gemma4
from dgserve.text.incremental_decoder import IncrementalDecoder as IncrementalDecoder
from dgserve.text.messages import IMAGE_MARK, check_unicode, validate_messages
from dgserve.text.token_bounds import COUNT_CHUNK_CHARS, PromptTooLongError, chunks, max_token_bytes
from dgserve.text.tokenizer_files import (
    CONFIG_FILE,
    DEFAULT_SPECIAL_TOKENS,
    TOKENIZER_FILE,
    _read_config,
    _special_from_config,
    _template_from_files,
    _warn_if_files_disagree,
    adds_token,
)


class Tokenizer:
    """Text <-> token ids, and chat rendering.

    Parameters
    ----------
    tokenizer : tokenizers.Tokenizer
        The underlying tokenizer. Its post-processor (tokenizer.json's ``post_processor``) is what
        ``encode(..., add_special_tokens=True)`` applies, as transformers 5.23's ``AutoTokenizer`` does: it alone
        decides whether BOS (or anything else) is added.
    bos_token, eos_token, pad_token : str or None
        Special token texts; each one given must be in the vocabulary (ValueError naming it otherwise).
    chat_template : str or None
        A jinja2 chat template (None: the built-in Gemma 4 format). Compiled here: a syntax error is a ValueError
        naming `template_source`.
    template_source : str
        Where the template came from, for error messages.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        template_source: str = "chat_template",
    ):
        self._tok = tokenizer
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.bos_token_id = self._special_id("bos_token", bos_token)
        self.eos_token_id = self._special_id("eos_token", eos_token)
        self.pad_token_id = self._special_id("pad_token", pad_token)
        self.add_bos_token = adds_token(tokenizer, self.bos_token_id, first=True)
        self.add_eos_token = adds_token(tokenizer, self.eos_token_id, first=False)
        self.chat_template = chat_template
        self._template = None if chat_template is None else _compile_template(chat_template, template_source)
        self.max_token_bytes = max_token_bytes(tokenizer)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """Load a checkpoint directory's tokenizer.

        Reads `tokenizer.json` (required), `tokenizer_config.json` (optional: `chat_template`, `bos_token`,
        `eos_token`, `pad_token` as strings or `{"content": ...}` dicts) and `chat_template.jinja`
        (optional; takes precedence over the config's `chat_template`). A special token the config does not name
        defaults to the Gemma name (`<bos>`, `<eos>`, `<pad>`) when the vocabulary has it, else None.

        BOS/EOS: as transformers 5.23 does when a checkpoint has a `tokenizer.json`, the config's `add_bos_token`
        and `add_eos_token` are ignored and `tokenizer.json`'s post-processor decides what `encode(...,
        add_special_tokens=True)` adds. Where the config states one that the post-processor does not do (or the
        reverse), one warning naming the files and the disagreement is logged, and the post-processor wins.

        Raises FileNotFoundError naming the missing directory or `tokenizer.json`, and ValueError naming the file
        (and field) when a file is unreadable or a field has a bad value.
        """
        root = pathlib.Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {root}")
        tok_file = root / TOKENIZER_FILE
        if not tok_file.is_file():
            raise FileNotFoundError(f"{TOKENIZER_FILE} not found in {root}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise ValueError(f"{tok_file}: not a valid tokenizer file ({e})") from e
        config = _read_config(root / CONFIG_FILE)
        specials = {
            name: _special_from_config(config, name, root / CONFIG_FILE, tok) for name in DEFAULT_SPECIAL_TOKENS
        }
        for key in ("add_bos_token", "add_eos_token"):
            if key in config and not isinstance(config[key], bool):
                raise ValueError(f"{root / CONFIG_FILE}: {key} must be a boolean, got {config[key]!r}")
        template, source = _template_from_files(root, config)
        out = cls(tok, **specials, chat_template=template, template_source=source)
        _warn_if_files_disagree(out.add_bos_token, out.add_eos_token, config, root)
        return out

    def _special_id(self, name: str, text: str | None) -> int | None:
        if text is None:
            return None
        tid = self._tok.token_to_id(text)
        if tid is None:
            raise ValueError(f"{name}: {text!r} is not in the tokenizer's vocabulary")
        return tid

    # ------------------------------------------------------------------ text <-> ids

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what grammar engines build their token tables from)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, tok: str) -> int | None:
        """The id of token text `tok` (a vocabulary entry or an added token), or None."""
        return self._tok.token_to_id(tok)

    def encode(self, text: str, add_special_tokens: bool = False, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`. Special-token texts in `text` (e.g. `<|turn>`) become their single ids.

        With `add_special_tokens`, the tokenizer's post-processor adds its special tokens (e.g. BOS), exactly as
        transformers' `AutoTokenizer` and `tokenizers` do: the same ids on every path, even for text that itself
        starts with `<bos>` (then there are two, as there are in transformers).
        With `max_tokens`, a text with more ids raises PromptTooLongError, with bounded work (module docstring).
        Text that is not valid Unicode (a lone surrogate, which `tokenizers` cannot take) raises ValueError naming
        `prompt`.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        check_unicode(text, "prompt")
        if max_tokens is not None:
            self._check_bound(text, max_tokens)
        ids = self._tok.encode(text, add_special_tokens=bool(add_special_tokens)).ids
        if max_tokens is not None and len(ids) > max_tokens:
            raise PromptTooLongError(len(ids), max_tokens, "counted")
        return ids

    def encode_content(self, text: str, max_tokens: int | None = None, field: str = "prompt") -> list[int]:
        """Token ids of caller content: `text` as ordinary text (special-token texts such as `<|turn>` are their
        characters, never control tokens) and no BOS or other added tokens. `max_tokens` as in `encode`; a text
        that is not valid Unicode raises ValueError naming `field`."""
        if not isinstance(text, str):
            raise ValueError(f"{field}: text must be a str, got {type(text).__name__}")
        check_unicode(text, field)
        if max_tokens is not None:
            self._check_bound(text, max_tokens)
        ids = self._specials.plain.encode(text, add_special_tokens=False).ids
        if max_tokens is not None and len(ids) > max_tokens:
            raise PromptTooLongError(len(ids), max_tokens, "counted")
        return ids

    def _check_bound(self, text: str, limit: int) -> None:
        """PromptTooLongError when `text` surely has more than `limit` tokens: by its byte length alone, else by
        counting chunks of it (each chunk's tokens are bounded by its size, and the count stops once over)."""
        k = self.max_token_bytes
        n_bytes = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        if k is not None and n_bytes > limit * k:
            raise PromptTooLongError(-(-n_bytes // k), limit, f"{n_bytes} bytes, a token covers at most {k}")
        if len(text) <= COUNT_CHUNK_CHARS:
            return
        count = 0
        for cuts, chunk in enumerate(chunks(text, COUNT_CHUNK_CHARS)):
            count += len(self._tok.encode(chunk, add_special_tokens=False).ids)
            # a cut can split a token in two: allow one token per cut before concluding
            if count - cuts > limit:
                raise PromptTooLongError(count - cuts, limit, f"counted in the first {cuts + 1} chunks")

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids (any iterable of ints, e.g. a list or a 1-D tensor). Incomplete or invalid UTF-8
        decodes to U+FFFD; ids outside the vocabulary are dropped (the `tokenizers` behaviour)."""
        ids = [int(i) for i in ids]
        if any(i < 0 for i in ids):
            raise ValueError("ids must be non-negative")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
        tools: Sequence[dict] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> str:
        """Render `messages` as a prompt string.

        `messages` is a non-empty list of `{"role": r, "content": c}` with r in system | user | assistant | model |
        tool (system only as the first message) and c a str or a list of `{"type": "text", "text": str}` parts;
        assistant messages may carry `tool_calls` (content then may be None) and tool messages `tool_call_id`
        (`dgserve.text.messages`); other keys are passed through to a checkpoint template. Invalid input raises
        ValueError naming the field (`messages[i].role`, ...); a non-text part raises NotImplementedError naming
        `messages[i].content[j].type`. `tools`: OpenAI-shaped function tools (`{"type": "function", "function":
        {"name", "description", "parameters"}}`, see `dgserve.structured.tools`) the prompt declares; None or
        empty: none.

        With a checkpoint template: rendered in jinja2's ImmutableSandboxedEnvironment with `messages`, `tools`
        (None when there are none), `add_generation_prompt`, `enable_thinking`, `bos_token`, `eos_token`,
        `pad_token` and transformers' helpers (`raise_exception`, `tojson`, `strftime_now`, `namespace`), as
        transformers does; tool call arguments are objects there. A template error raises ValueError with jinja's
        message. Without one: the built-in Gemma 4 format, see `render_gemma4`.

        `chat_template`: a template given with the request (rendered as the checkpoint's would be, in the same
        sandbox; the server accepts one only when its operator trusts its callers). `continue_final_message`: the
        last message, an assistant's, is left open for the model to continue (transformers' rule: the rendered
        text is cut right after that message's text); give it without `add_generation_prompt`.
        """
        return self._render_chat(
            validate_messages(messages),
            _plain_tools(tools),
            add_generation_prompt,
            enable_thinking,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
        )

    def _render_chat(
        self,
        plain: list[dict],
        plain_tools: list[dict],
        add_generation_prompt: bool,
        enable_thinking: bool,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> str:
        """The template (the request's, the checkpoint's or the built-in format) applied to validated messages and
        tools, cut after the final message's text for ``continue_final_message``."""
        final = _final_text(plain, add_generation_prompt) if continue_final_message else ""
        template = self._template if chat_template is None else request_template(chat_template)
        if template is None:
            bos = self.bos_token or "<bos>"
            text = render_gemma4(plain, bos, add_generation_prompt, enable_thinking, plain_tools)
        else:
            text = self._render(template, plain, plain_tools, add_generation_prompt, enable_thinking)
        return _cut_after(text, final) if continue_final_message else text

    def _render(self, template, plain, plain_tools, add_generation_prompt, enable_thinking) -> str:
        try:
            return template.render(
                messages=plain,
                tools=plain_tools or None,
                add_generation_prompt=bool(add_generation_prompt),
                enable_thinking=bool(enable_thinking),
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                pad_token=self.pad_token or "",
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {e}") from e

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
        max_tokens: int | None = None,
        tools: Sequence[dict] | None = None,
        image_runs: Sequence[Sequence[int]] = (),
        **options,
    ) -> list[int]:
        """Token ids of the rendered chat. The special tokens the template writes become their ids; no BOS is added
        beyond what the template wrote (it writes `<bos>` itself), as transformers' `apply_chat_template(tokenize=
        True)` does. Text the caller supplied (message content, reasoning, tool calls and results, tool
        declarations) never becomes a special token: a `<|turn>` typed in it is ordinary text (`dgserve.text.inert`;
        a conversation without such text gets exactly the ids of encoding `apply_chat_template`'s string).
        `max_tokens`: as for `encode`, applied to the rendered text. `tools` and `options` (continue_final_message,
        chat_template): as for `apply_chat_template`. ``image_runs``: the ids of each ``{"type": "image"}`` part in
        order (BOI, the placeholders, EOI), spliced where the part stands; the text between is tokenized piece by
        piece (special tokens split the text anyway, so these are the ids transformers' processor makes).
        ValueError when the parts and runs disagree."""
        plain, plain_tools = validate_messages(messages), _plain_tools(tools)
        strings = inert.caller_strings([plain, plain_tools])
        restore: dict[str, str] = {}  # sentinel -> the character it stands for, when caller text was defanged
        if self._specials.needs_defang(strings):
            templates = [self.chat_template or "", options.get("chat_template") or ""]
            swap = self._specials.sentinels([*strings, *templates])
            plain, plain_tools = inert.defang([plain, plain_tools], swap)
            restore = {v: k for k, v in swap.items()}
        text = self._render_chat(plain, plain_tools, add_generation_prompt, enable_thinking, **options)
        pieces = self._split_image_places(text, image_runs)
        if len(pieces) != len(image_runs) + 1:
            if not image_runs:
                raise ValueError("messages: an image part without its image")
            raise ValueError(f"messages: {len(pieces) - 1} image places in the prompt for {len(image_runs)} images")
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            room = None if max_tokens is None else max(max_tokens - len(ids), 0)
            ids += self._encode_rendered(piece, restore, room)
            if k < len(image_runs):
                ids += image_runs[k]
                if max_tokens is not None and len(ids) > max_tokens:
                    raise PromptTooLongError(len(ids), max_tokens, "at least")
        return ids

    def _split_image_places(self, text: str, image_runs: Sequence[Sequence[int]]) -> list[str]:
        """Rendered chat text cut at its image places: the built-in format writes ``IMAGE_MARK`` for an image part;
        a checkpoint's template writes the image token's own text (``<|image|>`` in Gemma 4's templates), which
        transformers' processor then expands as ``image_runs`` do here. Caller text never holds either: the mark is
        noncharacters, and a special token's text typed by the caller was swapped for sentinels before rendering."""
        marks = [IMAGE_MARK]
        if image_runs and len(image_runs[0]) > 2:  # a run is BOI, the placeholders, EOI
            placeholder = self._tok.id_to_token(int(image_runs[0][1]))
            if placeholder and placeholder in self._specials.texts:
                marks.append(placeholder)
        if len(marks) == 1:
            return text.split(IMAGE_MARK)
        return re.split("|".join(re.escape(m) for m in marks), text)

    def _encode_rendered(self, text: str, restore: dict[str, str], max_tokens: int | None) -> list[int]:
        """Ids of rendered chat text: plainly encoded, or with ``restore``'s sentinels read as the caller's text."""
        if not restore:
            return self.encode(text, add_special_tokens=False, max_tokens=max_tokens)
        if max_tokens is not None:
            self._check_bound(text.translate({ord(k): v for k, v in restore.items()}), max_tokens)
        ids = self._specials.encode(self._tok, text, restore)
        if max_tokens is not None and len(ids) > max_tokens:
            raise PromptTooLongError(len(ids), max_tokens, "counted")
        return ids

    @functools.cached_property
    def _specials(self) -> inert.SpecialTokens:
        """The special tokens and the copy of the tokenizer that reads their texts as text (built on first use)."""
        return inert.SpecialTokens(self._tok)
