"""The Gemma 4 vision tower and ``embed_vision``: image patches → soft tokens in the text model's space
(docs/images.md, "The vision path").

Public contract:
    vc = VisionConfig.from_dict(config_json)          # None when the checkpoint declares no vision tower
    tower = VisionTower.load(path, vc, hidden_size, dtype, device)
    feats [s, H] = tower.encode(patches [n, 3·p²] fp32 in [0, 1], positions [n, 2] int64 (x, y))

One image at a time and unpadded: transformers pads every image to ``max_patches`` and masks the padding out of
attention and pooling, which gives the same values up to GEMM accumulation order (docs/exactness.md). Rounding
follows transformers' ``Gemma4VisionModel``: every op in the model dtype ``md``, RMSNorm in fp32 rounded once,
softmax in fp32, the pooled average and its √hidden scale in fp32, then ``md``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dgserve import ops

from .layers import apply_rope, attend

TOWER = "model.encoder.vision_tower."
EMBED = "model.encoder.embed_vision."
# transformers' Gemma 4 processor default (``image_seq_length``), used when config.json does not say
DEFAULT_SOFT_TOKENS = 280
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)


class VisionConfigError(ValueError):
    """A vision_config dgserve cannot use; the message names the field."""


@dataclass(frozen=True)
class VisionConfig:
    """``vision_config`` (model_type gemma4_vision) plus the top-level image token ids of config.json."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    pooling_kernel_size: int
    patch_size: int
    position_embedding_size: int
    use_clipped_linears: bool
    standardize: bool
    output_proj_dims: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    max_soft_tokens: int = DEFAULT_SOFT_TOKENS

    @classmethod
    def from_dict(cls, top: dict[str, Any]) -> VisionConfig | None:
        """From a top-level config.json dict; None when it has no ``vision_config``."""
        v = top.get("vision_config")
        if not isinstance(v, dict):
            return None
        act = v.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise VisionConfigError(f"vision_config.hidden_activation: {act!r} is not supported")
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise VisionConfigError(f"vision_config.rope_parameters.rope_type: {rope.get('rope_type')!r}")
        if v.get("attention_bias"):
            raise VisionConfigError("vision_config.attention_bias: true is not supported")
        hidden = int(v.get("hidden_size", 768))
        heads = int(v.get("num_attention_heads", 12))
        soft = int(top.get("vision_soft_tokens_per_image") or DEFAULT_SOFT_TOKENS)
        if soft not in SUPPORTED_SOFT_TOKENS:
            raise VisionConfigError(f"vision_soft_tokens_per_image: {soft} is not one of {SUPPORTED_SOFT_TOKENS}")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(v.get("intermediate_size", 3072)),
            num_hidden_layers=int(v.get("num_hidden_layers", 16)),
            num_attention_heads=heads,
            num_key_value_heads=int(v.get("num_key_value_heads", 12)),
            head_dim=int(v.get("head_dim") or hidden // heads),
            rms_norm_eps=float(v.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 100.0)),
            pooling_kernel_size=int(v.get("pooling_kernel_size", 3)),
            patch_size=int(v.get("patch_size", 16)),
            position_embedding_size=int(v.get("position_embedding_size", 10240)),
            use_clipped_linears=bool(v.get("use_clipped_linears", False)),
            standardize=bool(v.get("standardize", False)),
            output_proj_dims=int(v.get("output_proj_dims") or hidden),
            image_token_id=int(top.get("image_token_id", 258880)),
            boi_token_id=int(top.get("boi_token_id", 255999)),
            eoi_token_id=int(top.get("eoi_token_id", 258882)),
            max_soft_tokens=soft,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> VisionConfig | None:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))


