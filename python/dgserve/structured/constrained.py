"""The constrained diffusion step (docs/structured-output.md): grammar-verified acceptance.

A ``StructuredRow`` is one request's grammar state across its blocks: an llguidance matcher at the end of the
committed text, and the current block's verified prefix ``fixed`` (canvas positions 0..f-1). Per denoising step:

1. ``bitmask`` [C, W]: one-hot of the fixed token at positions < f; the grammar's mask at position f; all ones
   beyond (the grammar state there depends on tokens not yet chosen). The diffusion_step op applies it.
2. ``after_step`` walks from f: tokens the grammar forces are committed without a model decision (jump-forward);
   otherwise the proposal (the op's sample where the entropy rule accepted it) is committed if the grammar
   admits it. At the first position that is neither, the walk stops; a proposal the grammar rejected is re-drawn
   there from the masked scores with the same seeded Gumbel noise (docs/seeded-noise.md), so the next step's
   input is admissible; the other positions keep the op's canvas (sample or renoise).
3. When the block stops (adaptive stopping or its last step) with positions unverified, ``finish`` fills them by a
   sequential masked-argmax walk over the last step's processed logits: no extra forward. The committed block is
   then a grammar-accepted prefix; EOS is allowed only where the grammar may end, and ends the request.

4. At the end of the token budget (docs/structured-output.md §11.9): when the row was given a ``Closer`` (an answer
   that must be complete to be worth anything: a JSON document, a choice, required tool calls), from the position
   where fewer than ``horizon`` tokens of its budget are left, every token the walk commits must leave a way to
   end the document within the rest of the budget: the closer's ``plan`` (a short grammar-accepted ending with its
   EOS). A proposal after which no plan fits is replaced by the plan's next token, and once the plan takes all
   the room left the plan is committed as it is, without forwards. So the answer ends with a complete document
   (EOS) inside its budget, and no new parallel call starts when a whole one no longer fits.

Every decision depends on the row's own logits, seed, matcher and budget: batch invariance holds as without a
grammar.

Failures are the request's own: whatever the grammar engine raises inside a row's hook (a parser limit hit by a
grammar that only blows up mid-document, a state that admits no token) is caught here and kept as ``error``, a
``GrammarFailure`` naming response_format. The sampler then ends the row's block and the engine ends that request
alone with the error; no exception from a request's grammar crosses the batched step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from dgserve.ops import reference
from dgserve.ops.bits import to_signed64
from dgserve.structured.closing import START, Closer, allowed_tokens, scan

if TYPE_CHECKING:
    import llguidance as llg

Propose = Callable[[int, np.ndarray], "int | None"]
STEER_CANVASES = 2  # the steering watches the budget's last two canvases ...
STEER_MIN_TOKENS = 64  # ... and at least its last 64 tokens (room for a whole minimal tool call)
MAX_ERROR_CHARS = 300  # the grammar engine's messages carry its state dump: the first line, this long at most


def steering_horizon(canvas_length: int) -> int:
    """How many tokens before the end of its budget a steered row starts watching it (module doc, 4)."""
    return max(STEER_CANVASES * canvas_length, STEER_MIN_TOKENS)


class GrammarFailure(ValueError):
    """A request's grammar failed during generation (the message starts with ``response_format``)."""


def grammar_failure(error: BaseException) -> GrammarFailure:
    """``error`` as a GrammarFailure naming response_format (itself when it is one already)."""
    if isinstance(error, GrammarFailure):
        return error
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return GrammarFailure(f"response_format: the grammar failed during generation: {first[:MAX_ERROR_CHARS]}")


