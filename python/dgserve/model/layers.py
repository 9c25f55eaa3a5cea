"""One DiffusionGemma layer, written as functions over a single row of tokens (docs/generation.md, "The model").

A row is one request: x [T, H] in the model dtype ``md``. Working per row keeps every GEMM's
shape independent of the batch, which is what makes results batch-invariant on CPU (docs/exactness.md,
"Batch invariance"). The rounding points are those of docs/generation.md; the comments name them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgserve import ops
from dgserve.config import ModelConfig
from dgserve.model import fp8_w8a8, nvfp4


@dataclass
class LayerWeights:
    """Weights of layer i, canonical names of ``dgserve.model.checkpoint_layout`` without the ``layers.{i}.`` prefix."""

    input_layernorm: torch.Tensor
    q_proj: torch.Tensor  # [nh·hd, H]
    k_proj: torch.Tensor  # [nkv·hd, H]
    v_proj: torch.Tensor | None  # [nkv·hd, H] on sliding layers; None on full layers (K = V)
    o_proj: torch.Tensor  # [H, nh·hd]
    q_norm: torch.Tensor  # [hd]
    k_norm: torch.Tensor  # [hd]
    post_attention_layernorm: torch.Tensor
    pre_feedforward_layernorm: torch.Tensor
    mlp_gate: torch.Tensor  # [D, H]
    mlp_up: torch.Tensor  # [D, H]
    mlp_down: torch.Tensor  # [H, D]
    post_feedforward_layernorm_1: torch.Tensor
    router_proj: torch.Tensor  # [E, H]
    router_scale: torch.Tensor  # [H]
    per_expert_scale: torch.Tensor  # [E]
    pre_feedforward_layernorm_2: torch.Tensor
    experts_gate_up: torch.Tensor | None  # [E, 2I, H]; rows 0..I-1 gate, I..2I-1 up (None when packed)
    experts_down: torch.Tensor | None  # [E, H, I]
    post_feedforward_layernorm_2: torch.Tensor
    post_feedforward_layernorm: torch.Tensor
    layer_scalar: torch.Tensor  # [1] decoder pass
    encoder_layer_scalar: torch.Tensor  # [1] encoder pass (a separate, untied buffer: docs/generation.md)
    experts_packed: nvfp4.PackedExperts | None = None  # NVFP4 experts in the W4A16 layout (checkpoint.PACKED)
    experts_fp8: fp8_w8a8.Fp8Experts | None = None  # FP8 experts kept as E4M3 for W8A8 (checkpoint_fp8.FP8_EXPERTS)

    @classmethod
    def from_state(cls, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"layers.{i}."
        g = lambda name: w[p + name]  # noqa: E731
        return cls(
            input_layernorm=g("input_layernorm.weight"),
            q_proj=g("self_attn.q_proj.weight"),
            k_proj=g("self_attn.k_proj.weight"),
            v_proj=w.get(p + "self_attn.v_proj.weight"),
            o_proj=g("self_attn.o_proj.weight"),
            q_norm=g("self_attn.q_norm.weight"),
            k_norm=g("self_attn.k_norm.weight"),
            post_attention_layernorm=g("post_attention_layernorm.weight"),
            pre_feedforward_layernorm=g("pre_feedforward_layernorm.weight"),
            mlp_gate=g("mlp.gate_proj.weight"),
            mlp_up=g("mlp.up_proj.weight"),
            mlp_down=g("mlp.down_proj.weight"),
            post_feedforward_layernorm_1=g("post_feedforward_layernorm_1.weight"),
            router_proj=g("router.proj.weight"),
            router_scale=g("router.scale"),
            per_expert_scale=g("router.per_expert_scale"),
            pre_feedforward_layernorm_2=g("pre_feedforward_layernorm_2.weight"),
            experts_gate_up=w.get(p + "experts.gate_up_proj"),
            experts_down=w.get(p + "experts.down_proj"),
            post_feedforward_layernorm_2=g("post_feedforward_layernorm_2.weight"),
            post_feedforward_layernorm=g("post_feedforward_layernorm.weight"),
            layer_scalar=g("layer_scalar"),
            encoder_layer_scalar=g("encoder_layer_scalar"),
            experts_packed=w.get(p + "experts.packed"),  # type: ignore[arg-type]  # a PackedExperts (checkpoint.PACKED)
            experts_fp8=w.get(p + "experts.fp8"),  # type: ignore[arg-type]  # an Fp8Experts (W8A8)
        )


# ------------------------------------------------------------------------------------------------
# RoPE (docs/generation.md, "RoPE")
# ------------------------------------------------------------------------------------------------


def rope_inv_freq(config: ModelConfig, layer: int) -> torch.Tensor:
    """inv_freq [hd/2] fp32, computed on the CPU exactly as transformers builds its buffer.

    sliding ("default"): 1 / θ^(2j / hd). full ("proportional"): 1 / θ^(2j / hd) for j < n_rot =
    floor(prf·hd/2), zero beyond (those dimensions pass through); the denominator is the full head dim. Full
    layers' frequencies are then divided by the RoPE ``factor`` (1 unless a checkpoint or --hf-overrides scales
    them; 'linear' is 'proportional' with prf 1).
    """
    hd = config.head_dim(layer)
    if config.is_sliding(layer):
        return 1.0 / (config.rope_theta_sliding ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    n_rot = int(config.partial_rotary_factor_full * hd // 2)
    rotated = 1.0 / (config.rope_theta_full ** (torch.arange(0, 2 * n_rot, 2, dtype=torch.int64).float() / hd))
    inv_freq = torch.cat([rotated, torch.zeros(hd // 2 - n_rot, dtype=torch.float32)])
    if config.rope_factor_full != 1.0:  # 'proportional' / 'linear' scaling: transformers' `inv_freq /= factor`
        inv_freq /= config.rope_factor_full
    return inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions [T] int64 → (cos, sin) [T, hd] in md: angles in fp32, each rounded once."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]; rotate-half RoPE with md rounding after each product and the sum (``ops.rope``)."""
    return ops.rope(x, cos, sin)


