"""dgserve ops: the public op surface used by the model and the sampler.

Each op dispatches to the compiled extension ``dgserve._C`` when it is built and supports the
inputs, and otherwise to the readable PyTorch formula in ``dgserve.ops.reference`` (the oracle).
Layers call these functions, never ``_C`` directly (one name per op, end to end).

Native paths (``python build.py`` builds ``_C``; contracts in ``csrc/ops/<op>.h``):

- ``rms_norm``: CPU, fp32/bf16, last dim contiguous → bit-identical to the reference (torch's CPU sum
  order is reproduced; verified once per process, else the reference is used). CUDA: one fused kernel per
  row (a block-wide tree sum: within an ulp or so of the reference, not bit-identical; the start-up
  self-check holds it to its tolerance) instead of torch's five kernels.
- ``canvas_noise``: bit-identical everywhere (integer only).
- ``gumbel_noise`` and the Gumbel draw inside ``diffusion_step``: the contract's float32 log ``dg_logf``
  shared by the CPU and CUDA code, within 1 ulp of max(|g|, 1) of the reference's ``torch.log`` noise
  (spec §7.6); the native ``gumbel_noise`` is exactly the noise the native ``diffusion_step`` adds.
- ``diffusion_step``: processed logits, argmax and renoise bit-identical to the reference; sampled tokens
  equal except at near-ties of the Gumbel race; entropy accumulated in double (a few fp32 ulp from the
  reference's fp32 formula); acceptance and the mean bit-exact given the entropies.

- ``moe_route``, ``moe_align``, ``moe_experts``, ``moe_combine``: see ``dgserve.ops.moe`` (CPU: bit-identical;
  CUDA: fused route, device-side align, bf16 grouped expert GEMMs, exact combine).
- ``nvfp4_repack``, ``nvfp4_moe_experts``: see ``dgserve.ops.nvfp4_experts`` (NVFP4 W4A16 experts: exact
  in-register decode, grouped GEMMs on CUDA; CPU: torch GEMMs on exactly decoded weights).

``native_disabled()`` forces the reference path (tests); ``native_enabled()`` says whether native
dispatch is on. ``switch_off_native(op, reason)`` turns one op's native path off for the process (the start-up
self-check, ``dgserve.ops.native_check``, does it for an op that disagrees with its reference); ``active_native_ops``
lists what runs natively on a device.
"""

from __future__ import annotations

import torch

from . import native, reference
from .moe import MoeAlignOut, moe_align, moe_combine, moe_experts, moe_route  # MoE dispatch (see moe.py)
from .native import (
    NATIVE_OPS,
    active_native_ops,
    cuda_build_problem,
    has_native,
    native_disabled,
    native_enabled,
    switch_off_native,
    switch_on_native,
    switched_off,
)
from .norm import rms_norm
from .nvfp4_experts import nvfp4_decode, nvfp4_moe_experts, nvfp4_repack  # W4A16 experts (see nvfp4_experts.py)
from .reference import DiffusionStepOut, entropy_bound_accept, gated_mlp, step_temperature

__all__ = [
    "NATIVE_OPS",
    "DiffusionStepOut",
    "MoeAlignOut",
    "active_native_ops",
    "canvas_noise",
    "cuda_build_problem",
    "diffusion_step",
    "entropy_bound_accept",
    "gated_mlp",
    "gumbel_noise",
    "has_native",
    "moe_align",
    "moe_combine",
    "moe_experts",
    "moe_route",
    "native_disabled",
    "native_enabled",
    "nvfp4_decode",
    "nvfp4_moe_experts",
    "nvfp4_repack",
    "rms_norm",
    "step_temperature",
    "switch_off_native",
    "switch_on_native",
    "switched_off",
]


def _noise_inputs(seeds, blocks, steps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """[B] int64 tensors on one device the extension supports, else None (→ reference)."""
    if not all(isinstance(t, torch.Tensor) for t in (seeds, blocks, steps)):
        return None
    if seeds.dim() != 1 or blocks.shape != seeds.shape or steps.shape != seeds.shape:
        return None
    if not (seeds.device == blocks.device == steps.device and native._native_device(seeds.device)):
        return None
    if any(t.dtype != torch.int64 for t in (seeds, blocks, steps)):
        return None
    return seeds.contiguous(), blocks.contiguous(), steps.contiguous()


def canvas_noise(seeds, blocks, steps, canvas_length: int, vocab_size: int) -> torch.Tensor:
    """Contract canvas tokens [B, C] int64 (spec §7.4); see reference.canvas_noise.

    seeds, blocks, steps: [B] int64 (blocks in [0, 2^32), steps in [0, 2^31)) → new tensor [B, C] int64.
    Bit-identical on every path.
    """
    args = _noise_inputs(seeds, blocks, steps) if native.has_native("canvas_noise") else None
    if args is None or vocab_size < 1 or canvas_length < 0:
        return reference.canvas_noise(seeds, blocks, steps, canvas_length, vocab_size)
    out = torch.empty(args[0].shape[0], canvas_length, dtype=torch.int64, device=args[0].device)
    native._C.canvas_noise(*args, int(canvas_length), int(vocab_size), out)
    return out


def gumbel_noise(seeds, blocks, steps, canvas_length: int, vocab_size: int) -> torch.Tensor:
    """Contract Gumbel noise [B, C, V] fp32 (spec §7.5); see reference.gumbel_noise.

    seeds, blocks, steps: [B] int64 → new tensor [B, C, V] fp32. The native path computes the logs with the
    contract's shared ``dg_logf`` (the noise the native ``diffusion_step`` adds, bit for bit); it differs
    from the reference's ``torch.log`` by at most 1 ulp of max(|g|, 1) (spec §7.6).
    """
    args = _noise_inputs(seeds, blocks, steps) if native.has_native("gumbel_noise") else None
    if args is None or vocab_size < 1 or canvas_length < 0:
        return reference.gumbel_noise(seeds, blocks, steps, canvas_length, vocab_size)
    out = torch.empty(args[0].shape[0], canvas_length, vocab_size, dtype=torch.float32, device=args[0].device)
    native._C.gumbel_noise(*args, int(canvas_length), int(vocab_size), out)
    return out


def diffusion_step(logits, temperature, seeds, blocks, steps, entropy_bound, bitmask=None) -> DiffusionStepOut:
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
    if not _diffusion_step_native_ok(logits, temperature, seeds, blocks, steps, entropy_bound, bitmask):
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
        native._sum_lanes() or 8,
        None if bitmask is None else bitmask.contiguous(),
    )
    return out


def _diffusion_step_native_ok(logits, temperature, seeds, blocks, steps, entropy_bound, bitmask=None) -> bool:
    if not (native.has_native("diffusion_step") and isinstance(logits, torch.Tensor) and logits.dim() == 3):
        return False
    B, C, V = logits.shape
    if B == 0 or C == 0 or V == 0 or logits.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not native._native_device(logits.device) or native._wants_grad(logits):
        return False
    if logits.device.type == "cuda" and C > native._diffusion_step_max_canvas_cuda():
        return False  # a long canvas falls back instead of raising
    if _noise_inputs(seeds, blocks, steps) is None or seeds.shape != (B,) or seeds.device != logits.device:
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
