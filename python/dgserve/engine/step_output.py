"""What one engine step reports, and the blocks that end or commit a request's canvas (docs/architecture.md,
"The life of a request"; docs/generation.md, "Limits").

Public contract:
    out = StepOutput()                  # admitted, blocks, stepped, failed: what ``Engine.step`` did
    preview = draft(req)                # the block's argmax canvas after its latest step (DraftOutput), or None
    block = commit_block(req)           # the block's argmax canvas through the output rules; the request moves on
    block = cancelled_block(req)        # the empty last block of a queued request whose deadline passed
    block = timed_out_block(req)        # the last block of a running request whose time is up ("length")
    block = timed_out_block(req, "its denoising steps reached --max-request-steps")  # ... whose steps are up
    tracker = output_rules(params, prompt, canvas, eos_ids, tokenizer)  # a new request's OutputTracker

``output_rules`` gives a request being minted the rules its blocks go through. The block builders change only the
request (its tracker, blocks, block index); the engine does the bookkeeping (the scheduler's tables and the recently
finished ids) under its lock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dgserve.engine.block import InitialCanvas
from dgserve.engine.prompt import ChatPrompt, Prompt
from dgserve.engine.request import Request
from dgserve.outputs import FINISH_CANCELLED, FINISH_LENGTH, BlockOutput, BlockStats, OutputTracker
from dgserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dgserve.text.tokenizer import Tokenizer

log = logging.getLogger("dgserve.engine.engine")  # the engine's log: a request's end is its line
_NO_WORK = BlockStats(0, 0.0, float("nan"), 0.0, 0.0)  # a last "block" that ran no step


@dataclass(frozen=True)
class DraftOutput:
    """The current block's argmax canvas after its latest denoising step (a preview; may still change)."""

    index: int
    step: int
    token_ids: list[int]
    mean_entropy: float


@dataclass
class StepOutput:
    """What one ``Engine.step`` did: requests admitted into slots, blocks committed (and an empty "cancelled"
    block for each queued request whose deadline passed), the requests that took a denoising step (``stepped``), and
    those that failed alone (their ``error`` is set; they are finished and their slots freed)."""

    admitted: list[Request] = field(default_factory=list)
    blocks: list[tuple[Request, BlockOutput]] = field(default_factory=list)
    stepped: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)


def draft(req: Request) -> DraftOutput | None:
    """The request's current block after its latest denoising step, or None between blocks (and once its block is
    done: the commit is what the caller sees next)."""
    b = req.block
    if b is None or b.argmax is None or req.block_done:
        return None
    return DraftOutput(req.block_index, req.steps_run, b.argmax.tolist(), req.mean_entropy)


def commit_block(req: Request) -> BlockOutput:
    """Commit the request's block: its ARGMAX canvas of the last step run goes through the output rules (EOS, stop,
    length; ``OutputTracker.add_block``), is appended to ``req.blocks``, and is the next block's pending canvas
    (encoded before it starts). RuntimeError when the block has run no step (an engine bug)."""
    b, steps = req.block, req.steps_run
    if b is None or b.argmax is None or steps == 0:
        raise RuntimeError(f"request {req.request_id!r}: commit before its block ran a step")
    canvas = b.argmax.tolist()  # [C] ids
    toks, text = req.tracker.add_block(canvas)
    stats = BlockStats(steps, len(toks) / steps, req.mean_entropy, req.encode_seconds, req.denoise_seconds, b.pinned)
    block = BlockOutput(req.block_index, toks, text, stats, req.tracker.finish_reason)
    req.blocks.append(block)
    req.block, req.block_index, req.pending = None, req.block_index + 1, canvas
    return block


def cancelled_block(req: Request) -> BlockOutput:
    """The last block of a queued request whose deadline passed before any model work: no tokens, "cancelled"."""
    req.tracker.finish_reason = FINISH_CANCELLED
    return BlockOutput(0, [], "", _NO_WORK, FINISH_CANCELLED)


def timed_out_block(req: Request, why: str = "its time is up") -> BlockOutput:
    """The last block of a running request whose time (or, ``why`` says, its denoising steps) is up: the block
    being denoised is dropped, what was committed stays, and this "block" carries no tokens, the text the output
    rules held back, and finish_reason "length" (a budget, time or steps, cut the output)."""
    req.block = None
    text = req.tracker.end(FINISH_LENGTH)
    log.info("request %s: %s after %d blocks; ending it (length)", req.request_id, why, len(req.blocks))
    return BlockOutput(req.block_index, [], text, _NO_WORK, FINISH_LENGTH)


def output_rules(
    params: SamplingParams,
    prompt: Prompt,
    canvas: InitialCanvas | None,
    eos_ids: frozenset[int],
    tokenizer: Tokenizer | None,
) -> OutputTracker:
    """The output rules of a new request (EOS, stop strings and ids, min_tokens, its pinned draft's end):
    special tokens are kept in its text when a chat prompt keeps its markers or ``skip_special_tokens`` is off."""
    keep = (isinstance(prompt, ChatPrompt) and prompt.keeps_markers) or not params.skip_special_tokens
    p = params
    pin_end = canvas.pin_end if canvas is not None else 0
    args = (p.max_new_tokens, eos_ids, p.ignore_eos, p.stop, tokenizer, not keep, p.stop_token_ids, p.min_tokens)
    return OutputTracker(*args, pin_end=pin_end)
