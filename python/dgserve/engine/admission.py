"""Admission: a submission checked and minted into a ``Request`` before the engine holds anything for it, as vLLM
v1's ``Processor`` sits before its ``EngineCore`` (docs/architecture.md, "The life of a request").

``Admission`` owns every check a request meets before it is queued: its id, its knobs against the engine's limits,
its prompt's ids (tokenized with bounded work) against the vocabulary, the context window and the KV cache slot,
its starting canvas and pins, its stop token ids, its grammar (compiled once per format), and it mints what the
request carries from then on: its id, its seed, its output rules and its prefix-cache keys. Every refusal is a
ValueError naming the field (``request_checks``), raised before the request holds a slot or a queue place.
Thread-safe: the async engine runs it on its tokenization pool (never on the event loop); it reads the model's
config and the engine's limits only, and the grammar cache has its own lock. ``Engine`` keeps add, abort, step
and commit.

Public contract:
    admission = Admission(model, tokenizer, defaults, eos_ids, limits, prefix_caching, time_limit=None)
    req = admission.make_request(sub, deadline=None)   # check_request_id, then mint: the whole admission
    req = admission.mint(sub, deadline=None)           # the same for a caller that has checked the id already
    ids = admission.prompt_ids(prompt, max_tokens)     # a prompt's checked ids, bounded work past max_tokens
    ids = admission.context_ids(prompt, max_new_tokens, at_least)  # ... that fit the context with the canvases
    n = admission.check_length(prompt, max_new_tokens, fill_context, at_least)  # a prompt's count, checked
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
from typing import TYPE_CHECKING

from dgserve.engine import request_checks as checks
from dgserve.engine.block import canvases
from dgserve.engine.grammar_rows import GrammarRows
from dgserve.engine.image_batch import image_spans
from dgserve.engine.initial_canvas import CanvasRules, read_initial_canvas
from dgserve.engine.prefix_cache import cache_salt, prefix_hashes
from dgserve.engine.prompt import Prompt, Submission, with_tools
from dgserve.engine.request import Request
from dgserve.engine.step_output import output_rules
from dgserve.model import DiffusionGemma
from dgserve.sampling_params import SamplingParams
from dgserve.text.token_bounds import PromptTooLongError

if TYPE_CHECKING:
    from dgserve.text.tokenizer import Tokenizer


class Admission:
    """Submissions in, checked ``Request`` objects out, for one engine's model and limits.

    defaults: the params of a submission without any. eos_ids: the ids that end an output (settable: the output
    rules of each new request read them). limits: the engine's bounds on one request (``RequestLimits``: canvas
    length, vocabulary, window, slot, work; ``prefill_chunk``, the prompt tokens per encoder chunk: an image's soft
    tokens must fit one, and the prefix cache's blocks are whole chunks). prefix_caching: mint prefix-cache keys.
    time_limit: the seconds a request may run from its admission into a slot (None: no limit; settable).
    output_limits: the policy for an output limit above the room left and the default limit
    (``request_checks.OutputLimits``; settable).
    """

    def __init__(
        self,
        model: DiffusionGemma,
        tokenizer: Tokenizer | None,
        defaults: SamplingParams,
        eos_ids: frozenset[int],
        limits: checks.RequestLimits,
        prefix_caching: bool,
        time_limit: float | None = None,
        output_limits: checks.OutputLimits | None = None,
    ):
        cfg = model.config
        self.model, self.tokenizer, self.defaults, self.eos_ids = model, tokenizer, defaults, eos_ids
        self.limits, self.prefix_caching = limits, prefix_caching
        self.time_limit = time_limit
        self.output_limits = output_limits if output_limits is not None else checks.OutputLimits()
        self.canvas_rules = CanvasRules(cfg.canvas_length, cfg.vocab_size, eos_ids, tokenizer)
        self.grammars = GrammarRows(tokenizer, cfg.vocab_size, cfg.canvas_length, eos_ids)
        self._ids = itertools.count()

    def make_request(self, sub: Submission, *, deadline: float | None = None) -> Request:
        """Validate a submission and mint its request, once (``check_request_id`` then ``mint``). Thread-safe;
        raises ValueError naming the bad field."""
        if sub.request_id is not None:
            checks.check_request_id(sub.request_id)
        return self.mint(sub, deadline=deadline)

    def mint(self, sub: Submission, *, deadline: float | None = None) -> Request:
        """Mint a submission whose request id is checked (``check_request_id``): its id, its seed, its prompt ids
        (tokenized and checked against the vocabulary, the context window and the KV cache slot). A ``ChatPrompt``
        with tools gets their output constraint (``with_tools``). ``deadline`` (time.monotonic() seconds): a
        request still waiting then is dropped before any model work (its last block: finish_reason "cancelled");
        one running then is ended with finish_reason "length", as at ``time_limit`` after its admission. Of the
        submission: ``owner`` may abort it (``Engine.abort``); ``drafts`` are the previews the caller wants (the
        async engine streams them); ``fill_context``: the caller set no max_new_tokens, and the server's default
        applies (``request_checks.output_limit``: --default-max-tokens, the checkpoint's, or, with neither, the
        room left in the context for an output a grammar ends, as vLLM does for a request without max_tokens).
        Any limit above the room left is lowered to it (``limit_field`` names the caller's field when the policy
        refuses it instead); ``cache_salt``: the request reuses only prefix-cache blocks of requests with the same owner
        and salt (docs/prefix-caching.md); ValueError when empty or longer than 256 characters; ``initial_canvas``
        and ``pinned``: the starting canvas and its pins (``read_initial_canvas``, docs/edit-in-place.md)."""
        prompt, owner = sub.prompt, sub.owner
        salt = cache_salt(owner, sub.cache_salt)
        params = with_tools(prompt, sub.params or self.defaults)
        checks.check_work(self.limits, params)
        # at least one canvas must fit; the room, and so the limit, is known once the prompt is tokenized
        prompt_ids = self.context_ids(prompt, min(params.max_new_tokens, self.limits.canvas_length))
        given, field = not sub.fill_context, sub.limit_field
        n = checks.output_limit(self.limits, self.output_limits, len(prompt_ids), params, given, field)
        if n != params.max_new_tokens:  # a lower limit lowers min_tokens with it (no more can be generated)
            params = dataclasses.replace(params, max_new_tokens=n, min_tokens=min(params.min_tokens, n))
        rid = sub.request_id if sub.request_id is not None else f"req-{next(self._ids)}"
        if params.seed is None:  # the seed in use, drawn once: the request's params carry it from here on
            params = dataclasses.replace(params, seed=secrets.randbits(64))
        checks.check_stop_token_ids(params, self.limits.vocab_size)
        canvas = read_initial_canvas(sub.initial_canvas, sub.pinned, params, self.canvas_rules)
        tracker = output_rules(params, prompt, canvas, self.eos_ids, self.tokenizer)
        grammar = self.grammars.row(params)
        # prefix-cache keys, salted with the caller's identity and chosen salt: no block is shared across them
        images = image_spans(prompt_ids, prompt, self.model)
        spans = [(s, s + im.tokens, im.digest) for s, im in images]
        hashes = prefix_hashes(prompt_ids, self.limits.prefill_chunk, salt, spans) if self.prefix_caching else ()
        return Request(
            rid,
            prompt_ids,
            params,
            tracker,
            deadline=deadline,
            time_limit=self.time_limit,
            step_limit=self.limits.max_request_steps,
            owner=owner,
            caller=sub.caller if sub.caller is not None else owner,
            grammar=grammar,
            drafts=sub.drafts,
            prefix_hashes=hashes,
            images=images,
            initial_canvas=canvas,
        )

    def prompt_ids(self, prompt: Prompt, max_tokens: int | None = None) -> list[int]:
        """Token ids of a prompt (text, ids or chat), validated against the vocabulary, with bounded work past
        ``max_tokens`` (``request_checks.prompt_ids``). Thread-safe."""
        return checks.prompt_ids(prompt, self.model, self.tokenizer, self.limits.prefill_chunk, max_tokens)

    def context_ids(self, prompt: Prompt, max_new_tokens: int, at_least: bool = False) -> list[int]:
        """Token ids of a request's prompt, which must fit in the context window (and a KV cache slot) with the
        canvases generated after it; ValueError with both numbers (``request_checks.check_context``) as soon as
        that is known, with bounded work. ``at_least``: the prompt counts fewer tokens than the request will (its
        remote images at their fewest), and the refusal says so."""
        room = (
            self.limits.max_model_len - canvases(max_new_tokens, self.limits.canvas_length) * self.limits.canvas_length
        )
        try:
            ids = self.prompt_ids(prompt, max_tokens=max(room, 0))
        except PromptTooLongError as e:
            checks.check_context(self.limits, e.at_least, max_new_tokens, at_least=True)
            raise
        checks.check_context(self.limits, len(ids), max_new_tokens, at_least=at_least)
        return ids

    def check_length(
        self, prompt: Prompt, max_new_tokens: int | None, fill_context: bool = False, at_least: bool = False
    ) -> int:
        """The token count of ``prompt``, refused with the context check (a ValueError naming both numbers) when it
        cannot fit the window with ``max_new_tokens``' canvases (None: the prompt alone must fit the window;
        otherwise at most one canvas, as ``mint`` reserves: a larger limit is lowered to the room left, or refused
        naming its field, once the prompt is counted; ``fill_context`` is accepted for callers and changes nothing).
        ``at_least``: as for ``context_ids``. Bounded work."""
        if max_new_tokens is None:
            return len(self.prompt_ids(prompt, self.limits.max_model_len))
        max_new_tokens = min(max_new_tokens, self.limits.canvas_length)
        return len(self.context_ids(prompt, max_new_tokens, at_least))
