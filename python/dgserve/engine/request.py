"""One request from admission to its last block (nano-vllm's ``Sequence``): the one per-request record.

Every layer reads and writes the same ``Request``: the engine mints it (id, validated prompt ids, params with the
seed in use), the scheduler queues and plans it, the model runner gives it a cache slot and writes its knob rows
from it, the sampler advances its block, the engine commits the block, and the async engine hangs its event queue
on it (``stream``). Each fact is held once, here: the seed (``params.seed``), the block index, the steps left in
the block, the grammar state. ``BlockState`` holds only the current block's tensors. Pure Python (the scheduler
imports this module and no torch).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dgserve.media.images import ImageInput

if TYPE_CHECKING:
    from dgserve.engine.block import BlockState, InitialCanvas
    from dgserve.outputs import BlockOutput, GenerationResult, OutputTracker
    from dgserve.sampling_params import SamplingParams
    from dgserve.structured.constrained import StructuredRow

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
RequestKey = tuple[str | None, str]  # (owner, request_id): request ids are a namespace per caller
REMEMBER_FINISHED = 10_000  # finished ids kept for Abort's "already finished" answer


class RequestFailedError(Exception):
    """A request ended by a failure of its own (not of the engine): the others carry on. The message is generic
    (it names the request and the phase, never its content); the server log has the cause's type."""


class SharedWorkError(RuntimeError):
    """An exception in work shared by every running request (scheduling, slot bookkeeping, the batched denoising
    pass): it belongs to no single request, so the engine cannot go on (an engine fault). The message names the
    phase and the cause's type, never a request's content; the cause is chained."""


class FinishedKeys:
    """The keys of the requests that finished or were aborted most recently, at most ``limit`` (the oldest are
    forgotten first): what Abort's "already finished" answer reads. The engine's, under its lock."""

    def __init__(self, limit: int = REMEMBER_FINISHED):
        self.limit = limit
        self._keys: OrderedDict[RequestKey, None] = OrderedDict()

    def add(self, key: RequestKey) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def __contains__(self, key: RequestKey) -> bool:
        return key in self._keys


@dataclass(frozen=True)
class DraftSpec:
    """Previews of the block being denoised: every ``every_n_steps`` steps, with its text when ``include_text``."""

    every_n_steps: int = 1
    include_text: bool = False


@dataclass(eq=False)
class Request:
    """State of one request; fields are grouped by the layer that writes them (under the engine's lock or on the
    engine thread, see ``Engine``; the async engine's fields on its event loop).

    ``params`` carry the seed in use (drawn once at admission when the caller gave none): ``seed`` reads it.
    """

    request_id: str
    prompt_ids: list[int]  # validated once, at admission (``Admission.mint``)
    params: SamplingParams  # params.seed is set: the one seed of the request
    tracker: OutputTracker  # the output rules: tokens and text so far, finish reason
    deadline: float | None = None  # time.monotonic(): a still-waiting request is dropped, a running one ended
    time_limit: float | None = None  # seconds a request may run from its admission into a slot (None: no limit)
    step_limit: int | None = None  # denoising steps it may run, all blocks together; then "length" (None: no limit)
    owner: str | None = None  # the caller's identity: ids are scoped by it, and only it may abort the request
    # whose share of the running slots it takes (engine/fair_share.py): the owner, or a trusted gateway's caller
    caller: str | None = None
    grammar: StructuredRow | None = None  # the grammar state across blocks when params.response_format is set
    drafts: DraftSpec | None = None  # previews wanted by the caller
    prefix_hashes: tuple[bytes, ...] = ()  # keys of its prompt's full chunks (engine/prefix_cache.py); () = no reuse
    # (start, image) per image of the prompt, in order: its placeholders are prompt_ids[start : start + tokens]
    images: tuple[tuple[int, ImageInput], ...] = ()
    initial_canvas: InitialCanvas | None = None  # the starting canvas and its pins (docs/edit-in-place.md); None: noise
    # scheduler
    arrival: float = field(default_factory=time.monotonic)
    status: str = WAITING
    prefilled: int = 0  # prompt tokens planned for encoding so far (from cached_tokens on)
    # engine, at admission (``ModelRunner.match_prefix``): prompt tokens whose KV comes from the prefix cache
    cached_tokens: int = 0
    admitted_at: float | None = None
    last_iteration: int = -1  # the scheduler's iteration that last gave it a denoising step (fair stepping)
    # model runner
    slot: int | None = None  # its KV cache slot while running
    parked: Any = None  # its KV cache kept aside while it waits for a fair share again (``ModelRunner.park``)
    pending: list[int] | None = None  # committed tokens to encode before the next block
    encode_seconds: float = 0.0  # the encoder pass before the current block
    # the current block: its index, its denoising progress (the runner owns the one decrement) and its tensors
    block_index: int = 0
    steps_left: int = 0  # k of the next step: N, N-1, ..., 1
    block: BlockState | None = None
    block_done: bool = False  # the sampler stopped the block (stable and confident, or k reached 1)
    mean_entropy: float = float("nan")  # at the last step run
    denoise_seconds: float = 0.0
    # engine: what was committed
    blocks: list[BlockOutput] = field(default_factory=list)
    error: Exception | None = None  # set when the request failed alone (``Engine.step``); ``result`` raises it
    # async engine
    stream: Any = None  # its event queue (``RequestStream``)
    first_block_at: float | None = None

    @property
    def key(self) -> RequestKey:
        """(owner, request_id): request ids are a namespace per caller (two callers may use the same id)."""
        return (self.owner, self.request_id)

    @property
    def ends_at(self) -> float | None:
        """time.monotonic() at which a running request is ended with finish reason "length" (docs/generation.md,
        "Limits"): the sooner of its deadline and its admission plus ``time_limit``; None when neither is set."""
        limit = None if self.time_limit is None or self.admitted_at is None else self.admitted_at + self.time_limit
        if limit is None or self.deadline is None:
            return limit if limit is not None else self.deadline
        return min(limit, self.deadline)

    @property
    def seed(self) -> int:
        seed = self.params.seed
        assert seed is not None, "Admission.mint sets the seed in use"
        return seed

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    @property
    def steps_run(self) -> int:
        """Denoising steps run in the current block."""
        return self.params.max_denoising_steps - self.steps_left if self.block is not None else 0

    @property
    def steps_used(self) -> int:
        """Denoising steps run so far: the committed blocks' and the current block's."""
        return sum(b.stats.denoising_steps for b in self.blocks) + self.steps_run

    @property
    def out_of_steps(self) -> bool:
        """Its steps reached ``step_limit`` (docs/generation.md, "Limits"): the engine ends it with "length"."""
        return self.step_limit is not None and self.steps_used >= self.step_limit

    def result(self) -> GenerationResult:
        from dgserve.outputs import GenerationResult

        t = self.tracker
        if self.error is not None:
            raise self.error
        if t.finish_reason is None:
            raise RuntimeError(f"request {self.request_id!r} has not finished")
        return GenerationResult(
            list(t.token_ids),
            t.text,
            t.finish_reason,
            self.seed,
            len(self.prompt_ids),
            list(self.blocks),
            self.cached_tokens,
        )