class StructuredRow:
    """One request's grammar state. matcher: llguidance matcher at the request's start; vocab_size: V;
    eos_ids: the tokens that end the document. budget: the request's max_new_tokens and closer: the search for
    an ending, to steer the answer to a complete document within its budget (module doc, 4; None: not steered);
    horizon: how many tokens before the budget's end the steering starts watching."""

    def __init__(
        self,
        matcher: llg.LLMatcher,
        vocab_size: int,
        eos_ids: frozenset[int],
        budget: int | None = None,
        closer: Closer | None = None,
        horizon: int = 0,
    ):
        self.matcher = matcher
        self.V = vocab_size
        self.W = (vocab_size + 31) // 32
        self.eos_ids = eos_ids
        self.fixed: list[int] = []  # the current block's verified tokens (canvas positions 0..f-1)
        self.ended = False  # an EOS was committed: the document is complete
        # steering at the budget's end (module doc, 4)
        self.budget, self.closer, self.horizon = budget, closer, horizon
        self.emitted = 0  # tokens committed in the blocks before this one
        self.where = START  # the text committed so far, as JSON (closing.scan)
        self.plan: list[int] | None = None  # an ending from the current state (None: not known)
        self.hopeless = False  # no ending fits the budget any more: steering stops (the budget cuts the answer)
        # counters for BlockStats / the bench: tokens committed by each route, time in the matcher
        self.forced = self.accepted = self.redrawn = self.finished = self.steered = 0
        self.matcher_seconds = 0.0
        self.error: GrammarFailure | None = None  # set once the grammar failed; the request then ends with it

    # ------------------------------------------------------------------ per block

    def start_block(self, canvas: torch.Tensor) -> None:
        """A new block (canvas [C] int64, written in place): commit what the grammar forces before any forward
        (e.g. ``{"name":"``). A grammar that fails sets ``error``."""
        self.emitted += len(self.fixed)
        self.fixed = []
        try:
            self._walk(canvas.shape[0], lambda j, w: None)
            self._write_prefix(canvas)
        except Exception as e:  # noqa: BLE001 - the request's own grammar: it fails alone (see the module doc)
            self.error = grammar_failure(e)

    def bitmask(self, canvas_length: int) -> torch.Tensor:
        """[C, W] int32 for this step: fixed tokens one-hot, the grammar's mask at f, all allowed beyond (all
        allowed everywhere once the grammar failed: the row's results are then discarded)."""
        if self.error is None:
            try:
                return self._bitmask(canvas_length)
            except Exception as e:  # noqa: BLE001 - the request's own grammar: it fails alone
                self.error = grammar_failure(e)
        return self._all_allowed(canvas_length)

    def _all_allowed(self, canvas_length: int) -> torch.Tensor:
        return torch.full((canvas_length, self.W), -1, dtype=torch.int32)

    def _bitmask(self, canvas_length: int) -> torch.Tensor:
        t0 = time.perf_counter()
        mask = self._all_allowed(canvas_length)
        f = len(self.fixed)
        if f:
            ids = torch.tensor(self.fixed)
            mask[:f] = 0
            mask[torch.arange(f), ids >> 5] = _bit(ids & 31)
        if f < canvas_length and not self.ended:
            mask[f] = torch.from_numpy(self._mask().copy())
        self.matcher_seconds += time.perf_counter() - t0
        return mask

    def after_step(
        self,
        canvas: torch.Tensor,
        accepted: torch.Tensor,
        processed: torch.Tensor,
        seed: int,
        block_index: int,
        step: int,
        stopped: bool,
    ) -> torch.Tensor | None:
        """Verify the op's proposals (canvas [C] int64, fixed in place; accepted [C] bool; processed [C, V] fp32)
        of step k = ``step``. Returns the completed block [C] int64 when the block is full, ended, or the sampler
        stopped it (``stopped``), else None. A grammar that fails (now or in this step's ``bitmask``) sets
        ``error`` and returns None: the request then ends with it."""
        if self.error is not None:
            return None
        try:
            return self._after_step(canvas, accepted, processed, seed, block_index, step, stopped)
        except Exception as e:  # noqa: BLE001 - the request's own grammar: it fails alone
            self.error = grammar_failure(e)
            return None

    def _after_step(
        self,
        canvas: torch.Tensor,
        accepted: torch.Tensor,
        processed: torch.Tensor,
        seed: int,
        block_index: int,
        step: int,
        stopped: bool,
    ) -> torch.Tensor | None:
        t0 = time.perf_counter()
        C = canvas.shape[0]
        proposals = canvas.tolist()
        ok = accepted.tolist()
        before = len(self.fixed)
        stop, words = self._walk(C, lambda j, w: proposals[j] if ok[j] else None)
        self.accepted += len(self.fixed) - before
        if stop is not None and words is not None and ok[stop]:  # the grammar rejected an accepted proposal
            g = position_gumbel(seed, block_index, step, stop, self.V).to(processed.device)
            canvas[stop] = masked_argmax(processed[stop] + g, words, self.V)
            self.redrawn += 1
        self._write_prefix(canvas)
        block = None
        if stopped or self.ended or len(self.fixed) == C:
            block = self.finish(C, processed, block_index)
        self.matcher_seconds += time.perf_counter() - t0
        return block

    def finish(self, C: int, processed: torch.Tensor, block_index: int) -> torch.Tensor:
        """Complete the block of C positions: a masked argmax walk over the last processed logits [C, V]; returns
        the block [C] int64 (a grammar-accepted prefix, padded after EOS)."""
        before = len(self.fixed)
        self._walk(C, lambda j, w: masked_argmax(processed[j], w, self.V))
        self.finished += len(self.fixed) - before
        if len(self.fixed) < C and not self.ended:
            raise GrammarFailure(
                f"response_format: the grammar allows no token at position {len(self.fixed)} of block {block_index}"
            )
        pad = next(t for t in self.fixed if t in self.eos_ids) if self.ended else 0
        block = self.fixed + [pad] * (C - len(self.fixed))  # after EOS: cut by the output rules
        return torch.tensor(block, dtype=torch.int64, device=processed.device)

    # ------------------------------------------------------------------ the walk

    def _walk(self, C: int, propose: Propose) -> tuple[int | None, np.ndarray | None]:
        """Commit from position f while the grammar forces a token, the budget's plan must go on (no room left
        for anything else), or ``propose(j, mask words)`` gives one the grammar admits (and, near the budget's end,
        after which an ending still fits; else the plan's next token goes in its place). Returns (the position
        where it stopped, its mask words), or (None, None) at the block's end."""
        while len(self.fixed) < C and not self.ended:
            j = len(self.fixed)
            forced = self.matcher.compute_ff_tokens()
            if forced:
                for t in forced[: C - j]:
                    self._commit(t)
                self.forced += min(len(forced), C - j)
                continue
            words = self._mask()
            only = _single_allowed(words, self.V)
            if only is not None:  # e.g. EOS after a complete document
                self._commit(only)
                self.forced += 1
                continue
            room = self._room(j)
            plan = self._plan(room) if room is not None else None
            if plan is not None and room is not None and len(plan) >= room:  # no slack: the plan decides
                self._commit(plan[0])
                self.steered += 1
                continue
            proposal = propose(j, words)
            if proposal is None or not (0 <= proposal < self.V) or not _allows(words, proposal):
                return j, words
            if plan is not None and room is not None:
                after = self._plan_after(proposal, plan, room)
                if after is None:  # no ending would fit after it: the plan's next token instead
                    self._commit(plan[0])
                    self.steered += 1
                    continue
                self._commit(proposal)
                self.plan = after
                continue
            self._commit(proposal)
        return None, None

    def _room(self, j: int) -> int | None:
        """Tokens of the budget left from position j on (j included), when steering watches them; else None."""
        if self.closer is None or self.budget is None or self.hopeless:
            return None
        room = self.budget - self.emitted - j
        return room if 0 < room <= self.horizon else None

    def _plan(self, room: int) -> list[int] | None:
        """An ending from the current state that fits in ``room`` tokens, or None (then steering stops)."""
        assert self.closer is not None
        if self.plan is None or len(self.plan) > room:
            self.plan = self.closer.plan(self.matcher, room, self.where)
        if self.plan is None:
            self.hopeless = True
        return self.plan

    def _plan_after(self, token: int, plan: list[int], room: int) -> list[int] | None:
        """An ending that fits in ``room - 1`` tokens after ``token`` (the current ``plan`` is shorter than
        ``room``), or None. The plan itself when the token is its next one or when it still applies after the
        token (more of a string, say); else a new search."""
        if token == plan[0]:
            return plan[1:]
        assert self.closer is not None
        child = self.matcher.deep_copy()
        if not child.consume_token(token):
            return None
        if child.deep_copy().try_consume_tokens(plan) == len(plan):
            return plan
        return self.closer.plan(child, room - 1, scan(self.where, self.closer.tokenizer.decode_bytes([token])))

    def _commit(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise grammar_failure(RuntimeError(f"the matcher refused token {token}: {self.matcher.get_error()}"))
        self.fixed.append(int(token))
        if token in self.eos_ids:
            self.ended = True
        if self.closer is not None:
            self.where = scan(self.where, self.closer.tokenizer.decode_bytes([int(token)]))
            self.plan = self.plan[1:] if self.plan and self.plan[0] == token else None

    def _mask(self) -> np.ndarray:
        """The matcher's allowed-token words [W] int32 at the current state."""
        return np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)[: self.W]

    def _write_prefix(self, canvas: torch.Tensor) -> None:
        if self.fixed:
            canvas[: len(self.fixed)] = torch.tensor(self.fixed, dtype=canvas.dtype, device=canvas.device)


