"""The Gemma 4 vision tower and ``embed_vision``: image patches → soft tokens in the text model's space
(docs/images.md, "The vision path").

Public contract:
    vc = VisionConfig.from_dict(config_json)          # None when the checkpoint declares no vision tower
    tower = VisionTower.load(path, vc, hidden_size, dtype, device)
    feats [s, H] = tower.encode(patches [n, 3·p²] fp32 in [0, 1], positions [n, 2] int64 (x, y))
    [feats, ...] = tower.encode_tile([(patches, positions), ...])    # several images in one padded pass
    tile_workspace_bytes(vc, images, dtype)                          # the peak working memory of such a pass

``VisionConfig`` and its preprocessing settings live in ``dgserve.model.vision_config`` (importable from here too).

``encode`` runs one image unpadded, attending with torch's SDPA and no mask; ``encode_tile`` pads a tile of
images to its largest and masks the padding out of attention and pooling as transformers does (it pads to
``max_patches`` with positions (-1, -1)), attending with SDPA and a key-padding mask: the same values up to
accumulation order (docs/exactness.md). Rounding
follows transformers' ``Gemma4VisionModel``: every op in the model dtype ``md``, RMSNorm in fp32 rounded once,
softmax in fp32, the pooled average and its √hidden scale in fp32, then ``md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dgserve import ops
from dgserve.model.vision_config import VisionConfig as VisionConfig
from dgserve.model.vision_config import VisionConfigError as VisionConfigError

from .layers import apply_rope

TOWER = "model.encoder.vision_tower."
EMBED = "model.encoder.embed_vision."


def tile_workspace_bytes(config: VisionConfig, images: int, dtype: torch.dtype) -> int:
    """The peak working memory of one tower pass over ``images`` images of the most patches the config allows
    (P = max_soft_tokens · pooling²), in bytes: what the KV cache budget sets aside (docs/images.md, "Memory").

    Per image, at one layer's peak, assuming the worst attention kernel: SDPA (the padded tile) may fall back to its
    math kernel on any device (a mask, a head size or a dtype the fused kernels refuse), which holds the scores
    [heads, P, P] in fp32, their fp32 softmax, the all-masked-row check's bool mask and its where() result at once
    (13 bytes a score; measured 9.2-9.5 on the CPU), plus fp32 copies of q, k, v and the output (4 rows of width
    hv); this also covers the unpadded pass (one image), the same SDPA without a mask. The fused kernels hold no
    [P, P] at all. Then the activations the layer holds at once, ~8 rows of width hv
    (residual, normed input, q, k, v, rotated q/k, the attention output) and 3 of the MLP's width (gate, up, their
    product), in md; the fp32 patches [P, 3·p²] and the pooling's fp32 one-hot weights [P, P / pooling²] and
    pooled output."""
    md = torch.finfo(dtype).bits // 8
    k = config.pooling_kernel_size
    P = config.max_soft_tokens * k * k
    scores = config.num_attention_heads * P * P * (4 + 4 + 1 + 4)
    rows = P * (8 * config.hidden_size + 3 * config.intermediate_size) * md + P * 4 * config.hidden_size * 4
    edges = (
        P * 3 * config.patch_size**2 * 4
        + P * config.max_soft_tokens * 4
        + config.max_soft_tokens * config.hidden_size * 4
    )
    return images * (scores + rows + edges)


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

    def _layer(self, x: torch.Tensor, lw: VisionLayer, cos, sin, keys: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, hv]: one image's patches, or a padded tile's (``keys`` [n, P]: its real patches)."""
        c, eps, n = self.config, self.config.rms_norm_eps, x.shape[0]
        h = ops.rms_norm(x, lw.input_layernorm, eps)
        q = self._rope2d(ops.rms_norm(lw.q(h).view(n, -1, c.head_dim), lw.q_norm, eps), cos, sin)
        k = self._rope2d(ops.rms_norm(lw.k(h).view(n, -1, c.head_dim), lw.k_norm, eps), cos, sin)
        v = ops.rms_norm(lw.v(h).view(n, -1, c.head_dim), None, eps)
        if keys is None:  # one image: bidirectional over all its patches, [n, heads, hd] → [heads, n, hd]
            attn = self._attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        else:  # [n·P, heads, hd] → [n, heads, P, hd] per image
            b, P = keys.shape
            split = lambda t: t.view(b, P, -1, c.head_dim).transpose(1, 2)  # noqa: E731
            attn = self._attend_masked(split(q), split(k), split(v), keys)
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

    def check_grid(self, positions: torch.Tensor) -> None:
        """ValueError when a patch position lies outside the position table (``position_embedding_size``): the
        preprocessing refuses such an image first (``media.images.preprocess``); this guards direct callers."""
        size = self.config.position_embedding_size
        if positions.numel() and int(positions.max()) >= size:
            raise ValueError(
                f"image: a patch grid of {int(positions.max()) + 1} exceeds the vision tower's position table"
                f" ({size} positions)"
            )

    @torch.inference_mode()
    def encode(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One image: patches [n, 3·p²] fp32 in [0, 1] (``media.images.preprocess``), positions [n, 2] (x, y)
        → soft tokens [n / k², H] in md, ready to replace the image's placeholder embeddings."""
        self.check_grid(positions)
        patches = patches.to(self.device)
        positions = positions.to(self.device)
        x = F.linear((2 * (patches - 0.5)).to(self.dtype), self.input_proj)
        x = x + (F.embedding(positions[:, 0], self.pos_table[0]) + F.embedding(positions[:, 1], self.pos_table[1]))
        cos, sin = self._rope(positions)
        for lw in self.layers:
            x = self._layer(x, lw, cos, sin)
        return self._embed(self._pool(x, positions))

    def _embed(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled [s, hv] fp32 → soft tokens [s, H] md: optional standardisation in fp32, then ``embed_vision``."""
        if self.std is not None:
            pooled = (pooled - self.std[0]) * self.std[1]
        soft = pooled.to(self.dtype)
        return F.linear(ops.rms_norm(soft, None, self.config.rms_norm_eps), self.projection)

    # ------------------------------------------------------------------ a padded tile of images

    @torch.inference_mode()
    def encode_tile(self, images: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Several images in one pass, padded to the most patches P of any: per image (patches [n, 3·p²],
        positions [n, 2]) → soft tokens [n / k², H] md, as ``encode`` gives them up to accumulation order.

        As transformers' ``Gemma4VisionModel``: padding patches have position (-1, -1), a zero position
        embedding, are masked out of every layer's attention keys and are zeroed before the pooling (whose one-hot
        weights they then join at block 0 with nothing to add)."""
        for _, pos in images:
            self.check_grid(pos)
        n, P = len(images), max(p.shape[0] for p, _ in images)
        pv = torch.zeros(n, P, images[0][0].shape[1])
        pos = torch.full((n, P, 2), -1, dtype=torch.int64)
        for b, (p, q) in enumerate(images):
            pv[b, : p.shape[0]], pos[b, : q.shape[0]] = p, q
        pv, pos = pv.to(self.device), pos.to(self.device)
        pad = (pos == -1).all(dim=-1)  # [n, P]
        x = F.linear((2 * (pv - 0.5)).to(self.dtype), self.input_proj)  # [n, P, hv]
        at = pos.clamp(min=0)
        pe = F.embedding(at[..., 0], self.pos_table[0]) + F.embedding(at[..., 1], self.pos_table[1])
        x = (x + torch.where(pad[..., None], 0.0, pe)).view(n * P, -1)
        cos, sin = self._rope(pos.view(n * P, 2))
        for lw in self.layers:
            x = self._layer(x, lw, cos, sin, keys=~pad)
        pooled = self._pool_padded(x.view(n, P, -1).masked_fill(pad[..., None], 0.0), at)  # [n, P / k², hv]
        soft = self._embed(torch.cat([pooled[b, : p.shape[0] // self.pool_area] for b, (p, _) in enumerate(images)]))
        return list(soft.split([p.shape[0] // self.pool_area for p, _ in images]))

    @property
    def pool_area(self) -> int:
        return self.config.pooling_kernel_size**2

    def _pool_padded(self, x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """x [n, P, hv] md (padding zeroed), at [n, P, 2] positions with padding clamped to 0 → [n, P / k², hv]
        fp32 · √hv: transformers' ``_avg_pool_by_positions``, each image's blocks row-major over its own width."""
        k, length = self.config.pooling_kernel_size, x.shape[1] // self.pool_area
        if k > 1:
            max_x = at[..., 0].max(dim=-1, keepdim=True)[0] + 1  # [n, 1]
            kidx = torch.div(at, k, rounding_mode="floor")
            kidx = kidx[..., 0] + (max_x // k) * kidx[..., 1]
            weights = F.one_hot(kidx.long(), length).float() / (k * k)  # [n, P, length]
            x = (weights.transpose(1, 2) @ x.float()).to(x.dtype)
        return x.float() * self.config.hidden_size**0.5

    @staticmethod
    def _attend(q, k, v) -> torch.Tensor:
        """Bidirectional attention with scale 1 over one image's patches: q [nh, n, hd], k/v [nkv, n, hd] →
        [n, nh·hd] md.

        torch's SDPA without a mask (every patch sees every patch), as transformers' SDPA pass runs it: the
        softmax in fp32 inside the kernel and the output rounded to md once; a fused kernel never builds the
        [nh, n, n] scores. Equal to the eager ``attend`` of the text model up to rounding (within 1e-4 in fp32:
        tests/test_vision_parity.py, tests/test_image_batch.py)."""
        nh, n, hd = q.shape
        # a batch of one: torch's fused kernels take only 4-D inputs (3-D ones fall back to the math kernel)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=1.0, enable_gqa=k.shape[0] != nh)
        return out[0].transpose(0, 1).reshape(n, nh * hd)  # [nh, n, hd] → [n, nh·hd]

    @staticmethod
    def _attend_masked(q, k, v, keys: torch.Tensor) -> torch.Tensor:
        """Bidirectional attention with scale 1 per image of a padded tile: q [n, nh, P, hd], k/v [n, nkv, P, hd],
        keys [n, P] bool (True: a real patch) → [n·P, nh·hd] md.

        torch's SDPA with a boolean key-padding mask (broadcast [n, 1, 1, P], never materialised per head), as
        transformers' SDPA pass runs it: the softmax in fp32 inside the kernel and the output rounded to md once, so
        it equals ``_attend`` (each image alone, unpadded) up to rounding: within 1e-4 in fp32
        (tests/test_image_batch.py). Every query row sees its image's real patches, so no row is all masked."""
        n, nh, P, hd = q.shape
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keys[:, None, None, :], scale=1.0, enable_gqa=k.shape[1] != nh
        )  # [n, nh, P, hd]
        return out.permute(0, 2, 1, 3).reshape(n * P, nh * hd)
