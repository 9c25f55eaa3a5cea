"""``moe_experts``: the grouped expert MLP with the fp32 combine (docs/kernels.md, MoE dispatch); native core in
``csrc/ops/moe_experts.h``.

- CPU: native ``moe_align``, then per expert over its contiguous group the batch-invariant ``linear`` (gate/up),
  ``gelu_tanh_mul`` and ``linear`` (down), then native ``moe_combine``. A torch GEMM's row results depend on the
  BLAS's blocking for each row count, and an expert's row count depends on the whole batch; ``linear`` computes
  each row alone in a fixed order, so a token's output is bit-identical alone and in any batch (docs/exactness.md,
  "Batch invariance"), within fp32 rounding of the reference (torch GEMMs). ``_C.moe_experts`` on the CPU is the
  CUDA kernels' mirror the tests check, not a serving path.
- CUDA (bf16): native align → ``_C.moe_experts`` (grouped GEMM1 with gate/up and GELU-tanh fused, grouped GEMM2
  with the routing weight in its epilogue) → native combine, no host synchronisation; within bf16 tolerance of
  the reference (docs/exactness.md).
"""

from __future__ import annotations

import torch

from . import native, reference
from .gelu_tanh_mul import gelu_tanh_mul
from .linear import linear
from .moe_align import CUDA_ALIGN_BLOCK, CUDA_MAX_EXPERTS, moe_align
from .moe_combine import moe_combine


def moe_experts_native_ok(x, gate_up, down, weights, ids) -> bool:
    """Whether ``moe_experts`` may use native pieces: native dispatch on, x [T, H], ids [T, K] int64 of weights'
    shape, no autograd (then the CPU runs native align and combine around torch GEMMs, CUDA checks
    ``moe_experts_cuda_ok``)."""
    return (
        native.native_enabled()
        and isinstance(x, torch.Tensor)
        and x.dim() == 2
        and ids.dim() == 2
        and ids.dtype == torch.int64
        and ids.shape == weights.shape
        and ids.shape[0] == x.shape[0]
        and not native.wants_grad(x, gate_up, down, weights)
    )


def moe_experts_cuda_ok(x, gate_up, down, weights, ids) -> bool:
    """Whether the CUDA grouped GEMMs (``_C.moe_experts``) serve these CUDA tensors: bf16 x and weights, contiguous
    and 16-byte aligned, H and I multiples of 8, at most ``CUDA_MAX_EXPERTS`` experts, a CUDA build."""
    E, H = gate_up.shape[0], x.shape[-1]
    I = gate_up.shape[1] // 2
    tensors = (x, gate_up, down)
    return (
        native.has_native("moe_experts")
        and x.dtype == torch.bfloat16
        and all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)
        and H % 8 == 0
        and I % 8 == 0
        and E <= CUDA_MAX_EXPERTS
        and native.cuda_built()
        and weights.is_floating_point()
    )


def moe_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Grouped expert MLP with an fp32 combine; see ``reference.moe_experts``.

    Parameters
    ----------
    x : [T, H] md
    gate_up : [E, 2I, H] md (gate rows, then up rows)
    down : [E, H, I] md
    weights : [T, K] fp32 routing weights
    ids : [T, K] int64 expert ids in [0, E)

    Returns
    -------
    new tensor [T, H] md. CPU: batch-invariant, within fp32 rounding of the reference. CUDA, bf16: the native
    grouped GEMMs (other CUDA inputs use the reference).
    """
    if not moe_experts_native_ok(x, gate_up, down, weights, ids):
        return reference.moe_experts(x, gate_up, down, weights, ids)
    (T, K), E, H = ids.shape, gate_up.shape[0], x.shape[-1]
    if x.device.type == "cuda" and moe_experts_cuda_ok(x, gate_up, down, weights, ids):
        align = moe_align(ids, E, CUDA_ALIGN_BLOCK)
        act = torch.empty(align.sorted_pairs.numel(), gate_up.shape[1] // 2, dtype=x.dtype, device=x.device)
        y = torch.empty(T * K, H, dtype=torch.float32, device=x.device)
        native._C.moe_experts(
            x,
            gate_up,
            down,
            weights.to(torch.float32).contiguous(),
            align.counts,
            align.offsets,
            align.sorted_pairs,
            act,
            y,
        )
        return moe_combine(y.view(T, K, H), None, x.dtype)
    if x.device.type == "cpu":
        align = moe_align(ids, E, 1)
        y = expert_outputs_cpu(x, gate_up, down, align, K)
        return moe_combine(y.view(T, K, H), weights, x.dtype)
    return reference.moe_experts(x, gate_up, down, weights, ids)


def expert_outputs_cpu(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, align: reference.MoeAlignOut, top_k: int
) -> torch.Tensor:
    """``reference.moe_expert_outputs`` with the batch-invariant pieces: un-weighted expert outputs f32 [T·K, H] in
    (token, slot) order, each expert's group through ``linear``, ``gelu_tanh_mul``, ``linear``."""
    P = x.shape[0] * top_k
    inter = gate_up.shape[1] // 2
    offsets = align.offsets.tolist()
    pairs = align.sorted_pairs[: offsets[-1]].long()  # block size 1: every pair once, grouped by expert
    xs = x.index_select(0, pairs.clamp(max=max(P - 1, 0)) // top_k)  # index_select: a plain row copy
    outs = []
    for e, n in enumerate(align.counts.tolist()):
        if n:
            s = offsets[e]
            gu = linear(xs[s : s + n], gate_up[e])
            outs.append(linear(gelu_tanh_mul(gu[:, :inter], gu[:, inter:]), down[e]))
    if not outs:
        return torch.empty(P, x.shape[-1], dtype=torch.float32, device=x.device)
    # the experts' rows in expert order, then one gather back to (token, slot) order (a row gather is several times
    # faster than scattering each expert's rows with index_copy_)
    where = torch.empty_like(pairs)
    where[pairs] = torch.arange(pairs.numel(), device=pairs.device)
    return torch.cat(outs).float().index_select(0, where)
