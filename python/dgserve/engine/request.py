"""One request from admission to its last block (nano-vllm's ``Sequence``): the single object that passes through
every layer. The engine mints it once (id, seed, validated prompt ids), the scheduler queues and plans it, the
model runner gives it a cache slot and knob tensors, the sampler advances its block, and the async engine streams
it (``stream``: its event queue, opaque here). Pure Python: the scheduler imports it and imports no torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dgserve.engine.sampler import BlockState
    from dgserve.outputs import BlockOutput, GenerationResult, OutputTracker
    from dgserve.sampling_params import SamplingParams
    from dgserve.structured.constrained import StructuredRow

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
RequestKey = tuple[str | None, str]  # (owner, request_id): request ids are a namespace per caller


class RequestFailedError(Exception):
    """A request ended by a failure of its own (not of the engine): the others carry on. The message is generic
    (it names the request, never its content); the server log has the cause."""


@dataclass(eq=False)
class Request:
    """State of one request; fields are grouped by the layer that writes them (all under the engine's lock or on
    the engine thread, see ``Engine``)."""

    request_id: str
    prompt_ids: list[int]  # validated once, at admission (``Engine.make_request``)
    params: SamplingParams
    seed: int  # the one in use (drawn once when params.seed is None)
    tracker: OutputTracker
    deadline: float | None = None  # time.monotonic() after which a still-waiting request is dropped
    owner: str | None = None  # the caller's identity: ids are scoped by it, and only it may abort the request
    arrival: float = field(default_factory=time.monotonic)
    status: str = WAITING
    # scheduler
    prefilled: int = 0  # prompt tokens planned for encoding so far
    admitted_at: float | None = None
    # model runner
    slot: int | None = None  # its KV cache slot while running
    # engine: the block being generated and what was committed
    pending: list[int] | None = None  # committed tokens to encode before the next block
    block_index: int = 0
    state: BlockState | None = None
    structured: StructuredRow | None = None  # grammar state when params.response_format is set
    encode_seconds: float = 0.0
    denoise_seconds: float = 0.0
    blocks: list[BlockOutput] = field(default_factory=list)
    error: Exception | None = None  # set when the request failed alone (``Engine.step``); ``result`` raises it
    # async engine
    stream: Any = None

    @property
    def key(self) -> RequestKey:
        """(owner, request_id): request ids are a namespace per caller (two callers may use the same id)."""
        return (self.owner, self.request_id)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    def result(self) -> GenerationResult:
        from dgserve.outputs import GenerationResult

        t = self.tracker
        if self.error is not None:
            raise self.error
        if t.finish_reason is None:
            raise RuntimeError(f"request {self.request_id!r} has not finished")
        return GenerationResult(
            list(t.token_ids), t.text, t.finish_reason, self.seed, len(self.prompt_ids), list(self.blocks)
        )
