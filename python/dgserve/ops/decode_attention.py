"""``decode_attention``: the decoder's attention for B canvases at once, each canvas's C queries over its own keys and
values (its cache slot's visible positions, then its canvas), scale 1.0, no mask (docs/kernels.md,
"decode_attention: the decoder's attention"); native core in ``csrc/ops/decode_attention.h``.

- CPU, fp32/bf16: ``_C.decode_attention``, one call for every canvas and head, each element one fixed sequence (the
  contract's exp, ``exp_nonpositive``), so a canvas's result is bit-identical alone and beside any others
  (docs/exactness.md, "Batch invariance"). Within fp32 rounding of the reference, not bit-identical to it. A canvas
  that sees more than ``NATIVE_MAX_KEYS`` keys takes the reference instead, canvas by canvas (faster there); the
  choice is the canvas's own, so its bits still never depend on its batch.
- Elsewhere (CUDA, other dtypes, autograd, no extension): the reference, canvas by canvas (accelerators batch
  their rows in ``model/batched.py`` instead).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import native, reference


def decode_attention_native_ok(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor] | torch.Tensor,
    values: Sequence[torch.Tensor] | torch.Tensor,
    canvas_keys: torch.Tensor,
    canvas_values: torch.Tensor,
) -> bool:
    """Whether ``decode_attention`` may run ``_C.decode_attention``: CPU fp32/bf16 q [nh, T, hd] and keys/values of
    its dtype with a unit last stride, no autograd, extension built and not switched off."""
    cached: list[torch.Tensor] = (
        [keys, values] if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) else [*keys, *values]
    )
    tensors = (canvas_keys, canvas_values, *cached)
    return (
        native.has_native("decode_attention")
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and q.dim() == 3
        and q.stride(-1) == 1
        and all(
            t.dtype == q.dtype and t.device.type == "cpu" and (t.stride(-1) == 1 or t.shape[1] == 0) for t in tensors
        )
        and not native.wants_grad(q, *tensors)
    )


def decode_attention(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor] | torch.Tensor,
    values: Sequence[torch.Tensor] | torch.Tensor,
    canvas_keys: torch.Tensor,
    canvas_values: torch.Tensor,
    canvas_length: int,
    slots: Sequence[tuple[int, int, int]] | None = None,
) -> torch.Tensor:
    """The attention of B canvases; see ``reference.decode_attention``.

    Parameters
    ----------
    q : [nh, B·C, hd] md (canvas b's queries are rows b·C .. b·C + C − 1; a transposed view is read in place)
    keys, values : B tensors [nkv, P_b, hd] md: what canvas b's cache slot shows it (views, P_b ≥ 0); or, with
        ``slots``, the cache's buffers [slots, nkv, cap, hd] (contiguous)
    canvas_keys, canvas_values : [nkv, B·C, hd] md: the canvases' own keys and values (canvas b's are rows b·C ..),
        which canvas b attends to after its cached ones; read where they are, never written to the cache
    canvas_length : C
    slots : per canvas (slot, start, count): its cached keys are positions start .. start + count − 1 of that slot
        of the buffers (B = len(slots); no view is made per canvas). None: B = len(keys)

    Returns
    -------
    new tensor [B·C, nh·hd] md. CPU: batch-invariant, within fp32 rounding of the reference.
    """
    B = len(keys) if slots is None else len(slots)
    C = canvas_length
    if (slots is None and len(keys) != len(values)) or q.shape[1] != B * C:
        raise ValueError(f"decode_attention: q has {q.shape[1]} rows, not {B} canvases of {C}")
    if not decode_attention_native_ok(q, keys, values, canvas_keys, canvas_values):
        return reference.decode_attention(q, keys, values, canvas_keys, canvas_values, C, slots)
    cached = [int(k.shape[1]) for k in keys] if slots is None else [int(n) for _, _, n in slots]
    if all(P + C <= NATIVE_MAX_KEYS for P in cached):  # the common case: every canvas in one native call
        return _native(q, keys, values, canvas_keys, canvas_values, C, slots)
    # some canvas sees more keys than the native kernel serves well: canvas by canvas, each by its own key count
    out = torch.empty(q.shape[1], q.shape[0] * q.shape[2], dtype=q.dtype)
    for b, P in enumerate(cached):
        rows = slice(b * C, (b + 1) * C)
        # canvas b alone, its cached keys in the form they came in (views, or the buffers and its span)
        kb, vb, span = ([keys[b]], [values[b]], None) if slots is None else (keys, values, [slots[b]])
        one = (q[:, rows], kb, vb, canvas_keys[:, rows], canvas_values[:, rows], C, span)
        out[rows] = _native(*one) if P + C <= NATIVE_MAX_KEYS else reference.decode_attention(*one)
    return out


# A canvas that sees more keys than this (cached and its own) takes the reference, eager attention with torch's GEMMs,
# which beat the native kernel's fixed-order loops there (crossover measured between 256 and 512 keys on one Zen 4
# core; 4-5x at 18K keys). The choice depends on the canvas's own key count only, so a canvas's bits never depend
# on the canvases beside it (docs/kernels.md, "decode_attention: the decoder's attention").
NATIVE_MAX_KEYS = 384


def _native(q, keys, values, canvas_keys, canvas_values, C: int, slots) -> torch.Tensor:
    out = torch.empty(q.shape[1], q.shape[0] * q.shape[2], dtype=q.dtype)
    if slots is None:
        native._C.decode_attention(q, list(keys), list(values), canvas_keys, canvas_values, C, out)
    else:
        spans = [(int(s), int(a), int(n)) for s, a, n in slots]
        native._C.decode_attention(q, keys, values, spans, canvas_keys, canvas_values, C, out)
    return out