# ------------------------------------------------------------------------------------------------
# Attention (docs/generation.md, "Attention")
# ------------------------------------------------------------------------------------------------


def project_kv(h: torch.Tensor, lw: LayerWeights, hd: int, eps: float, cos, sin):
    """Keys and values for h [T, H] → (k, v) [nkv, T, hd] in md.

    k = RoPE(k_norm(k_proj h)); v = RMSNorm_noscale(v_proj h), or of the raw k_proj output on full
    layers (K = V). Keys are normed before RoPE; values are never rotated.
    """
    T = h.shape[0]
    kr = ops.linear(h, lw.k_proj).view(T, -1, hd)
    vr = ops.linear(h, lw.v_proj).view(T, -1, hd) if lw.v_proj is not None else kr
    k = apply_rope(ops.rms_norm(kr, lw.k_norm, eps), cos, sin)
    v = ops.rms_norm(vr, None, eps)
    return k.transpose(0, 1), v.transpose(0, 1)


def project_q(h: torch.Tensor, lw: LayerWeights, hd: int, eps: float, cos, sin) -> torch.Tensor:
    """Queries for h [T, H] → [nh, T, hd]: RoPE(q_norm(q_proj h))."""
    q = ops.linear(h, lw.q_proj).view(h.shape[0], -1, hd)
    return apply_rope(ops.rms_norm(q, lw.q_norm, eps), cos, sin).transpose(0, 1)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Eager GQA attention with scale 1.0. q [nh, T, hd]; keys/values [nkv, S, hd]; mask [T, S] bool
    (True = visible) or None → [T, nh·hd] md. Scores in md, softmax in fp32 then rounded to md."""
    nh, T, hd = q.shape
    group = nh // keys.shape[0]
    qg = q.reshape(keys.shape[0], group * T, hd)  # query head h uses KV head h // group
    scores = torch.matmul(qg, keys.transpose(1, 2)).view(nh, T, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(p.reshape(keys.shape[0], group * T, -1), values).view(nh, T, hd)
    return out.transpose(0, 1).reshape(T, nh * hd)


def encoder_mask(pos: torch.Tensor, p0: int, k0: int, window: int | None, groups: torch.Tensor | None) -> torch.Tensor:
    """visible [T, keys] for the encoder's queries at ``pos`` (p0 ..) over keys at positions k0 ..: causal (within
    ``window`` on sliding layers, None on full ones), and bidirectional within each image's run of placeholders
    (``groups`` [T]: image k's run → k, text → -1)."""
    kpos = torch.arange(k0, p0 + pos.shape[0], device=pos.device)
    visible = kpos[None, :] <= pos[:, None]
    if window is not None:
        visible &= kpos[None, :] > pos[:, None] - window
    if groups is not None:  # keys before this pass are never in a group of it
        kg = torch.cat([groups.new_full((p0 - k0,), -1), groups])
        visible |= (groups[:, None] == kg[None, :]) & (groups[:, None] >= 0)
    return visible


def attend_encoder(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The encoder's attention: as ``attend`` (mask [T, S] bool, True = visible), through PyTorch's fused
    ``scaled_dot_product_attention`` in fp32 — transformers' default path, which fp32 logits are compared against
    (docs/exactness.md, "Why the forward pass has a tolerance"). Other dtypes keep ``attend``'s eager path, whose
    md rounding of the probabilities is what bf16 is compared against. The decoder uses ``ops.decode_attention``."""
    if q.dtype != torch.float32:
        return attend(q, keys, values, visible)
    nh, T, hd = q.shape
    group = nh // keys.shape[0]  # query head h uses KV head h // group, as in ``attend``
    if group > 1:  # repeated as transformers' ``repeat_kv`` does: 4-D inputs take PyTorch's fused CPU kernel
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    out = torch.nn.functional.scaled_dot_product_attention(q[None], keys[None], values[None], visible, scale=1.0)[0]
    return out.transpose(0, 1).reshape(T, nh * hd)


def attention_output(x: torch.Tensor, attn: torch.Tensor, lw: LayerWeights, eps: float) -> torch.Tensor:
    """Residual update after attention: x + RMSNorm(attn·Woᵀ; post_attention_layernorm)."""
    return x + ops.rms_norm(ops.linear(attn, lw.o_proj), lw.post_attention_layernorm, eps)


# ------------------------------------------------------------------------------------------------
# Feed-forward: dense MLP + MoE branch (docs/generation.md, "Feed-forward (dense MLP and MoE)")
# ------------------------------------------------------------------------------------------------


def feed_forward(r: torch.Tensor, lw: LayerWeights, config: ModelConfig, scalar: torch.Tensor) -> torch.Tensor:
    """r [T, H] md (residual after attention) → rnd(x · layer_scalar) [T, H]."""
    eps = config.rms_norm_eps
    d = ops.rms_norm(r, lw.pre_feedforward_layernorm, eps)
    h1 = ops.rms_norm(ops.gated_mlp(d, lw.mlp_gate, lw.mlp_up, lw.mlp_down), lw.post_feedforward_layernorm_1, eps)
    # the router reads the RAW residual; the experts read a separately normed copy
    weights, ids = ops.moe_route(r, lw.router_scale, lw.router_proj, lw.per_expert_scale, config.top_k_experts, eps)
    xe = ops.rms_norm(r, lw.pre_feedforward_layernorm_2, eps)
    if lw.experts_packed is not None:  # NVFP4 served as NVFP4: the W4A16 grouped GEMMs
        moe = ops.nvfp4_moe_experts(xe, lw.experts_packed, weights, ids)
    elif lw.experts_fp8 is not None:  # FP8 served as FP8: W8A8 expert GEMMs (docs/kernels.md, "FP8 checkpoints")
        moe = fp8_w8a8.moe_experts(xe, lw.experts_fp8, weights, ids)
    else:
        assert lw.experts_gate_up is not None and lw.experts_down is not None, "a layer without expert weights"
        moe = ops.moe_experts(xe, lw.experts_gate_up, lw.experts_down, weights, ids)
    h2 = ops.rms_norm(moe, lw.post_feedforward_layernorm_2, eps)
    x = r + ops.rms_norm(h1 + h2, lw.post_feedforward_layernorm, eps)
    return x * scalar