@dataclass
class Linear:
    """A bias-free linear layer, with transformers' optional input/output clamps (``use_clipped_linears``)."""

    weight: torch.Tensor  # [out, in]
    clamp_in: tuple[torch.Tensor, torch.Tensor] | None = None
    clamp_out: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.clamp_in is not None:
            x = torch.clamp(x, *self.clamp_in)
        y = F.linear(x, self.weight)
        if self.clamp_out is not None:
            y = torch.clamp(y, *self.clamp_out)
        return y


@dataclass
class VisionLayer:
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    gate: Linear
    up: Linear
    down: Linear
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    pre_feedforward_layernorm: torch.Tensor
    post_feedforward_layernorm: torch.Tensor


def vision_tensor_names(names: list[str] | set[str]) -> list[str]:
    """The checkpoint tensors the tower and ``embed_vision`` own."""
    return [n for n in names if n.startswith((TOWER, EMBED))]


class VisionTower:
    """The tower (patch embedder, bidirectional encoder, 3×3 average pooler) and the multimodal embedder."""

    def __init__(self, config: VisionConfig, w: dict[str, torch.Tensor], text_hidden: int, dtype, device):
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.text_hidden = text_hidden
        get = lambda n: w[n].to(device=self.device, dtype=dtype)  # noqa: E731

        def lin(name: str) -> Linear:
            lw = Linear(get(name + ".linear.weight"))
            if config.use_clipped_linears:
                c = lambda s: w[f"{name}.{s}"].to(device=self.device, dtype=dtype)  # noqa: E731
                lw.clamp_in, lw.clamp_out = (c("input_min"), c("input_max")), (c("output_min"), c("output_max"))
            return lw

        self.input_proj = get(TOWER + "patch_embedder.input_proj.weight")  # [hv, 3·p²]
        self.pos_table = get(TOWER + "patch_embedder.position_embedding_table")  # [2, P, hv]
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"{TOWER}encoder.layers.{i}."
            self.layers.append(
                VisionLayer(
                    q=lin(p + "self_attn.q_proj"),
                    k=lin(p + "self_attn.k_proj"),
                    v=lin(p + "self_attn.v_proj"),
                    o=lin(p + "self_attn.o_proj"),
                    q_norm=get(p + "self_attn.q_norm.weight"),
                    k_norm=get(p + "self_attn.k_norm.weight"),
                    gate=lin(p + "mlp.gate_proj"),
                    up=lin(p + "mlp.up_proj"),
                    down=lin(p + "mlp.down_proj"),
                    input_layernorm=get(p + "input_layernorm.weight"),
                    post_attention_layernorm=get(p + "post_attention_layernorm.weight"),
                    pre_feedforward_layernorm=get(p + "pre_feedforward_layernorm.weight"),
                    post_feedforward_layernorm=get(p + "post_feedforward_layernorm.weight"),
                )
            )
        self.std = None
        if config.standardize:  # fp32 buffers, applied in fp32
            self.std = (w[TOWER + "std_bias"].float().to(self.device), w[TOWER + "std_scale"].float().to(self.device))
        self.projection = get(EMBED + "embedding_projection.weight")  # [H, output_proj_dims]
        spatial = config.head_dim // 2
        # built in fp32 on the CPU as transformers builds its buffer, then uploaded
        self.inv_freq = (1.0 / (config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))).to(
            self.device
        )

    @classmethod
    def load(cls, path, config: VisionConfig, text_hidden: int, dtype, device) -> VisionTower:
        """Read the tower's tensors from the checkpoint's safetensors files (NVFP4 checkpoints keep them in bf16:
        they are cast to ``dtype`` like any unquantized weight). Raises ValueError naming a missing tensor."""
        from safetensors import safe_open

        w: dict[str, torch.Tensor] = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(f), "pt") as sf:
                for name in vision_tensor_names(list(sf.keys())):
                    w[name] = sf.get_tensor(name)
        try:
            return cls(config, w, text_hidden, dtype, device)
        except KeyError as e:
            raise ValueError(f"checkpoint {path}: vision tensor {e.args[0]} is missing") from None

    def soft_tokens(self, height: int, width: int) -> int:
        """Soft tokens of a preprocessed image of height × width pixels (multiples of pooling·patch)."""
        k, p = self.config.pooling_kernel_size, self.config.patch_size
        return (height // p // k) * (width // p // k)

    # ------------------------------------------------------------------ forward

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n, 2] → (cos, sin) [n, hd] in md, laid out x-x-y-y (each half rotates one axis)."""
        freqs = positions[..., None].float() * self.inv_freq  # [n, 2, hd/4]
        cos, sin = freqs.cos(), freqs.sin()
        lay = lambda f: torch.cat([f[:, 0], f[:, 0], f[:, 1], f[:, 1]], dim=-1).to(self.dtype)  # noqa: E731
        return lay(cos), lay(sin)

    @staticmethod
    def _rope2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [n, heads, hd]: rotate-half RoPE on each half of the head dim with that half of cos/sin."""
        h = x.shape[-1] // 2
        return torch.cat(
            [apply_rope(x[..., :h], cos[:, :h], sin[:, :h]), apply_rope(x[..., h:], cos[:, h:], sin[:, h:])], -1
        )

    def _layer(self, x: torch.Tensor, lw: VisionLayer, cos, sin) -> torch.Tensor:
        c, eps, n = self.config, self.config.rms_norm_eps, x.shape[0]
        h = ops.rms_norm(x, lw.input_layernorm, eps)
        q = self._rope2d(ops.rms_norm(lw.q(h).view(n, -1, c.head_dim), lw.q_norm, eps), cos, sin)
        k = self._rope2d(ops.rms_norm(lw.k(h).view(n, -1, c.head_dim), lw.k_norm, eps), cos, sin)
        v = ops.rms_norm(lw.v(h).view(n, -1, c.head_dim), None, eps)
        attn = attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), None)  # bidirectional, scale 1
        x = x + ops.rms_norm(lw.o(attn), lw.post_attention_layernorm, eps)
        d = ops.rms_norm(x, lw.pre_feedforward_layernorm, eps)
        m = lw.down(F.gelu(lw.gate(d), approximate="tanh") * lw.up(d))
        return x + ops.rms_norm(m, lw.post_feedforward_layernorm, eps)

    def _pool(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [n, hv] md → [n / k², hv] fp32: the mean of each k×k patch block (row-major over blocks), · √hv."""
        k = self.config.pooling_kernel_size
        length = x.shape[0] // (k * k)
        if length != x.shape[0]:
            max_x = positions[:, 0].max() + 1
            kidx = torch.div(positions, k, rounding_mode="floor")
            kidx = kidx[:, 0] + (max_x // k) * kidx[:, 1]
            weights = F.one_hot(kidx.long(), length).float() / (k * k)  # [n, length]
            x = (weights.transpose(0, 1) @ x.float()).to(x.dtype)
        return x.float() * self.config.hidden_size**0.5

    @torch.inference_mode()
    def encode(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One image: patches [n, 3·p²] fp32 in [0, 1] (``media.images.preprocess``), positions [n, 2] (x, y)
        → soft tokens [n / k², H] in md, ready to replace the image's placeholder embeddings."""
        patches = patches.to(self.device)
        positions = positions.to(self.device)
        x = F.linear((2 * (patches - 0.5)).to(self.dtype), self.input_proj)
        x = x + (F.embedding(positions[:, 0], self.pos_table[0]) + F.embedding(positions[:, 1], self.pos_table[1]))
        cos, sin = self._rope(positions)
        for lw in self.layers:
            x = self._layer(x, lw, cos, sin)
        pooled = self._pool(x, positions)
        if self.std is not None:
            pooled = (pooled - self.std[0]) * self.std[1]
        soft = pooled.to(self.dtype)
        return F.linear(ops.rms_norm(soft, None, self.config.rms_norm_eps), self.projection)
