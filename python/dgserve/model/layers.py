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
    qkv_proj: torch.Tensor | None = None  # [nq + nk (+ nv), H]: q_proj, k_proj (, v_proj) stacked (fuse_projections)
    mlp_gate_up: torch.Tensor | None = None  # [2D, H]: mlp_gate, then mlp_up (fuse_projections)

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

    def fuse_projections(self) -> None:
        """Stack q/k/v and the dense MLP's gate/up into one weight each (``qkv_proj``, ``mlp_gate_up``) and make the
        separate weights row views of them (no second copy once the loaded tensors are dropped): one ``linear``
        instead of three, and of two, with the same bits per output column (each column is its own fixed sequence
        over k; docs/kernels.md, "linear: the batch-invariant GEMM"). For the CPU's GEMM only: on CUDA ``linear`` is
        cuBLAS, whose result may depend on N."""
        plain = lambda w: type(w) is torch.Tensor and w.dim() == 2  # noqa: E731  # not FP8 W8A8 weights (a subclass)
        attn = [self.q_proj, self.k_proj] + ([self.v_proj] if self.v_proj is not None else [])
        if all(plain(w) and w.dtype == attn[0].dtype and w.shape[1] == attn[0].shape[1] for w in attn):
            nq, nk = self.q_proj.shape[0], self.k_proj.shape[0]
            self.qkv_proj = torch.cat(attn)
            self.q_proj, self.k_proj = self.qkv_proj[:nq], self.qkv_proj[nq : nq + nk]
            if self.v_proj is not None:
                self.v_proj = self.qkv_proj[nq + nk :]
        gate, up = self.mlp_gate, self.mlp_up
        if plain(gate) and plain(up) and gate.shape == up.shape and gate.dtype == up.dtype:
            D = self.mlp_gate.shape[0]
            self.mlp_gate_up = torch.cat([self.mlp_gate, self.mlp_up])
            self.mlp_gate, self.mlp_up = self.mlp_gate_up[:D], self.mlp_gate_up[D:]


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
    return _keys_values(kr, vr, lw, eps, cos, sin)


def project_q(h: torch.Tensor, lw: LayerWeights, hd: int, eps: float, cos, sin) -> torch.Tensor:
    """Queries for h [T, H] → [nh, T, hd]: RoPE(q_norm(q_proj h))."""
    return _queries(ops.linear(h, lw.q_proj).view(h.shape[0], -1, hd), lw, eps, cos, sin)


def _queries(qr: torch.Tensor, lw: LayerWeights, eps: float, cos, sin) -> torch.Tensor:
    """The q projection qr [T, nh, hd] (any row and head strides) → queries [nh, T, hd]."""
    return ops.rms_norm_rope(qr, lw.q_norm, eps, cos, sin).transpose(0, 1)


def _keys_values(kr: torch.Tensor, vr: torch.Tensor, lw: LayerWeights, eps: float, cos, sin):
    """The k and v projections kr, vr [T, nkv, hd] (vr is kr on full layers) → (k, v) [nkv, T, hd]."""
    k = ops.rms_norm_rope(kr, lw.k_norm, eps, cos, sin)
    v = ops.rms_norm(vr, None, eps)
    return k.transpose(0, 1), v.transpose(0, 1)


def project_qkv(h: torch.Tensor, lw: LayerWeights, hd: int, eps: float, cos, sin):
    """``project_q`` and ``project_kv`` of h [T, H] → (q [nh, T, hd], k, v [nkv, T, hd]), their bits, with one
    ``linear`` over ``lw.qkv_proj`` when the layer has it (the outputs' column blocks read in place)."""
    if lw.qkv_proj is None:
        return (project_q(h, lw, hd, eps, cos, sin), *project_kv(h, lw, hd, eps, cos, sin))
    T, nq, nk = h.shape[0], lw.q_proj.shape[0], lw.k_proj.shape[0]
    y = ops.linear(h, lw.qkv_proj)  # [T, nq + nk (+ nv)]
    kr = y[:, nq : nq + nk].view(T, -1, hd)
    vr = y[:, nq + nk :].view(T, -1, hd) if lw.v_proj is not None else kr
    return (_queries(y[:, :nq].view(T, -1, hd), lw, eps, cos, sin), *_keys_values(kr, vr, lw, eps, cos, sin))


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
    return ops.rms_norm_add(x, ops.linear(attn, lw.o_proj), lw.post_attention_layernorm, eps)


# ------------------------------------------------------------------------------------------------
# Feed-forward: dense MLP + MoE branch (docs/generation.md, "Feed-forward (dense MLP and MoE)")
# ------------------------------------------------------------------------------------------------


def dense_mlp(d: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
    """The dense MLP of d [T, H] md: ``ops.gated_mlp``, its bits, with gate and up in one ``linear`` over
    ``lw.mlp_gate_up`` when the layer has it (the halves of its output read in place)."""
    if lw.mlp_gate_up is None:
        return ops.gated_mlp(d, lw.mlp_gate, lw.mlp_up, lw.mlp_down)
    D = lw.mlp_gate.shape[0]
    gu = ops.linear(d, lw.mlp_gate_up)  # [T, 2D]
    return ops.linear(ops.gelu_tanh_mul(gu[..., :D], gu[..., D:]), lw.mlp_down)


def feed_forward(r: torch.Tensor, lw: LayerWeights, config: ModelConfig, scalar: torch.Tensor) -> torch.Tensor:
    """r [T, H] md (residual after attention) → rnd(x · layer_scalar) [T, H]."""
    eps = config.rms_norm_eps
    d = ops.rms_norm(r, lw.pre_feedforward_layernorm, eps)
    h1 = ops.rms_norm(dense_mlp(d, lw), lw.post_feedforward_layernorm_1, eps)
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
    h = ops.rms_norm_add(h1, moe, lw.post_feedforward_layernorm_2, eps)  # h1 + h2 (IEEE addition commutes)
    return ops.rms_norm_add(r, h, lw.post_feedforward_layernorm, eps, scalar)  # rnd(r + norm(h)) · scalar
