"""A request's starting canvas and its pins, checked once before the request is minted (docs/edit-in-place.md).

``read_initial_canvas`` turns a submission's ``initial_canvas`` (text or token ids, ``BLANK`` for a position that starts
from the noise) and ``pinned`` (True, or ``[start, end)`` ranges of draft positions) into the request's
``InitialCanvas``, against the model's ``CanvasRules`` (canvas length, vocabulary, EOS ids, tokenizer); every refusal
is a ValueError naming ``initial_canvas`` or ``pinned``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dgserve.engine.block import BLANK, InitialCanvas, canvases
from dgserve.sampling_params import SamplingParams
from dgserve.text.token_bounds import PromptTooLongError

if TYPE_CHECKING:
    from dgserve.text.tokenizer import Tokenizer

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, non-empty [start, end) ranges of draft positions


@dataclass(frozen=True)
class CanvasRules:
    """What a draft is checked against: the model's canvas length and vocabulary size, its EOS ids, and its
    tokenizer (None: text drafts are refused)."""

    canvas_length: int
    vocab_size: int
    eos_ids: frozenset[int]
    tokenizer: Tokenizer | None


def read_initial_canvas(
    initial_canvas: str | Sequence[int] | torch.Tensor | None,
    pinned: bool | Sequence[Sequence[int]] | None,
    params: SamplingParams,
    rules: CanvasRules,
) -> InitialCanvas | None:
    """A request's starting canvas and pins, validated (docs/edit-in-place.md); None without a draft.

    ``initial_canvas``: text (tokenized as content: no special-token parsing, no BOS) or token ids in the
    vocabulary, ``BLANK`` (-1) for a position that starts from the noise; at most the request's canvases
    (⌈max_new_tokens / C⌉ · C tokens). ``pinned``: True (every position of the draft), or ``[start, end)``
    ranges of draft positions, in order, disjoint, non-empty, over no blank, ending at most at
    ``max_new_tokens`` (the output holds every pinned token); an EOS id pinned anywhere but last is refused
    (it would end the output before the other pins) unless ``ignore_eos``. Pins cannot be combined with a
    response_format or tools that constrain the output. ValueError naming the field."""
    if initial_canvas is None:
        if pinned:
            raise ValueError("pinned: needs an initial_canvas (the pinned positions are the draft's)")
        return None
    ids = _draft_ids(initial_canvas, params.max_new_tokens, rules)
    ranges = _pinned_ranges(pinned, ids)
    if not ranges:
        return InitialCanvas(tuple(ids))
    _check_pins(ranges, ids, params, rules.eos_ids)
    return InitialCanvas(tuple(ids), ranges)


def _draft_ids(
    initial_canvas: str | Sequence[int] | torch.Tensor, max_new_tokens: int, rules: CanvasRules
) -> list[int]:
    """The draft's token ids, checked against the vocabulary and the request's canvases (ValueError naming
    initial_canvas)."""
    C = rules.canvas_length
    room = canvases(max_new_tokens, C) * C  # the request's canvases
    where = f"the request's {room // C} canvases of {C} tokens (max_new_tokens {max_new_tokens})"
    if isinstance(initial_canvas, str):
        if rules.tokenizer is None:
            raise ValueError("initial_canvas: text needs a tokenizer, and this model has none; pass token ids")
        try:
            ids = rules.tokenizer.encode_content(initial_canvas, max_tokens=room, field="initial_canvas")
        except PromptTooLongError as e:
            raise ValueError(f"initial_canvas: at least {e.at_least} tokens, more than {where} hold") from e
    else:
        raw = initial_canvas.tolist() if isinstance(initial_canvas, torch.Tensor) else list(initial_canvas)
        if any(isinstance(t, bool) or not isinstance(t, int) for t in raw):
            raise ValueError("initial_canvas: token ids must be integers")
        ids = [int(t) for t in raw]
        if len(ids) > room:
            raise ValueError(f"initial_canvas: {len(ids)} tokens, more than {where} hold")
    if not ids:
        raise ValueError("initial_canvas: must hold at least one token (leave it out to start from noise)")
    V = rules.vocab_size
    bad = [t for t in ids if not (0 <= t < V or t == BLANK)]
    if bad:
        raise ValueError(f"initial_canvas: token id {bad[0]} is outside the vocabulary [0, {V}) (-1: a blank)")
    return ids


def _pinned_ranges(pinned: bool | Sequence[Sequence[int]] | None, ids: list[int]) -> Ranges:
    """``pinned`` as sorted ``[start, end)`` ranges over ``ids`` (True: the whole draft); ValueError naming pinned
    when a range is malformed, empty, out of order, overlapping, outside the draft or over a blank."""
    if pinned is None or pinned is False:
        return ()
    if pinned is True:
        ranges = [(0, len(ids))]
    else:
        if isinstance(pinned, (str, bytes)) or not isinstance(pinned, Sequence):
            raise ValueError("pinned: must be true, false or a list of [start, end) ranges")
        ranges = []
        for i, r in enumerate(pinned):
            if (
                isinstance(r, (str, bytes))
                or not isinstance(r, Sequence)
                or len(r) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) for x in r)
            ):
                raise ValueError(f"pinned[{i}]: must be a [start, end) pair of integers")
            a, b = int(r[0]), int(r[1])
            if not 0 <= a < b <= len(ids):
                raise ValueError(
                    f"pinned[{i}]: [{a}, {b}) must be a non-empty range inside the draft's {len(ids)} positions"
                )
            if ranges and a < ranges[-1][1]:
                raise ValueError(f"pinned[{i}]: [{a}, {b}) starts before the previous range ends (ranges in order)")
            ranges.append((a, b))
    for i, (a, b) in enumerate(ranges):
        blank = next((p for p in range(a, b) if ids[p] == BLANK), None)
        if blank is not None:
            raise ValueError(f"pinned[{i}]: position {blank} is a blank (-1) and has no token to pin")
    return tuple(ranges)


def _check_pins(ranges: Ranges, ids: list[int], params: SamplingParams, eos_ids: frozenset[int]) -> None:
    """The pins against the request's knobs: inside max_new_tokens, not with min_tokens or a grammar, and no EOS
    pinned before other pinned tokens unless ignore_eos (ValueError naming pinned)."""
    end = ranges[-1][1]
    if end > params.max_new_tokens:
        raise ValueError(
            f"pinned: the last pinned range ends at position {end}, past max_new_tokens {params.max_new_tokens}"
            " (the output holds every pinned token); raise max_new_tokens or pin less"
        )
    if params.min_tokens:  # its EOS ban and a pinned EOS would leave a position no token may take
        raise ValueError("pinned: cannot be combined with min_tokens (the pins already decide the output's length)")
    if params.response_format is not None:
        raise ValueError(
            "pinned: cannot be combined with response_format or tools that constrain the output (the grammar"
            " and the pins would both decide the pinned positions); send initial_canvas without pins"
        )
    if not params.ignore_eos:
        eos = [p for a, b in ranges for p in range(a, b) if ids[p] in eos_ids and p != end - 1]
        if eos:
            raise ValueError(
                f"pinned: position {eos[0]} pins EOS id {ids[eos[0]]} before other pinned tokens (the output"
                " ends at an EOS); pin EOS last, or set ignore_eos"
            )
