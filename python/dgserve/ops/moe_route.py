"""``moe_route``: the MoE router (docs/generation.md); native core in ``csrc/ops/moe_route.h``.

The router prologue (scale-free RMSNorm via ``rms_norm``, × scale, × H^-0.5) stays torch ops and the projection is
``linear`` (the batch-invariant GEMM on the CPU, cuBLAS on CUDA); ``_C.moe_route`` fuses what follows, from the
scores [T, E]:

- CPU: torch's fp32 softmax, then the native top-k (torch's CPU topk replayed: same libstdc++ selection and
  comparator, so the same order at ties), renormalisation (torch's sum order) and per-expert scale: bit-identical
  to the reference for fp32 and bf16, checked once per process on tie-heavy probes (``topk_replay_exact``; else
  the reference is used).
- CUDA: the softmax fused too (``from_logits``), ties to the lowest expert index (not bit-identical to torch).
"""

from __future__ import annotations

import torch

from . import native, reference
from .linear import linear
from .moe_align import moe_native_device
from .rms_norm import rms_norm

CUDA_MAX_TOP_K = 32  # the CUDA kernel's limit on k (csrc/ops/moe_route.cu)
_topk_exact_memo: list[bool] = []


def topk_replay_exact() -> bool:
    """Whether the native CPU top-k reproduces torch.topk + renormalise + scale bit for bit, on probes full of ties
    (softmax of small integers); memoised per process. Needs the extension."""
    if _topk_exact_memo:
        return _topk_exact_memo[0]
    lanes = native.sum_lanes()
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
    _topk_exact_memo.append(ok)
    return ok


def moe_route_native_ok(residual, router_scale, proj_w, per_expert_scale, top_k: int) -> bool:
    """Whether ``moe_route`` runs ``_C.moe_route``: an fp32/bf16 residual without autograd, 1 <= top_k <= E, a [E]
    per-expert scale, a served device; on the CPU the top-k replay must be exact (and deterministic algorithms
    off), on CUDA top_k <= ``CUDA_MAX_TOP_K``."""
    if not (native.has_native("moe_route") and isinstance(residual, torch.Tensor) and residual.dim() >= 1):
        return False
    if residual.dtype not in (torch.float32, torch.bfloat16):
        return False
    if native.wants_grad(residual, router_scale, proj_w, per_expert_scale):
        return False
    E = proj_w.shape[0]
    if not (1 <= top_k <= E and per_expert_scale.shape == (E,) and moe_native_device(residual.device, E)):
        return False
    if residual.device.type == "cpu":
        return not torch.are_deterministic_algorithms_enabled() and topk_replay_exact()
    return top_k <= CUDA_MAX_TOP_K


def moe_route(
    residual: torch.Tensor,
    router_scale: torch.Tensor,
    proj_w: torch.Tensor,
    per_expert_scale: torch.Tensor,
    top_k: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router top-k of each token; see ``reference.moe_route``.

    Parameters
    ----------
    residual : [..., H] md (the layer's input)
    router_scale : [H] md
    proj_w : [E, H] md (the router projection)
    per_expert_scale : [E] (applied after the renormalisation)
    top_k : K in [1, E]
    eps : the router norm's epsilon

    Returns
    -------
    (weights [..., K] fp32, expert ids [..., K] int64), new tensors. CPU: bit-identical to the reference (ties
    ordered as torch's CPU topk orders them). CUDA: softmax, top-k (ties → lowest expert index) and
    renormalisation in one kernel, fp32.
    """
    if not moe_route_native_ok(residual, router_scale, proj_w, per_expert_scale, top_k):
        return reference.moe_route(residual, router_scale, proj_w, per_expert_scale, top_k, eps)
    h = rms_norm(residual, None, eps)  # bit-identical to reference.rms_norm
    h = h * router_scale * (residual.shape[-1] ** -0.5)  # the reference's two md roundings
    logits = linear(h, proj_w)  # [..., E] md: the batch-invariant GEMM on the CPU (cuBLAS on CUDA)
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
        native.sum_lanes() or 8,
    )
    return weights.view(*lead, top_k), ids.view(*lead, top_k)
