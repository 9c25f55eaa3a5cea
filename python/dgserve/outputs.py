"""What generation returns: per-block outputs with stats, the final result, and the output rules
(docs/generation.md, "Output rules"): cut at max_new_tokens, after the first EOS (kept) unless ignore_eos, and at stop
strings (text cut before the match; token_ids end with the token that completed it). Text never
includes EOS. Block token_ids partition the result's token_ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dgserve.text.tokenizer import IncrementalDecoder

FINISH_EOS, FINISH_LENGTH, FINISH_STOP, FINISH_CANCELLED = "eos", "length", "stop", "cancelled"
FINISH_ERROR = "error"  # the request failed alone (Request.error); never reported as a finish reason


@dataclass(frozen=True)
class BlockStats:
    """How one block was produced."""

    denoising_steps: int  # decoder forwards run for this block (adaptive stopping may cut N short)
    tokens_per_forward: float  # tokens this block returned / denoising_steps
    mean_entropy: float  # mean per-position entropy at the last step run
    encode_seconds: float  # encoder pass before the block (prompt prefill or previous block)
    denoise_seconds: float  # wall time of this block's denoising steps (shared with the batch)
    pinned_tokens: int = 0  # of its tokens, those the request pinned (docs/edit-in-place.md)


@dataclass(frozen=True)
class BlockOutput:
    """One committed canvas as returned to the caller (possibly cut by EOS, stop or length)."""

    index: int
    token_ids: list[int]
    text: str
    stats: BlockStats
    finish_reason: str | None = None  # set on the last block of a request

    @property
    def denoising_steps(self) -> int:
        """Decoder forwards run for this block (``blocks[i].denoising_steps`` of the public API,
        docs/architecture.md)."""
        return self.stats.denoising_steps


@dataclass
class GenerationResult:
    """A finished request."""

    token_ids: list[int]
    text: str
    finish_reason: str
    seed: int
    prompt_tokens: int
    blocks: list[BlockOutput] = field(default_factory=list)
    cached_tokens: int = 0  # of prompt_tokens, those whose KV the prefix cache supplied (docs/prefix-caching.md)

    @property
    def denoising_steps(self) -> int:
        return sum(b.denoising_steps for b in self.blocks)

    @property
    def tokens_per_forward(self) -> float:
        return len(self.token_ids) / max(1, self.denoising_steps)


class OutputTracker:
    """Applies the output rules block by block for one request and produces each block's text delta.

    Text comes from an `IncrementalDecoder` over the output ids without EOS tokens, so each block costs decodes of
    a window (the previous block and this one), not of the whole output so far.

    ``stop_token_ids`` end the output as EOS does (kept in ``token_ids``, never in the text), with finish reason
    "stop". ``min_tokens``: EOS, a stop token or a stop string ends the output only after that many tokens (a stop
    string counts when the token that completes it comes after them); the sampler never draws EOS or a stop token
    there (``banned_ids``), so these rules only guard what a caller of the tracker alone could feed it.
    """

    def __init__(
        self,
        max_new_tokens: int,
        eos_ids: frozenset[int],
        ignore_eos: bool,
        stop: tuple[str, ...],
        tokenizer=None,
        skip_special_tokens: bool = True,
        stop_token_ids: tuple[int, ...] = (),
        min_tokens: int = 0,
        pin_end: int = 0,
    ):
        if stop and tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this model has none")
        self.max_new_tokens = max_new_tokens
        self.eos_ids = frozenset() if ignore_eos else eos_ids
        self.all_eos = eos_ids
        self.stop = stop
        self.stop_ids = frozenset(stop_token_ids)
        self.min_tokens = min_tokens
        self.tokenizer = tokenizer
        # skip_special_tokens False keeps marker tokens in the text (tool calls and reasoning, docs/tools.md)
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens) if tokenizer is not None else None
        self.token_ids: list[int] = []
        self.text = ""  # text emitted so far
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None  # the stop string that ended the output (finish_reason "stop")
        self._stop_floor = 0  # characters of the text of the first min_tokens tokens (a stop match ends after it)
        # pins (docs/edit-in-place.md): the output holds its first pin_end tokens; a stop string counts only where
        # it starts in the text after them (EOS cannot come earlier: the sampler bars it from those positions)
        self.pin_end = pin_end
        self._stop_from = 0  # text offset where a stop string may start

    @property
    def banned_ids(self) -> frozenset[int]:
        """The ids the sampler must not draw at positions before ``min_tokens``: the EOS ids (unless ignore_eos)
        and the stop token ids."""
        return self.eos_ids | self.stop_ids

    def banned_positions(self) -> int:
        """How many positions of the next block lie within the first ``min_tokens`` tokens (0: none)."""
        return max(0, self.min_tokens - len(self.token_ids))

    def add_block(self, block: list[int]) -> tuple[list[int], str]:
        """Take a committed canvas → (the tokens it contributes, the text delta); sets finish_reason."""
        toks = block[: self.max_new_tokens - len(self.token_ids)]
        reason = None
        for j in range(self.banned_positions(), len(toks)):
            if toks[j] in self.eos_ids or toks[j] in self.stop_ids:
                toks, reason = toks[: j + 1], FINISH_EOS if toks[j] in self.eos_ids else FINISH_STOP
                break
        within = self.banned_positions()
        if within:  # the text of the first min_tokens tokens: no stop string may end inside it
            self._stop_floor = len(self._text_with(toks[:within]))
        full = self._text_with(toks)
        pinned_here = self.pin_end - len(self.token_ids)
        if pinned_here > 0 and self.stop:
            self._stop_from = len(self._text_with(toks[:pinned_here]))
        hit = self._find_stop(full)
        if hit is not None:
            self.stop_sequence = full[hit[0] : hit[1]]
            toks, full, reason = self._cut_at_stop(toks, full, hit)
        if reason is None and len(self.token_ids) + len(toks) >= self.max_new_tokens:
            reason = FINISH_LENGTH
        self.token_ids += toks
        if self._decoder is not None:
            self._decoder.push(self._text_ids(toks))
        self.finish_reason = reason
        shown = full if reason is not None else full[: len(full) - self._holdback(full)]
        delta, self.text = shown[len(self.text) :], shown if len(shown) > len(self.text) else self.text
        return toks, delta

    def end(self, reason: str) -> str:
        """End the output here, before another block, with ``reason`` (a time limit): returns the text delta the
        rules held back (a possible stop-string prefix, an incomplete UTF-8 tail), which is text after all."""
        self.finish_reason = reason
        full = self._text_with([])
        delta, self.text = full[len(self.text) :], full if len(full) > len(self.text) else self.text
        return delta

    def _text_ids(self, toks: list[int]) -> list[int]:
        return [t for t in toks if t not in self.all_eos and t not in self.stop_ids]

    def _text_with(self, toks: list[int]) -> str:
        """The output's full text (EOS and stop tokens excluded) if `toks` were appended."""
        if self._decoder is None:
            return ""
        return self._decoder.text_with(self._text_ids(toks))

    def _find_stop(self, full: str) -> tuple[int, int] | None:
        """Earliest stop-string match (start, end) not already emitted and ending after the first min_tokens
        tokens' text; it may span blocks."""
        if not self.stop:
            return None
        longest = max(len(s) for s in self.stop)
        start = max(0, len(self.text) - longest + 1, self._stop_from)
        best = None
        for s in self.stop:
            i = full.find(s, start)
            while 0 <= i and i + len(s) <= self._stop_floor:
                i = full.find(s, i + 1)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, i + len(s))
        return best

    def _cut_at_stop(self, toks: list[int], full: str, hit: tuple[int, int]):
        """Keep the block's tokens up to the one completing the match; text ends before the match."""
        for n in range(1, len(toks) + 1):
            if len(self._text_with(toks[:n])) >= hit[1]:
                return toks[:n], full[: hit[0]], FINISH_STOP
        return toks, full[: hit[0]], FINISH_STOP

    def _holdback(self, full: str) -> int:
        """Characters to hold back: an incomplete UTF-8 tail, or a suffix that may start a stop string."""
        n = len(full) - len(full.rstrip("\ufffd"))
        tail = full[: len(full) - n]
        for s in self.stop:
            for m in range(min(len(s) - 1, len(tail)), 0, -1):
                if tail.endswith(s[:m]):
                    n = max(n, len(full) - len(tail) + m)
                    break
        return n