def _bit(i: torch.Tensor) -> torch.Tensor:
    """int32 with bit i set (bit 31 as the negative int32 it is)."""
    v = torch.ones_like(i, dtype=torch.int64) << i
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def _allows(words: np.ndarray, t: int) -> bool:
    return bool((int(words[t >> 5]) >> (t & 31)) & 1)


def _single_allowed(words: np.ndarray, V: int) -> int | None:
    """The only allowed token in [0, V), or None when there are several (or none)."""
    nz = allowed_tokens(words, V)
    return int(nz[0]) if nz.size == 1 else None


def masked_argmax(scores: torch.Tensor, words: np.ndarray, V: int) -> int:
    """argmax of scores [V] over the tokens the mask words allow (lowest index on ties)."""
    allowed = reference.bitmask_allowed(torch.from_numpy(words.copy()).to(scores.device), V)
    return int(scores.masked_fill(~allowed, float("-inf")).argmax())


def position_gumbel(seed: int, block: int, step: int, position: int, V: int) -> torch.Tensor:
    """The contract's Gumbel noise [V] fp32 of one canvas position (docs/seeded-noise.md; the reference formula)."""
    k0, k1 = reference.seed_key(torch.tensor(to_signed64(seed)))
    n4 = (V + 3) // 4
    q = torch.arange(n4, dtype=torch.int64)
    words = reference.philox4x32_10(q, position, block, 2 * step + 1, k0, k1)  # counter (v // 4, p, b, 2k + 1)
    r = torch.stack(words, -1).reshape(4 * n4)[:V]
    u = ((r >> 9).to(torch.float32) + 0.5) * (2.0**-23)
    return -torch.log(-torch.log(u))
