"""``nvfp4_moe_experts``: the grouped W4A16 expert MLP on ``PackedExperts`` with the fp32 combine (docs/kernels.md,
NVFP4 experts); native core in ``csrc/ops/nvfp4_moe_experts.h``.

align (``moe_align``) → GEMM1 (gate/up, separate global scales, GELU-tanh, bf16 intermediate) → GEMM2 (global
scale × routing weight in the epilogue) → ``moe_combine`` (slot order, fp32).

- CPU: the torch GEMMs of ``nvfp4_format.expert_outputs`` on exactly decoded weights (the native decode gives the
  same values), so bit-identical to the reference; ``_C.nvfp4_moe_experts`` on the CPU is the kernel-faithful
  mirror the tests check, not a serving path.
- CUDA (bf16 x): ``_C.nvfp4_moe_experts``, the native W4A16 kernels, no host synchronisation; within the tolerances
  of docs/exactness.md.
"""

from __future__ import annotations

import torch

from . import native, nvfp4_format, reference
from .moe_align import CUDA_ALIGN_BLOCK, CUDA_MAX_EXPERTS, moe_align
from .moe_combine import moe_combine
from .nvfp4_format import PackedExperts
from .nvfp4_repack import nvfp4_decode


def nvfp4_moe_experts_native_ok(
    x: torch.Tensor, experts: PackedExperts, weights: torch.Tensor, ids: torch.Tensor
) -> bool:
    """Whether ``nvfp4_moe_experts`` may use native pieces: native dispatch on, x [T, H] with H = experts.hidden,
    weights and ids [T, K] (ids int64), no autograd (then CUDA checks ``nvfp4_moe_experts_cuda_ok``)."""
    T = ids.shape[0]
    return (
        native.native_enabled()
        and x.dim() == 2
        and x.shape == (T, experts.hidden)
        and weights.shape == ids.shape
        and ids.dtype == torch.int64
        and not native.wants_grad(x, weights)
    )


def nvfp4_moe_experts_cuda_ok(x: torch.Tensor, experts: PackedExperts) -> bool:
    """Whether the CUDA W4A16 kernels serve x: a CUDA build, bf16 x with a contiguous last dim, rows 16-byte aligned,
    the experts on x's device, at most ``CUDA_MAX_EXPERTS`` experts."""
    E = experts.gs.shape[0]
    return (
        native.has_native("nvfp4_moe_experts")
        and native.cuda_built()
        and x.dtype == torch.bfloat16
        and E <= CUDA_MAX_EXPERTS
        and all(t.device == x.device for t in experts[:5])
        and x.stride(-1) == 1
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
    )


def _decode_fp32(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``nvfp4_format.decode_repacked`` through the native decode: E2M1·s·2^-7 (exact bf16) × 2^7 = the same fp32
    values."""
    return nvfp4_decode(words, scales).float() * 128.0


def nvfp4_moe_experts(
    x: torch.Tensor, experts: PackedExperts, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Grouped W4A16 expert MLP with the fp32 combine; see ``reference.nvfp4_moe_experts``.

    Parameters
    ----------
    x : [T, H] (bf16 for the CUDA kernels)
    experts : ``nvfp4_repack.pack_experts`` output on x's device (E experts, hidden H, inter I)
    weights : [T, K] fp32 routing weights
    ids : [T, K] int64 expert ids in [0, E)

    Returns
    -------
    new tensor [T, H] in x's dtype: out[t] = rnd(Σ_k y[t·K + k]) in slot order, y from
    ``nvfp4_format.expert_outputs``. CPU: bit-identical to the reference.
    """
    if not nvfp4_moe_experts_native_ok(x, experts, weights, ids):
        return reference.nvfp4_moe_experts(x, experts, weights, ids)
    T, K = ids.shape
    H = experts.hidden
    weights = weights.to(torch.float32).contiguous()
    if x.device.type == "cuda" and nvfp4_moe_experts_cuda_ok(x, experts):
        align = moe_align(ids, experts.gs.shape[0], CUDA_ALIGN_BLOCK)
        y = nvfp4_expert_gemms(x, experts, weights, align)
        return moe_combine(y.view(T, K, H), None, x.dtype)
    if x.device.type == "cpu" and native.has_native("nvfp4_moe_experts"):
        align = moe_align(ids, experts.gs.shape[0], 1)
        decode = _decode_fp32 if native.has_native("nvfp4_decode") else nvfp4_format.decode_repacked
        y = nvfp4_format.expert_outputs(x, experts, weights, align.offsets, align.sorted_pairs, decode)
        return moe_combine(y.view(T, K, H), None, x.dtype)
    return reference.nvfp4_moe_experts(x, experts, weights, ids)


def nvfp4_expert_gemms(x: torch.Tensor, experts: PackedExperts, weights: torch.Tensor, align) -> torch.Tensor:
    """The native grouped W4A16 GEMMs alone, on a precomputed alignment (``moe_align`` of the [T, K] ids): the
    stage ``nvfp4_moe_experts`` runs between align and combine on CUDA, and what bench/ times by itself.

    x [T, H]; weights [T, K] fp32 contiguous; align: ``MoeAlignOut`` (offsets, sorted_pairs) → new tensor
    [T·K, H] fp32, row t·K + k the routing-weighted output of pair (t, k). Needs the native op (``has_native``).
    """
    if not native.has_native("nvfp4_moe_experts"):
        raise RuntimeError("nvfp4_expert_gemms: the native extension has no nvfp4_moe_experts (python build.py)")
    pairs = align.sorted_pairs.numel()
    act = torch.empty(pairs, experts.inter, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(weights.numel(), experts.hidden, dtype=torch.float32, device=x.device)
    native._C.nvfp4_moe_experts(x, *experts[:5], weights, align.offsets, align.sorted_pairs, act, y)
    return y
