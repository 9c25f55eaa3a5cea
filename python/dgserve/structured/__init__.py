"""Structured output (docs/structured-output.md): response formats (``response_format``, pure Python), grammar
compilation on llguidance (``grammar``), the constrained diffusion step (``constrained``) and the sampler's hooks
(``hooks``: ``step_bitmask`` before the diffusion step op, ``after_step`` after it). The engine adds one more:
``StructuredRow.start_block`` when a block starts. Importing this package loads neither torch nor llguidance."""

from __future__ import annotations

from dgserve.structured.response_format import ResponseFormat

__all__ = ["ResponseFormat"]
