"""dgserve ops: the public op surface used by the model and the sampler.

One name per op, end to end: ``csrc/ops/<op>.h`` (the core's contract), ``_C.<op>`` (bindings.cpp),
``dgserve.ops.<op>`` (the dispatcher, in the module ``dgserve/ops/<op>.py``), ``dgserve.ops.reference.<op>`` (the
readable PyTorch formula, same signature), ``tests/ops/test_<op>.py``. Each dispatcher runs the compiled extension
``dgserve._C`` when it is built and supports the inputs (its module's ``<op>_native_ok``), and otherwise the
reference (the oracle). Layers call these functions, never ``_C`` directly. Exactness of each native path: the
op's module docstring and docs/exactness.md; the kernels: docs/kernels.md.

- ``rms_norm``: CPU bit-identical (torch's sum order reproduced); CUDA one fused kernel per row, within an ulp.
- ``linear``: the batch-invariant GEMM (CPU: fixed k order per element, bit-identical to the reference; CUDA:
  cuBLAS); ``gelu_tanh_mul``: the gating with one fixed scalar formula (CPU); ``gated_mlp``: the dense MLP built from
  the two (batch-invariant on the CPU).
- ``decode_attention``: the decoder's attention of several canvases in one call, each over its own keys (CPU: two
  ``linear`` GEMMs around a fixed-order softmax per canvas and head, batch-invariant, within fp32 rounding of the
  reference; elsewhere the reference).
- ``rope``: the rotate-half rotary embedding in one pass (CPU), bit-identical to the reference.
- ``rms_norm_add`` (a residual plus a norm, times the layer scalar) and ``rms_norm_rope`` (q/k norm then RoPE): a
  norm fused with its neighbours in one pass (CPU), bit-identical to the reference.
- ``softcap``: the final logit soft-cap in place with one fixed tanh formula (CPU), within 4 fp32 ulp of torch's.
- ``softmax_rows``: the self-conditioning softmax with one fixed sequence per row (CPU), within a few fp32 ulp of
  torch's.
- ``canvas_noise``: bit-identical everywhere (integer only).
- ``gumbel_noise``: the contract's float32 log ``dg_logf``: exactly the noise the native ``diffusion_step`` adds,
  within 1 ulp of max(|g|, 1) of the reference's ``torch.log`` noise.
- ``diffusion_step``: processed logits, argmax and renoise bit-identical; samples equal except at near-ties of the
  Gumbel race; entropies within a few fp32 ulp; acceptance and the mean exact given the entropies.
- ``moe_route``, ``moe_align``, ``moe_experts``, ``moe_combine``: MoE dispatch (CPU: bit-identical; CUDA: fused
  route, device-side align, bf16 grouped expert GEMMs, exact combine).
- ``nvfp4_repack`` (with the test hook ``nvfp4_decode``), ``nvfp4_moe_experts``: NVFP4 W4A16 experts (exact
  in-register decode, grouped GEMMs on CUDA; CPU: torch GEMMs on exactly decoded weights). The format, the
  quantizer and ``PackedExperts`` live in ``dgserve.ops.nvfp4_format``; ``pack_experts`` next to the repack.

``native_disabled()`` forces the reference path (tests); ``native_enabled()`` says whether native dispatch is on.
``switch_off_native(op, reason)`` turns one op's native path off for the process (the start-up self-check,
``dgserve.ops.native_check``, does it for an op that disagrees with its reference); ``active_native_ops`` lists
what runs natively on a device. The dispatch state and the build's facts are in ``dgserve.ops.native``.

This module only re-exports. A dispatcher shadows its module's name here (``dgserve.ops.rms_norm`` is the
function): import a module's other names with ``from dgserve.ops.<op> import ...``.
"""

from __future__ import annotations

from . import native, reference
from .canvas_noise import canvas_noise
from .decode_attention import decode_attention
from .diffusion_step import diffusion_step
from .gated_mlp import gated_mlp
from .gelu_tanh_mul import gelu_tanh_mul
from .gumbel_noise import gumbel_noise
from .linear import linear
from .moe_align import moe_align
from .moe_combine import moe_combine
from .moe_experts import moe_experts
from .moe_route import moe_route
from .native import (
    NATIVE_OPS,
    active_native_ops,
    cuda_build_problem,
    has_native,
    missing_cuda_ops,
    native_disabled,
    native_enabled,
    switch_off_native,
    switch_on_native,
    switched_off,
)
from .nvfp4_moe_experts import nvfp4_moe_experts
from .nvfp4_repack import nvfp4_decode, nvfp4_repack
from .reference import DiffusionStepOut, MoeAlignOut, entropy_bound_accept, step_temperature
from .rms_norm import rms_norm
from .rms_norm_add import rms_norm_add
from .rms_norm_rope import rms_norm_rope
from .rope import rope
from .softcap import softcap
from .softmax_rows import softmax_rows

__all__ = [
    "NATIVE_OPS",
    "DiffusionStepOut",
    "MoeAlignOut",
    "active_native_ops",
    "canvas_noise",
    "cuda_build_problem",
    "decode_attention",
    "diffusion_step",
    "entropy_bound_accept",
    "gated_mlp",
    "gelu_tanh_mul",
    "gumbel_noise",
    "has_native",
    "linear",
    "missing_cuda_ops",
    "moe_align",
    "moe_combine",
    "moe_experts",
    "moe_route",
    "native",
    "native_disabled",
    "native_enabled",
    "nvfp4_decode",
    "nvfp4_moe_experts",
    "nvfp4_repack",
    "reference",
    "rms_norm",
    "rms_norm_add",
    "rms_norm_rope",
    "rope",
    "softcap",
    "softmax_rows",
    "step_temperature",
    "switch_off_native",
    "switch_on_native",
    "switched_off",
]
