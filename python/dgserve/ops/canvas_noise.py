"""``canvas_noise``: the contract's uniform canvas tokens (docs/seeded-noise.md); native core in
``csrc/ops/canvas_noise.h``. Bit-identical on every path (integer only).

``noise_inputs_ok`` is the input check the three seeded-noise ops share (``gumbel_noise`` and ``diffusion_step``
import it from here, as their cores share ``NoiseParams``).
"""

from __future__ import annotations

import torch

from . import native, reference


def noise_inputs_ok(seeds, blocks, steps) -> bool:
    """Whether seeds, blocks, steps are [B] int64 tensors on one device the extension serves (else the reference
    runs: it raises torch's own errors on bad inputs)."""
    if not all(isinstance(t, torch.Tensor) for t in (seeds, blocks, steps)):
        return False
    if seeds.dim() != 1 or blocks.shape != seeds.shape or steps.shape != seeds.shape:
        return False
    if not (seeds.device == blocks.device == steps.device and native.native_device(seeds.device)):
        return False
    return all(t.dtype == torch.int64 for t in (seeds, blocks, steps))


def canvas_noise_native_ok(seeds, blocks, steps, canvas_length: int, vocab_size: int) -> bool:
    """Whether ``canvas_noise`` runs ``_C.canvas_noise`` on these arguments."""
    return (
        native.has_native("canvas_noise")
        and noise_inputs_ok(seeds, blocks, steps)
        and vocab_size >= 1
        and canvas_length >= 0
    )


def canvas_noise(
    seeds: torch.Tensor, blocks: torch.Tensor, steps: torch.Tensor, canvas_length: int, vocab_size: int
) -> torch.Tensor:
    """Contract canvas tokens (docs/seeded-noise.md); see ``reference.canvas_noise``.

    Parameters
    ----------
    seeds, blocks, steps : [B] int64 (blocks in [0, 2^32), steps in [0, 2^31))
    canvas_length : C >= 0
    vocab_size : V >= 1

    Returns
    -------
    new tensor [B, C] int64 on the inputs' device. Bit-identical on every path.
    """
    if not canvas_noise_native_ok(seeds, blocks, steps, canvas_length, vocab_size):
        return reference.canvas_noise(seeds, blocks, steps, canvas_length, vocab_size)
    out = torch.empty(seeds.shape[0], canvas_length, dtype=torch.int64, device=seeds.device)
    native._C.canvas_noise(
        seeds.contiguous(), blocks.contiguous(), steps.contiguous(), int(canvas_length), int(vocab_size), out
    )
    return out
