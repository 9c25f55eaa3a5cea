"""``diffusion_step``: one denoising step for B canvas rows (docs/generation.md); native core in
``csrc/ops/diffusion_step.h``.

Native (CPU and CUDA): processed logits, argmax and renoise bit-identical to the reference; sampled tokens equal
except at near-ties of the Gumbel race (the native Gumbel logs are ``dg_logf``'s, see ``gumbel_noise``); entropy
accumulated in double (a few fp32 ulp from the reference's fp32 formula); acceptance and the mean bit-exact given
the entropies (docs/exactness.md).
"""

from __future__ import annotations

import torch

from . import native, reference
from .canvas_noise import noise_inputs_ok
from .reference import DiffusionStepOut


def diffusion_step_native_ok(logits, temperature, seeds, blocks, steps, entropy_bound, bitmask=None) -> bool:
    """Whether ``diffusion_step`` runs ``_C.diffusion_step`` on these arguments: a non-empty fp32/bf16 [B, C, V]
    on a served device without autograd, [B] inputs on the same device, a well-formed bitmask or None; on CUDA a
    canvas no longer than ``native.diffusion_step_max_canvas_cuda()`` (a long canvas falls back instead of
    raising)."""
    if not (native.has_native("diffusion_step") and isinstance(logits, torch.Tensor) and logits.dim() == 3):
        return False
    B, C, V = logits.shape
    if B == 0 or C == 0 or V == 0 or logits.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not native.native_device(logits.device) or native.wants_grad(logits):
        return False
    if logits.device.type == "cuda" and C > native.diffusion_step_max_canvas_cuda():
        return False
    if not noise_inputs_ok(seeds, blocks, steps) or seeds.shape != (B,) or seeds.device != logits.device:
        return False
    for t in (temperature, entropy_bound):
        if not (
            isinstance(t, torch.Tensor) and t.shape == (B,) and t.device == logits.device and t.is_floating_point()
        ):
            return False
    if bitmask is not None and not (
        isinstance(bitmask, torch.Tensor)
        and bitmask.dtype == torch.int32
        and bitmask.shape == (B, C, (V + 31) // 32)
        and bitmask.device == logits.device
    ):
        return False  # the reference raises with torch's own message on a wrong shape
    return True


def diffusion_step(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    blocks: torch.Tensor,
    steps: torch.Tensor,
    entropy_bound: torch.Tensor,
    bitmask: torch.Tensor | None = None,
) -> DiffusionStepOut:
    """One denoising step for B rows (sample, argmax, entropy, acceptance, renoise); see reference.diffusion_step.

    Parameters
    ----------
    logits : [B, C, V] fp32 or bf16 (softcapped decoder logits); not modified
    temperature : [B] (rounded to fp32)
    seeds, blocks, steps : [B] int64 (steps = remaining-steps counter k >= 1)
    entropy_bound : [B] (rounded to fp32)
    bitmask : None (unconstrained: today's results bit for bit) or [B, C, ceil(V/32)] int32, the layout of
        llguidance / xgrammar: bit v % 32 of word v // 32 set = token v allowed; bits >= V ignored. A disallowed
        token's processed logit is -inf: probability 0 in the argmax, the Gumbel draw, the entropy (so the
        acceptance rule sees the masked distribution) and the processed logits fed back as self-conditioning.
        A fully masked position is left unmasked (defined, tested; the structured sampler never sends one).

    Returns
    -------
    DiffusionStepOut of new tensors: canvas [B, C] int64, argmax [B, C] int64, entropy [B, C] fp32,
    accepted [B, C] bool, mean_entropy [B] fp32, processed [B, C, V] fp32.
    """
    if not diffusion_step_native_ok(logits, temperature, seeds, blocks, steps, entropy_bound, bitmask):
        return reference.diffusion_step(logits, temperature, seeds, blocks, steps, entropy_bound, bitmask)
    B, C, V = logits.shape
    dev = logits.device
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = DiffusionStepOut(
        canvas=torch.empty(B, C, dtype=torch.int64, device=dev),
        argmax=torch.empty(B, C, dtype=torch.int64, device=dev),
        entropy=torch.empty(B, C, dtype=torch.float32, device=dev),
        accepted=torch.empty(B, C, dtype=torch.bool, device=dev),
        mean_entropy=torch.empty(B, dtype=torch.float32, device=dev),
        processed=torch.empty(B, C, V, dtype=torch.float32, device=dev),
    )
    native._C.diffusion_step(
        logits,
        temperature.to(torch.float32).contiguous(),
        seeds.contiguous(),
        blocks.contiguous(),
        steps.contiguous(),
        entropy_bound.to(torch.float32).contiguous(),
        out.canvas,
        out.argmax,
        out.entropy,
        out.accepted,
        out.mean_entropy,
        out.processed,
        native.sum_lanes() or 8,
        None if bitmask is None else bitmask.contiguous(),
    )
    return out
