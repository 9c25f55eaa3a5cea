"""Readable PyTorch formulas for every dgserve op: the test oracle and the fallback of every dispatcher.

``reference.<op>`` has the name and the signature of ``dgserve.ops.<op>`` (tests/ops/test_op_surface.py checks
it), so a caller or a test swaps one for the other with the same arguments. Each function states its contract
(shapes, dtypes, rounding points) in its docstring; the native ops in ``dgserve._C`` must reproduce these results
(bit-exactly where the docstring says so; docs/exactness.md). Rounding notation: ``rnd(x)`` rounds to the model
dtype ``md``. The formulas are those of docs/generation.md and docs/seeded-noise.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import nvfp4_format
from .nvfp4_format import PackedExperts

# --------------------------------------------------------------------------------------------
# Norms and activations
# --------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: ``rnd((f32(x) * (mean(f32(x)^2) + eps)^-0.5) * f32(w))``.

    ``weight=None`` is the scale-free variant (v_norm, router norm, self-conditioning post-norm).
    The multiplier is ``w``, not ``1 + w``; ``pow(-0.5)``, not ``rsqrt``; one rounding at the end.
    """
    a = x.float()
    y = a * torch.pow(a.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``y = rnd(Σ_k f32(x[..., k])·f32(W[n, k]))``: x [..., K] md, weight [N, K] md → [..., N] md.

    The batch-invariant GEMM's exact order (docs/kernels.md, "linear: the batch-invariant GEMM"): fp32, ``acc = 0``,
    then ``acc = acc + x_k·w_k`` for k = 0 .. K-1, the product and the sum each rounded to fp32 (no fused
    multiply-add), one rounding to md at the end. Slow (K small torch ops): the oracle and the last-resort fallback.
    """
    xf, wf = x.float(), weight.float()
    acc = torch.zeros(*x.shape[:-1], weight.shape[0], dtype=torch.float32, device=x.device)
    for k in range(x.shape[-1]):
        acc = acc + xf[..., k : k + 1] * wf[:, k]
    return acc.to(x.dtype)


def decode_attention(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor] | torch.Tensor,
    values: Sequence[torch.Tensor] | torch.Tensor,
    canvas_keys: torch.Tensor,
    canvas_values: torch.Tensor,
    canvas_length: int,
    slots: Sequence[tuple[int, int, int]] | None = None,
) -> torch.Tensor:
    """The decoder's attention of B canvases, each over its own keys: q [nh, B·C, hd] md; keys[b], values[b]
    [nkv, P_b, hd] md, canvas b's cached positions; canvas_keys, canvas_values [nkv, B·C, hd] md, the canvases' own
    (canvas b's are rows b·C ..), which canvas b attends to after its cached ones (query head h reads KV head
    h // (nh / nkv)) → [B·C, nh·hd] md.

    Per canvas, eager attention over cat(cached, canvas) with scale 1.0 and no mask: scores rnd(q·kᵀ), softmax in
    fp32, rounded to md, then rnd(p·v) (docs/kernels.md, "decode_attention: the decoder's attention"). The native op
    computes the same with one fixed sequence per element and the contract's exp: within fp32 rounding of this.
    slots: keys and values are the cache's buffers [slots, nkv, cap, hd] and canvas b's cached ones are positions
    start .. start + count − 1 of slot ``slots[b] = (slot, start, count)``."""
    if slots is not None:
        assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)
        keys = [keys[s, :, a : a + n] for s, a, n in slots]
        values = [values[s, :, a : a + n] for s, a, n in slots]
    nh, _, hd = q.shape
    C = canvas_length
    outs = []
    for b, (kc, vc) in enumerate(zip(keys, values, strict=True)):
        rows = slice(b * C, (b + 1) * C)
        k = torch.cat([kc, canvas_keys[:, rows]], dim=1)
        v = torch.cat([vc, canvas_values[:, rows]], dim=1)
        nkv = k.shape[0]
        group = nh // nkv  # query head h uses KV head h // group
        qg = q[:, rows].reshape(nkv, group * C, hd)
        scores = torch.matmul(qg, k.transpose(1, 2)).view(nh, C, -1)
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(p.reshape(nkv, group * C, -1), v).view(nh, C, hd)
        outs.append(out.transpose(0, 1).reshape(C, nh * hd))
    return torch.cat(outs) if outs else q.new_empty(0, nh * hd)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [T, heads, hd] md, cos/sin [T, hd] md → ``x·cos + rot(x)·sin`` [T, heads, hd] md, rot(x) =
    cat(−x[hd/2:], x[:hd/2]); md rounding after each product and the sum (docs/generation.md, "RoPE")."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def rms_norm_add(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``residual + rms_norm(x; weight)`` [..., D] md, each rounded to md, then ``· scale`` (a one-element md
    tensor) when given: a residual update and the layer scalar (docs/generation.md, "Feed-forward (dense MLP and
    MoE)"; docs/kernels.md, "rms_norm_add and rms_norm_rope: norms fused with their neighbours")."""
    y = residual + rms_norm(x, weight, eps)
    return y if scale is None else y * scale


def rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """``rope(rms_norm(x; weight), cos, sin)``: x [T, heads, hd] md, each head normed over hd, then rotated
    (docs/generation.md, "Attention": q_norm / k_norm before RoPE) → [T, heads, hd] md."""
    return rope(rms_norm(x, weight, eps), cos, sin)


def softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dim of x [..., V] md → [..., V] fp32 (torch's; docs/kernels.md, "softmax_rows: the
    self-conditioning softmax")."""
    return torch.softmax(x, dim=-1, dtype=torch.float32)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``x ← tanh(x / cap)·cap`` in place (transformers' final logit soft-capping) → x: an IEEE division, torch's
    tanh, a product (docs/kernels.md, "softcap: the logit soft-cap"). In place: no [T, V] temporaries."""
    return x.div_(cap).tanh_().mul_(cap)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``rnd(rnd(gelu_tanh(gate)) ⊙ up)``: the gating of the gated MLP and the experts; gate, up [..., I] md.

    torch's ``gelu(approximate="tanh")``; the native op computes the same function with one fixed scalar formula,
    within a few fp32 ulp of this (docs/kernels.md, "gelu_tanh_mul: the gating").
    """
    return F.gelu(gate, approximate="tanh") * up


def gated_mlp(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    """``(gelu_tanh(x·Wgᵀ) ⊙ (x·Wuᵀ))·Wdᵀ`` in the model dtype. x [T, H] → [T, H]."""
    return F.linear(F.gelu(F.linear(x, gate_w), approximate="tanh") * F.linear(x, up_w), down_w)


# --------------------------------------------------------------------------------------------
# Mixture of experts
# --------------------------------------------------------------------------------------------


def moe_route(
    residual: torch.Tensor,
    router_scale: torch.Tensor,
    proj_w: torch.Tensor,
    per_expert_scale: torch.Tensor,
    top_k: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: residual [..., H] (md) → (weights [..., K] fp32, expert ids [..., K] int64).

    ``z = rnd(rnd(RMSNorm_noscale(r) ⊙ scale) · H^-0.5)``; ``π = softmax_fp32(linear(z, Wr))`` (the
    batch-invariant GEMM's order);
    top-k (descending), renormalised in fp32, then × per_expert_scale[e] (after renormalisation).
    """
    h = rms_norm(residual, None, eps)
    h = h * router_scale * (residual.shape[-1] ** -0.5)
    probs = torch.softmax(linear(h, proj_w), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * per_expert_scale[ids]
    return weights, ids


class MoeAlignOut(NamedTuple):
    """Token-expert pairs grouped by expert (``moe_align``). P = T·K pairs; pair ``p = t·K + k``."""

    counts: torch.Tensor  # [E] int32: pairs routed to each expert
    offsets: torch.Tensor  # [E + 1] int32: start of expert e's segment (multiples of block_size);
    #                             offsets[E] = padded total
    sorted_pairs: torch.Tensor  # [P + E·(block_size − 1)] int32: pair indices grouped by expert, ascending within
    #                             an expert; the sentinel P in each segment's padding and past offsets[E]
    block_expert: torch.Tensor  # [len(sorted_pairs) // block_size] int32: expert of each block, −1 past offsets[E]


def moe_align_capacity(num_pairs: int, num_experts: int, block_size: int) -> int:
    """Worst-case length of ``sorted_pairs``: every expert's segment padded by up to block_size − 1."""
    return num_pairs + num_experts * (block_size - 1)


def moe_align(ids: torch.Tensor, num_experts: int, block_size: int) -> MoeAlignOut:
    """Group the pairs of ids [T, K] (int, values in [0, E)) by expert, each segment padded to block_size.

    Pairs keep their (token, slot) order within an expert (a stable sort), so the result is unique.
    """
    flat = ids.reshape(-1).long()
    P, E, b, dev = flat.numel(), num_experts, block_size, flat.device
    counts = torch.bincount(flat, minlength=E)  # [E] int64
    padded = (counts + b - 1) // b * b
    offsets = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    first = torch.cumsum(counts, 0) - counts  # unpadded start of each expert
    e_sorted = flat[order]
    pos = offsets[e_sorted] + torch.arange(P, device=dev) - first[e_sorted]
    cap = moe_align_capacity(P, E, b)
    sorted_pairs = torch.full((cap,), P, dtype=torch.int32, device=dev)
    sorted_pairs[pos] = order.to(torch.int32)
    starts = torch.arange(cap // b, device=dev) * b
    owner = torch.searchsorted(offsets[1:], starts, right=True)  # first e with offsets[e + 1] > start
    block_expert = torch.where(starts < offsets[E], owner, -1).to(torch.int32)
    return MoeAlignOut(counts.to(torch.int32), offsets.to(torch.int32), sorted_pairs, block_expert)


def moe_expert_outputs(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, align: MoeAlignOut, top_k: int
) -> torch.Tensor:
    """Un-weighted expert outputs ``f32(y_p)`` [T·K, H] in (token, slot) order, y_p = expert e_p's MLP of
    x[p // K] in md (torch GEMMs, one pair of F.linear per expert over its contiguous group of rows)."""
    P = x.shape[0] * top_k
    inter = gate_up.shape[1] // 2
    offsets = align.offsets.tolist()
    counts = align.counts.tolist()
    pairs = align.sorted_pairs[: offsets[-1]].long()  # [padded total]
    xs = x[pairs.clamp(max=max(P - 1, 0)) // top_k]  # gathered inputs (padding rows unused)
    y = torch.empty(P, x.shape[-1], dtype=torch.float32, device=x.device)
    for e, n in enumerate(counts):  # each expert's weights read once
        if n:
            s = offsets[e]
            gu = F.linear(xs[s : s + n], gate_up[e])
            h = F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:]
            y[pairs[s : s + n]] = F.linear(h, down[e]).float()
    return y


def moe_combine(y: torch.Tensor, weights: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``out = rnd(Σ_k f32(y[:, k])·w[:, k])`` [T, H] in dtype: y [T, K, H] fp32; weights [T, K] fp32, or None
    when y already carries them. fp32 products, the sum over k in slot order 0..K-1, one rounding."""
    if weights is not None:
        y = y * weights[..., None]
    out = y[:, 0]
    for k in range(1, y.shape[1]):  # fixed slot order: deterministic
        out = out + y[:, k]
    return out.to(dtype)


def moe_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Grouped expert MLP with an fp32 combine. x [T, H] md; gate_up [E, 2I, H]; down [E, H, I];
    weights [T, K] fp32; ids [T, K] int64 → [T, H] md.

    ``y_k = (gelu_tanh(gate_k) ⊙ up_k)·DN[e_k]ᵀ`` in md, ``out = rnd(Σ_k f32(y_k)·w_k)`` with the sum over k
    in slot order 0..K-1 (the grouped_mm combine, not eager's index_add in md; docs/generation.md).
    Built from ``moe_align`` (block 1: no padding), ``moe_expert_outputs`` and ``moe_combine``.
    """
    T, K = ids.shape
    align = moe_align(ids, gate_up.shape[0], 1)
    y = moe_expert_outputs(x, gate_up, down, align, K)
    return moe_combine(y.view(T, K, -1), weights, x.dtype)


def nvfp4_repack(
    weight: torch.Tensor, weight_scale: torch.Tensor, interleave: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt NVFP4 tensors → the W4A16 kernel layout (words, scales); the formula is ``nvfp4_format.repack``."""
    return nvfp4_format.repack(weight, weight_scale, interleave)


def nvfp4_decode(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernels' bf16 MMA operands of repacked weights: ``bf16(nvfp4_format.decode_repacked(words, scales) ·
    2^-7)`` [E, 16·RT, 64·KC] (exact: E2M1 · E4M3 has at most 6 significant bits, within bf16's range)."""
    return (nvfp4_format.decode_repacked(words, scales) * 2.0**-7).to(torch.bfloat16)


def nvfp4_moe_experts(
    x: torch.Tensor, experts: PackedExperts, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Grouped W4A16 expert MLP on ``nvfp4_format.PackedExperts`` with the fp32 combine → [T, H] in x's dtype:
    ``moe_align`` (block 1) → ``nvfp4_format.expert_outputs`` (y already weighted) → ``moe_combine(y, None)``."""
    T, K = ids.shape
    align = moe_align(ids, experts.gs.shape[0], 1)
    y = nvfp4_format.expert_outputs(x, experts, weights.to(torch.float32), align.offsets, align.sorted_pairs)
    return moe_combine(y.view(T, K, -1), None, x.dtype)


# --------------------------------------------------------------------------------------------
# Seeded noise (docs/seeded-noise.md): Philox4x32-10 keyed by the request seed
# --------------------------------------------------------------------------------------------

_M0, _M1, _W0, _W1, _MASK = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85, 0xFFFFFFFF


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a·m for int64 tensors holding uint32 values, without int64 overflow."""
    al, ah, ml, mh = a & 0xFFFF, a >> 16, m & 0xFFFF, m >> 16
    ll, lh, hl, hh = al * ml, al * mh, ah * ml, ah * mh
    mid = lh + hl + (ll >> 16)
    return hh + (mid >> 16), ((mid & 0xFFFF) << 16) | (ll & 0xFFFF)


def philox4x32_10(c0, c1, c2, c3, k0, k1) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 on broadcastable int64 tensors holding uint32 counters and keys → 4 int64 words."""
    c = [torch.as_tensor(v, dtype=torch.int64) for v in (c0, c1, c2, c3)]
    k0 = torch.as_tensor(k0, dtype=torch.int64)
    k1 = torch.as_tensor(k1, dtype=torch.int64)
    c0, c1, c2, c3 = c
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def seed_key(seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """64-bit seeds (int64 tensor; values may be negative two's-complement) → Philox key words."""
    seeds = torch.as_tensor(seeds, dtype=torch.int64)
    return seeds & _MASK, (seeds >> 32) & _MASK


def canvas_noise(
    seeds: torch.Tensor, blocks: torch.Tensor, steps: torch.Tensor, canvas_length: int, vocab_size: int
) -> torch.Tensor:
    """Uniform canvas tokens: counter (p, 0, b, 2s), token = out[0] mod V (docs/seeded-noise.md).

    seeds, blocks, steps: [B] int64 (per row) → tokens [B, C] int64. ``steps = 0`` is a block's initial
    canvas; ``steps = k`` the renoise of the denoising step with remaining-steps counter k. Bit-exact everywhere.
    """
    k0, k1 = seed_key(seeds)
    p = torch.arange(canvas_length, dtype=torch.int64, device=k0.device)[None, :]
    out = philox4x32_10(p, 0, blocks[:, None], 2 * steps[:, None], k0[:, None], k1[:, None])[0]
    return out % vocab_size


def gumbel_noise(
    seeds: torch.Tensor, blocks: torch.Tensor, steps: torch.Tensor, canvas_length: int, vocab_size: int
) -> torch.Tensor:
    """Gumbel noise g [B, C, V] fp32 (docs/seeded-noise.md): counter (v // 4, p, b, 2k+1), r = out[v % 4],
    u = ((r >> 9) + 0.5)·2^-23, g = -log(-log(u)) with torch's fp32 log (≤ 2 ulp from the native op's dg_logf)."""
    B = seeds.shape[0]
    k0, k1 = seed_key(seeds)
    dev = k0.device
    n4 = (vocab_size + 3) // 4
    q = torch.arange(n4, dtype=torch.int64, device=dev)[None, None, :]
    p = torch.arange(canvas_length, dtype=torch.int64, device=dev)[None, :, None]
    b = blocks.view(B, 1, 1)
    s = (2 * steps + 1).view(B, 1, 1)
    words = philox4x32_10(q, p, b, s, k0.view(B, 1, 1), k1.view(B, 1, 1))
    r = torch.stack(words, -1).reshape(B, canvas_length, 4 * n4)[..., :vocab_size]
    u = ((r >> 9).to(torch.float32) + 0.5) * (2.0**-23)
    return -torch.log(-torch.log(u))


# --------------------------------------------------------------------------------------------
# The diffusion step (sampler core, docs/generation.md)
# --------------------------------------------------------------------------------------------


class DiffusionStepOut(NamedTuple):
    """Outputs of one denoising step for B canvas rows of C positions over V."""

    canvas: torch.Tensor  # [B, C] int64: sampled where accepted, contract noise elsewhere
    argmax: torch.Tensor  # [B, C] int64: argmax of the processed logits (lowest index on ties)
    entropy: torch.Tensor  # [B, C] fp32: entropy of softmax(processed)
    accepted: torch.Tensor  # [B, C] bool
    mean_entropy: torch.Tensor  # [B] fp32: mean over C positions (adaptive stopping)
    processed: torch.Tensor  # [B, C, V] fp32: logits / temperature (the next step's self-conditioning)


def step_temperature(t_min: torch.Tensor, t_max: torch.Tensor, k: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """T = f32(t_min) + f32(t_max - t_min) · (f32(k) / f32(N)), all fp32 (docs/generation.md).

    t_min, t_max: [B] float64 (the request's Python floats); k, n: [B] int64 → [B] fp32.
    ``t_max - t_min`` is formed in double and rounded to fp32, as torch does with Python scalars.
    """
    span = (t_max.double() - t_min.double()).float()
    return t_min.float() + span * (k.float() / n.float())


def entropy_bound_accept(entropy: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Entropy-bound acceptance (docs/generation.md): entropy [B, C] fp32, bound [B] → accepted [B, C] bool.

    Stable ascending sort; running sum in fp64, each prefix rounded to fp32; keep where
    ``f32(cum - H) <= f32(bound)`` element by element (not necessarily a prefix).
    """
    s_ent, order = torch.sort(entropy, dim=-1, stable=True)
    cum = torch.cumsum(s_ent.double(), dim=-1).float()
    keep = (cum - s_ent) <= bound.float()[:, None]
    return torch.zeros_like(keep).scatter(-1, order, keep)


def entropy(processed: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(processed) over the last dim, fp32, as torch.distributions.Categorical computes it."""
    lp = processed - processed.logsumexp(-1, keepdim=True)
    p = torch.softmax(lp, dim=-1)  # Categorical: probs = softmax(normalised logits), not exp(...)
    lp = lp.clamp(min=torch.finfo(lp.dtype).min)
    return -(lp * p).sum(-1)


def bitmask_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token bitmask [..., ceil(V/32)] int32 (bit v % 32 of word v // 32 set = allowed) → allowed [..., V] bool.

    A position with no allowed token in [0, V) (fully masked) comes back all True: unmasked (``diffusion_step``).
    """
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(-2)[..., :vocab_size]
    return allowed | ~allowed.any(-1, keepdim=True)


def diffusion_step(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    blocks: torch.Tensor,
    steps: torch.Tensor,
    entropy_bound: torch.Tensor,
    bitmask: torch.Tensor | None = None,
) -> DiffusionStepOut:
    """One denoising step for B rows. logits [B, C, V] (fp32 or md, softcapped); temperature [B] fp32;
    seeds, blocks, steps (remaining-steps counter k ≥ 1): [B] int64; entropy_bound [B]; bitmask None or
    [B, C, ceil(V/32)] int32 (bit set = allowed; a fully masked position is left unmasked).

    processed = f32(logits) / T (true division), then -inf where the bitmask disallows the token, so a disallowed
    token has probability 0 in everything below; sample = argmax(processed + gumbel_noise); argmax of processed;
    entropy of the masked distribution; acceptance (``entropy_bound_accept``); canvas = where(accepted, sample,
    canvas_noise(k)).
    """
    B, C, V = logits.shape
    processed = logits.float() / temperature.float().view(B, 1, 1)
    if bitmask is not None:
        processed = processed.masked_fill(~bitmask_allowed(bitmask, V), float("-inf"))
    sample = torch.argmax(processed + gumbel_noise(seeds, blocks, steps, C, V), dim=-1)
    top = torch.argmax(processed, dim=-1)
    ent = entropy(processed)
    accepted = entropy_bound_accept(ent, entropy_bound)
    canvas = torch.where(accepted, sample, canvas_noise(seeds, blocks, steps, C, V))
    return DiffusionStepOut(canvas, top, ent, accepted, ent.mean(-1), processed)
