"""``gumbel_noise``: the contract's Gumbel noise (docs/seeded-noise.md); native core in ``csrc/ops/gumbel_noise.h``.

The native path computes the logs with the contract's float32 log ``dg_logf``, shared by the CPU and CUDA code: it
is exactly the noise the native ``diffusion_step`` adds, and within 1 ulp of max(|g|, 1) of the reference's
``torch.log`` noise (docs/exactness.md).
"""

from __future__ import annotations

import torch

from . import native, reference
from .canvas_noise import noise_inputs_ok


def gumbel_noise_native_ok(seeds, blocks, steps, canvas_length: int, vocab_size: int) -> bool:
    """Whether ``gumbel_noise`` runs ``_C.gumbel_noise`` on these arguments."""
    return (
        native.has_native("gumbel_noise")
        and noise_inputs_ok(seeds, blocks, steps)
        and vocab_size >= 1
        and canvas_length >= 0
    )


def gumbel_noise(
    seeds: torch.Tensor, blocks: torch.Tensor, steps: torch.Tensor, canvas_length: int, vocab_size: int
) -> torch.Tensor:
    """Contract Gumbel noise (docs/seeded-noise.md); see ``reference.gumbel_noise``.

    Parameters
    ----------
    seeds, blocks, steps : [B] int64
    canvas_length : C >= 0
    vocab_size : V >= 1

    Returns
    -------
    new tensor [B, C, V] fp32. Native: the logs by ``dg_logf`` (the noise the native ``diffusion_step`` adds, bit
    for bit), at most 1 ulp of max(|g|, 1) from the reference's ``torch.log``.
    """
    if not gumbel_noise_native_ok(seeds, blocks, steps, canvas_length, vocab_size):
        return reference.gumbel_noise(seeds, blocks, steps, canvas_length, vocab_size)
    out = torch.empty(seeds.shape[0], canvas_length, vocab_size, dtype=torch.float32, device=seeds.device)
    native._C.gumbel_noise(
        seeds.contiguous(), blocks.contiguous(), steps.contiguous(), int(canvas_length), int(vocab_size), out
    )
    return out
