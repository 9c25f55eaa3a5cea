"""The grammar state of each structured request, and the one compiled-grammar cache it is drawn from
(docs/structured-output.md).

Public contract:
    rows = GrammarRows(tokenizer, vocab_size, canvas_length, eos_ids)
    row = rows.row(params)       # a StructuredRow for a request with a response_format, else None
    compiler = rows.compiler()   # the GrammarCompiler, built on the first structured request

Both raise a ValueError naming ``response_format`` when the model has no tokenizer (or ``row`` when the format
does not compile). The structured-output modules are imported on the first structured request, not at import time.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from dgserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dgserve.structured.constrained import StructuredRow
    from dgserve.structured.grammar import GrammarCompiler
    from dgserve.text.tokenizer import Tokenizer


class GrammarRows:
    """One engine's compiled grammars (``GrammarCompiler``: one compile per format, then cached) and the rows it
    gives each structured request. Thread-safe: requests are minted on any thread."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, canvas_length: int, eos_ids: frozenset[int]):
        self.tokenizer, self.vocab_size, self.canvas_length, self.eos_ids = (
            tokenizer,
            vocab_size,
            canvas_length,
            eos_ids,
        )
        self.built: GrammarCompiler | None = None  # None until the first structured request
        self._lock = threading.Lock()

    def compiler(self) -> GrammarCompiler:
        """The compiled-grammar cache, built once (its tokenizer's vocabulary is read then)."""
        if self.tokenizer is None:
            raise ValueError("response_format: structured output needs a tokenizer, and this model has none")
        from dgserve.structured.grammar import GrammarCompiler

        with self._lock:
            if self.built is None:
                self.built = GrammarCompiler(self.tokenizer.to_json(), self.vocab_size, self.eos_ids)
            return self.built

    def row(self, params: SamplingParams) -> StructuredRow | None:
        """The grammar state of a request with a response_format; None without one. An output that is whole or
        nothing (a JSON document, a choice, required tool calls) is steered to a complete end within its
        max_new_tokens (docs/structured-output.md §11.9)."""
        fmt = params.response_format
        if fmt is None:
            return None
        from dgserve.structured.constrained import StructuredRow, steering_horizon

        grammars = self.compiler()
        matcher, V = grammars.matcher(fmt), self.vocab_size
        if not fmt.whole_or_nothing:
            return StructuredRow(matcher, V, self.eos_ids)
        horizon = steering_horizon(self.canvas_length)
        return StructuredRow(matcher, V, self.eos_ids, params.max_new_tokens, grammars.closer, horizon)
