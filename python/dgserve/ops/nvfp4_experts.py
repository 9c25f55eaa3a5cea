"""NVFP4 expert ops (W4A16): the load-time repack and the grouped expert MLP (re-exported by ``dgserve.ops``).

Native paths (contracts in ``csrc/ops/nvfp4_repack.h`` and ``nvfp4_moe_experts.h``; layout in
``csrc/ops/nvfp4_layout.h``; torch references in ``dgserve.ops.nvfp4_format``):

- ``nvfp4_repack``: pure re-indexing, bit-identical to ``nvfp4_format.repack`` on CPU and CUDA.
- ``nvfp4_moe_experts``: align (``moe_align``) → GEMM1 (gate/up, separate global scales, GELU-tanh, bf16
  intermediate) → GEMM2 (global scale × routing weight in the epilogue) → ``moe_combine`` (slot order, fp32).
  CPU: the torch GEMMs of ``nvfp4_format.expert_outputs`` on exactly decoded weights (native decode: the same values,
  so bit-identical to the reference);
  the native CPU loop ``_C.nvfp4_moe_experts`` is the kernel-faithful cross-check used by the tests. CUDA (bf16
  x): the native W4A16 kernels, no host synchronisation; within the tolerances of kernels.md §9.9.
"""

from __future__ import annotations

import torch

from . import native, nvfp4_format
from .moe import CUDA_ALIGN_BLOCK, CUDA_MAX_EXPERTS, moe_align, moe_combine
from .reference import nvfp4_moe_experts as _reference_moe_experts


def _repack_native_ok(weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    if not (native.has_native("nvfp4_repack") and native._native_device(weight.device)):
        return False
    if weight.dim() != 3 or weight.dtype != torch.uint8 or weight_scale.device != weight.device:
        return False
    E, N, half = weight.shape
    if weight_scale.shape != (E, N, 2 * half // nvfp4_format.GROUP) or (2 * half) % nvfp4_format.GROUP:
        return False
    return weight_scale.dtype in (torch.uint8, torch.float8_e4m3fn) and N % 16 == 0


def nvfp4_repack(
    weight: torch.Tensor, weight_scale: torch.Tensor, interleave: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt NVFP4 tensors of E experts → the kernel layout (words, scales); see ``nvfp4_format.repack``.

    weight uint8 [E, N, Kp/2]; weight_scale float8_e4m3fn [E, N, Kp/16] (finite, >= 0: checked, ValueError);
    interleave=True for GEMM1's stacked [gate; up] operand. → new tensors words int32 [E, N/16, KC, 128],
    scales uint8 [E, N/16, KC, 64] on weight's device. Bit-identical on every path.
    """
    if not _repack_native_ok(weight, weight_scale):
        return nvfp4_format.repack(weight, weight_scale, interleave)
    E, N, half = weight.shape
    raw = weight_scale.view(torch.uint8).contiguous()
    nvfp4_format.check_scales(raw, "weight_scale")  # load time: one host sync is fine here
    kc = nvfp4_format.chunks(2 * half)
    words = torch.empty(E, N // 16, kc, 128, dtype=torch.int32, device=weight.device)
    scales = torch.empty(E, N // 16, kc, 64, dtype=torch.uint8, device=weight.device)
    native._C.nvfp4_repack(weight.contiguous(), raw, N // 2 if interleave else 0, words, scales)
    return words, scales


def nvfp4_decode(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Test hook: the bf16 MMA operands the kernels decode, [E, N, 64·KC] = E2M1·s·2^-7 in packed row order
    (native decode on CPU or CUDA; the reference is ``nvfp4_format.decode_repacked(words, scales) * 2^-7``)."""
    E, RT, kc = words.shape[:3]
    out = torch.empty(E, RT * 16, kc * nvfp4_format.CHUNK_K, dtype=torch.bfloat16, device=words.device)
    native._C.nvfp4_decode(words.contiguous(), scales.contiguous(), out)
    return out


def _native_decode(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``nvfp4_format.decode_repacked`` through the native decode: E2M1·s·2^-7 (exact bf16) × 2^7 = the same fp32
    values."""
    return nvfp4_decode(words, scales).float() * 128.0


def _cuda_ok(x: torch.Tensor, experts: nvfp4_format.PackedExperts) -> bool:
    E = experts.gs.shape[0]
    return (
        native.has_native("nvfp4_moe_experts")
        and native._cuda_built()
        and x.dtype == torch.bfloat16
        and E <= CUDA_MAX_EXPERTS
        and all(t.device == x.device for t in experts[:5])
        and x.stride(-1) == 1
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
    )


def nvfp4_moe_experts(
    x: torch.Tensor, experts: nvfp4_format.PackedExperts, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Grouped W4A16 expert MLP with the fp32 combine → [T, H] in x's dtype; see reference.nvfp4_moe_experts.

    x [T, H] (bf16 on CUDA); experts: ``dgserve.model.nvfp4.pack_experts`` output on x's device; weights [T, K] fp32;
    ids [T, K] int64 in [0, E). out[t] = rnd(Σ_k y[t·K + k]) in slot order, y from ``nvfp4_format.expert_outputs``.
    """
    T, K = ids.shape
    H = experts.hidden
    ok = (
        native.native_enabled()
        and x.dim() == 2
        and x.shape == (T, H)
        and weights.shape == ids.shape
        and ids.dtype == torch.int64
        and not native._wants_grad(x, weights)
    )
    if not ok:
        return _reference_moe_experts(x, experts, weights, ids)
    weights = weights.to(torch.float32).contiguous()
    if x.device.type == "cuda" and _cuda_ok(x, experts):
        align = moe_align(ids, experts.gs.shape[0], CUDA_ALIGN_BLOCK)
        act = torch.empty(align.sorted_pairs.numel(), experts.inter, dtype=torch.bfloat16, device=x.device)
        y = torch.empty(T * K, H, dtype=torch.float32, device=x.device)
        native._C.nvfp4_moe_experts(x, *experts[:5], weights, align.offsets, align.sorted_pairs, act, y)
        return moe_combine(y.view(T, K, H), None, x.dtype)
    if x.device.type == "cpu" and native.has_native("nvfp4_moe_experts"):
        align = moe_align(ids, experts.gs.shape[0], 1)
        decode = _native_decode if native.has_native("nvfp4_decode") else nvfp4_format.decode_repacked
        y = nvfp4_format.expert_outputs(x, experts, weights, align.offsets, align.sorted_pairs, decode)
        return moe_combine(y.view(T, K, H), None, x.dtype)
    return _reference_moe_experts(x, experts, weights, ids)
