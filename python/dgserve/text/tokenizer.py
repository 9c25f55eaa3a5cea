"""Tokenizer and chat template for DiffusionGemma checkpoints (docs/architecture.md, "Chat template").

`Tokenizer` wraps a Hugging Face `tokenizers` tokenizer read from a checkpoint's `tokenizer.json`, plus the special
tokens and chat template of `tokenizer_config.json` / `chat_template.jinja`. A checkpoint's own chat template is
authoritative and is rendered in a sandboxed jinja2 environment, as transformers does; checkpoints without one get
the built-in Gemma 4 turn format. `IncrementalDecoder` turns committed blocks of token ids into text deltas for
streaming and stop strings.

v1 is text-only: a non-text content part (an image, audio, ...) raises NotImplementedError.

Bounded work: `encode(text, max_tokens=n)` never tokenizes a text that cannot fit in full. A text whose byte length
already exceeds n times the most bytes one token can cover (`max_token_bytes`) is rejected before any tokenizing;
a long text that passes is first counted in bounded chunks, stopping as soon as the count is over n.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import pathlib
import re
from collections.abc import Iterable, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import tokenizers

from dgserve.text import gemma4, inert
from dgserve.text.messages import IMAGE_MARK, check_unicode, message_text, validate_messages
from dgserve.text.token_bounds import COUNT_CHUNK_CHARS, PromptTooLongError, chunks, max_token_bytes

log = logging.getLogger("dgserve")

DEFAULT_SPECIAL_TOKENS = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


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
        _warn_if_files_disagree(out, config, root)
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


# ---------------------------------------------------------------------- files


def adds_token(tok: tokenizers.Tokenizer, token_id: int | None, first: bool) -> bool:
    """Whether `tok`'s post-processor puts `token_id` first (`first`) or last in an encoded single sequence."""
    if token_id is None or tok.post_processor is None:
        return False
    ids = tok.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0 if first else -1] == token_id and ids != tok.encode("a", add_special_tokens=False).ids


def _warn_if_files_disagree(tok: Tokenizer, config: dict, root: pathlib.Path) -> None:
    """One warning when tokenizer_config.json's add_bos_token / add_eos_token disagree with what tokenizer.json's
    post-processor does (transformers 5.23 ignores the config's flags; so does dgserve)."""
    issues = []
    for key, does in (("add_bos_token", tok.add_bos_token), ("add_eos_token", tok.add_eos_token)):
        if key in config and config[key] != does:
            issues.append(
                f"{key} is {str(config[key]).lower()} but the post-processor "
                f"{'adds' if does else 'does not add'} {'BOS' if 'bos' in key else 'EOS'}"
            )
    if issues:
        log.warning(
            "%s disagrees with %s: %s; following %s, as transformers does",
            root / CONFIG_FILE,
            root / TOKENIZER_FILE,
            "; ".join(issues),
            TOKENIZER_FILE,
        )


def _read_config(file: pathlib.Path) -> dict:
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return config


def _special_from_config(config: dict, name: str, file: pathlib.Path, tok: tokenizers.Tokenizer) -> str | None:
    """The text of special token `name`: the config's value (a str or a {"content": str} dict), else the Gemma
    default when the vocabulary has it, else None."""
    value = config.get(name)
    if value is None:
        default = DEFAULT_SPECIAL_TOKENS[name]
        return default if tok.token_to_id(default) is not None else None
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise ValueError(f'{file}: {name} must be a string or a {{"content": string}} object')
    if tok.token_to_id(value) is None:
        raise ValueError(f"{file}: {name} {value!r} is not in the tokenizer's vocabulary")
    return value


def _template_from_files(root: pathlib.Path, config: dict) -> tuple[str | None, str]:
    """(template, source): `chat_template.jinja` wins over the config's `chat_template`, which may be a str or
    transformers' list of `{"name", "template"}` (the one named "default" is used)."""
    jinja_file = root / TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
        except UnicodeDecodeError as e:
            raise ValueError(f"{jinja_file}: not UTF-8 text ({e})") from e
    source = f"{root / CONFIG_FILE}: chat_template"
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{source}: a list of templates needs one named 'default'")
        value = named["default"]
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{source}: must be a string")
    return value, source


# ---------------------------------------------------------------------- the built-in format


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


# ---------------------------------------------------------------------- sandboxed jinja


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


# ---------------------------------------------------------------------- streaming


class IncrementalDecoder:
    """Text deltas of a token stream, fed block by block.

    `push(ids)` returns the text that became final; the concatenation of all deltas is `text`. A delta never ends
    inside a multi-byte UTF-8 character: text whose last character is U+FFFD (an incomplete sequence so far) is
    held back until later tokens complete it, looking back at most `MAX_HOLD` tokens. `flush()` releases what is
    held, U+FFFD included when the bytes never complete, so that after it `text == tokenizer.decode(all_ids,
    skip_special_tokens)`. Each push decodes only a window from the previous block on (vLLM's prefix/read offsets),
    which also keeps decoders that treat the first token specially consistent. `text_with(ids)` is the full text
    the stream would have with `ids` appended, from the same window, without pushing them.

    `tokenizer` needs only `decode(ids, skip_special_tokens=...)`.
    """

    MAX_HOLD = 8  # tokens; a UTF-8 character has at most 4 bytes, each token at least one

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] is the context already emitted, re-decoded for continuity
        self._read = 0  # ids[:_read] are emitted
        self._seen = ""  # decode(ids[_prefix:_read])
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    @property
    def token_ids(self) -> list[int]:
        """All ids pushed so far."""
        return list(self._ids)

    def push(self, ids: Iterable[int]) -> str:
        """Append `ids`; return the newly final text ("" when nothing is final yet)."""
        self._ids.extend(int(i) for i in ids)
        for end in range(len(self._ids), max(self._read, len(self._ids) - self.MAX_HOLD), -1):
            new = self._decode(self._prefix, end)
            if len(new) > len(self._seen) and not new.endswith("\ufffd"):
                return self._emit(new, end)
        return ""

    def flush(self) -> str:
        """Emit everything still held (end of stream) and return it."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self._decode(self._prefix, len(self._ids)), len(self._ids))

    def text_with(self, ids: Sequence[int]) -> str:
        """decode(pushed ids + `ids`), held-back bytes included (U+FFFD where still incomplete); pushes nothing.
        Costs one decode of the window from the previous emit on, not of the whole stream."""
        window = self._ids[self._prefix :] + [int(i) for i in ids]
        decoded = self._tokenizer.decode(window, skip_special_tokens=self._skip)
        return self._text + decoded[len(self._seen) :]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _emit(self, window_text: str, end: int) -> str:
        """Emit decode(ids[_prefix:end]) beyond what was seen; the emitted span becomes the next context."""
        delta = window_text[len(self._seen) :]
        self._prefix, self._read = self._read, end
        self._seen = self._decode(self._prefix, self._read)
        self._text += delta
        return delta
