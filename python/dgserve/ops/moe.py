"""MoE dispatch ops: router top-k, align/sort, grouped expert GEMMs, combine (re-exported by ``dgserve.ops``).

Native paths (contracts in ``csrc/ops/moe_*.h``) and why they are what they are:

- ``moe_route``: the router prologue (scale-free RMSNorm via ``ops.rms_norm``, × scale, × H^-0.5) and the
  projection GEMM stay torch ops (a GEMM's bits are the BLAS's); the native op fuses what follows.
  CPU: torch's fp32 softmax, then the native top-k (torch's CPU topk replayed: same libstdc++ selection and
  comparator, so the same order at ties), renormalisation (torch's sum order) and per-expert scale:
  bit-identical to the reference for fp32 and bf16, checked once per process on tie-heavy probes (else the
  reference is used). CUDA: softmax fused too, ties to the lowest expert index (not bit-identical to torch).
- ``moe_align``: bit-identical everywhere (stable order within an expert, integer only); no host sync on CUDA.
- ``moe_experts``: CPU keeps torch's GEMMs, one pair of F.linear per expert over its contiguous group in
  expert order (``reference.moe_expert_outputs``): CPU GEMM results depend on the BLAS's blocking for each
  shape, so exactly the reference's calls are the only way to stay bit-identical (and parity with transformers
  depends on it); the native align and combine around them are exact. CUDA (bf16): native grouped GEMMs
  (gate/up + GELU-tanh fused, routing weight in GEMM2's epilogue), within bf16 tolerance of the reference.
- ``moe_combine``: bit-identical everywhere (fp32 products and sums in slot order, one rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native, reference
from .norm import rms_norm
from .reference import MoeAlignOut, moe_align_capacity

CUDA_ALIGN_BLOCK = 8  # moe_align block on CUDA: one n8 tile of the expert GEMMs' token dimension
CUDA_MAX_EXPERTS = 256  # the CUDA route and align kernels' limit (csrc/ops/moe_route.h, moe_align.h)
_FLOATS = (torch.float32, torch.bfloat16)
_route_exact_memo: list[bool] = []


def _device_ok(device: torch.device, experts: int) -> bool:
    return device.type == "cpu" or (device.type == "cuda" and native._cuda_built() and experts <= CUDA_MAX_EXPERTS)


def _route_exact() -> bool:
    """Whether the native CPU top-k reproduces torch.topk + renormalise + scale bit for bit, on probes full of
    ties (softmax of small integers); memoised per process."""
    if _route_exact_memo:
        return _route_exact_memo[0]
    lanes = native._sum_lanes()
    ok = lanes is not None
    gen = torch.Generator().manual_seed(7)
    for E, k in ((4, 2), (5, 1), (6, 3), (7, 7), (128, 1), (128, 8), (257, 4), (1000, 8)):
        if not ok:
            break
        probs = torch.softmax(torch.randint(0, 4, (64, E), generator=gen).float(), dim=-1)
        scale = torch.rand(E, generator=gen) + 0.5
        w = torch.empty(64, k)
        ids = torch.empty(64, k, dtype=torch.int64)
        native._C.moe_route(probs, scale, k, False, w, ids, lanes)
        v, i = torch.topk(probs, k, dim=-1)
        ok = torch.equal(ids, i) and torch.equal(w, v / v.sum(dim=-1, keepdim=True) * scale[i])
    _route_exact_memo.append(ok)
    return ok


def _route_native_ok(residual, router_scale, proj_w, per_expert_scale, top_k) -> bool:
    if not (native.has_native("moe_route") and isinstance(residual, torch.Tensor) and residual.dim() >= 1):
        return False
    if residual.dtype not in _FLOATS or native._wants_grad(residual, router_scale, proj_w, per_expert_scale):
        return False
    E = proj_w.shape[0]
    if not (1 <= top_k <= E and per_expert_scale.shape == (E,) and _device_ok(residual.device, E)):
        return False
    if residual.device.type == "cpu":
        return not torch.are_deterministic_algorithms_enabled() and _route_exact()
    return top_k <= 32  # the CUDA kernel's limit


def moe_route(residual, router_scale, proj_w, per_expert_scale, top_k: int, eps: float):
    """Router: residual [..., H] md → (weights [..., K] fp32, expert ids [..., K] int64); see reference.moe_route.

    CPU: bit-identical to the reference (ties ordered as torch's CPU topk orders them). CUDA: softmax, top-k
    (ties → lowest expert index) and renormalisation in one kernel, fp32.
    """
    if not _route_native_ok(residual, router_scale, proj_w, per_expert_scale, top_k):
        return reference.moe_route(residual, router_scale, proj_w, per_expert_scale, top_k, eps)
    h = rms_norm(residual, None, eps)  # bit-identical to reference.rms_norm
    h = h * router_scale * (residual.shape[-1] ** -0.5)  # the reference's two md roundings
    logits = F.linear(h, proj_w)  # [..., E] md: torch's GEMM
    lead, E = logits.shape[:-1], logits.shape[-1]
    logits = logits.reshape(-1, E)
    if residual.device.type == "cpu":
        scores, from_logits = torch.softmax(logits, dim=-1, dtype=torch.float32), False
    else:
        scores, from_logits = logits.contiguous(), True
    T, dev = scores.shape[0], scores.device
    weights = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=dev)
    native._C.moe_route(
        scores,
        per_expert_scale.to(torch.float32).contiguous(),
        int(top_k),
        from_logits,
        weights,
        ids,
        native._sum_lanes() or 8,
    )
    return weights.view(*lead, top_k), ids.view(*lead, top_k)


def moe_align(ids: torch.Tensor, num_experts: int, block_size: int) -> MoeAlignOut:
    """Group the pairs of ids [T, K] by expert, segments padded to block_size; see reference.moe_align.

    Returns MoeAlignOut of new int32 tensors: counts [E], offsets [E + 1], sorted_pairs [T·K + E·(block_size − 1)]
    (stable within an expert, sentinel T·K in padding), block_expert [len(sorted_pairs) // block_size] (−1 unused).
    Bit-identical on every path; no host synchronisation on CUDA (ids must lie in [0, E) there: not checked).
    """
    if not (
        native.has_native("moe_align")
        and isinstance(ids, torch.Tensor)
        and ids.dim() == 2
        and ids.dtype == torch.int64
        and num_experts >= 1
        and block_size >= 1
        and _device_ok(ids.device, num_experts)
    ):
        return reference.moe_align(ids, num_experts, block_size)
    P, dev = ids.numel(), ids.device
    cap = moe_align_capacity(P, num_experts, block_size)
    out = MoeAlignOut(
        counts=torch.empty(num_experts, dtype=torch.int32, device=dev),
        offsets=torch.empty(num_experts + 1, dtype=torch.int32, device=dev),
        sorted_pairs=torch.empty(cap, dtype=torch.int32, device=dev),
        block_expert=torch.empty(cap // block_size, dtype=torch.int32, device=dev),
    )
    native._C.moe_align(ids.contiguous(), int(num_experts), int(block_size), *out)
    return out


def moe_combine(y: torch.Tensor, weights: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``rnd(Σ_k y[:, k]·w[:, k])`` in slot order: y [T, K, H] fp32, weights [T, K] fp32 or None (y already
    weighted) → new [T, H] in dtype; see reference.moe_combine. Bit-identical on every path."""
    ok = (
        native.has_native("moe_combine")
        and y.dim() == 3
        and y.dtype == torch.float32
        and y.shape[1] >= 1
        and dtype in _FLOATS
        and native._native_device(y.device)
        and not native._wants_grad(y, weights)
    )
    if ok and weights is not None:
        ok = weights.dtype == torch.float32 and weights.shape == y.shape[:2] and weights.device == y.device
    if not ok:
        return reference.moe_combine(y, weights, dtype)
    out = torch.empty(y.shape[0], y.shape[2], dtype=dtype, device=y.device)
    native._C.moe_combine(y.contiguous(), None if weights is None else weights.contiguous(), out)
    return out


def _experts_cuda_ok(x, gate_up, down, weights, ids) -> bool:
    E, H = gate_up.shape[0], x.shape[-1]
    I = gate_up.shape[1] // 2
    tensors = (x, gate_up, down)
    return (
        x.dtype == torch.bfloat16
        and all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)
        and H % 8 == 0
        and I % 8 == 0
        and E <= CUDA_MAX_EXPERTS
        and native._cuda_built()
        and weights.is_floating_point()
    )


def moe_experts(x, gate_up, down, weights, ids):
    """Grouped expert MLP with an fp32 combine → [T, H] md; see reference.moe_experts.

    x [T, H] md; gate_up [E, 2I, H]; down [E, H, I]; weights [T, K] fp32; ids [T, K] int64.
    CPU: native align + torch GEMMs per expert (the reference's calls) + native combine: bit-identical.
    CUDA, bf16: native align → grouped GEMM1 (gate/up, GELU-tanh) → grouped GEMM2 (× routing weight) →
    native combine, with no host synchronisation; other CUDA inputs use the reference.
    """
    ok = (
        native.native_enabled()
        and isinstance(x, torch.Tensor)
        and x.dim() == 2
        and ids.dim() == 2
        and ids.dtype == torch.int64
        and ids.shape == weights.shape
        and ids.shape[0] == x.shape[0]
        and not native._wants_grad(x, gate_up, down, weights)
    )
    if not ok:
        return reference.moe_experts(x, gate_up, down, weights, ids)
    (T, K), E, H = ids.shape, gate_up.shape[0], x.shape[-1]
    if (
        x.device.type == "cuda"
        and native.has_native("moe_experts")
        and _experts_cuda_ok(x, gate_up, down, weights, ids)
    ):
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
        y = reference.moe_expert_outputs(x, gate_up, down, align, K)
        return moe_combine(y.view(T, K, H), weights, x.dtype)
    return reference.moe_experts(x, gate_up, down, weights, ids)
