"""DiffusionGemma: the causal encoder pass (writes the KV cache) and the bidirectional decoder pass
(reads cache + canvas, with self-conditioning), sharing one set of weights (docs/generation.md).

Public contract:
    model = DiffusionGemma.from_pretrained(path, device="cpu", dtype=torch.float32)
    cache = model.prefill(input_ids[B, T], cache=None)        # appends to `cache` when given
    cache = model.prefill(input_ids, pixel_values=pv, image_position_ids=pos)   # images, as transformers takes them
    logits[B, C, V] = model.denoise(cache, canvas_ids[B, C], self_cond_logits=None, self_cond_probs=None)

The cache is a ``SlotCache`` (model/cache.py) with one slot per row, the layout the serving ModelRunner uses;
``SlotCache.stack`` batches rows of different caches (and lengths) for one ``denoise``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dgserve import ops
from dgserve.config import ModelConfig
from dgserve.model.checkpoint import load_weights
from dgserve.ops.softcap import softcap_native_ok
from dgserve.ops.softmax_rows import softmax_rows_native_ok

from .batched import decode_slots
from .cache import SlotCache, SlotView
from .layers import (
    LayerWeights,
    attend_encoder,
    attention_output,
    encoder_mask,
    feed_forward,
    project_kv,
    project_q,
    rope_cos_sin,
    rope_inv_freq,
)
from .stacked import decode_stacked, row_signals, stackable
from .vision import VisionConfig, VisionTower, tile_workspace_bytes

# fp32 logits per tile of canvases on the CPU: small enough to stay in cache, and below one canvas at the real
# vocabulary (16 MiB with a 16-position canvas), so there the tile is one canvas and the step's peak does not grow
# with the batch
CPU_TILE_BYTES = 8 << 20


class DiffusionGemma:
    """The model over explicit weight tensors (no nn.Module: inference only, weights never trained here)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        batch_rows: bool | None = None,
        vision: VisionTower | None = None,
    ):
        self.config = config
        self.vision = vision  # the image tower (model/vision.py); None: the checkpoint declares none
        self.dtype = dtype
        self.device = torch.device(device)
        # accelerators: rows in one batched pass (model/batched.py); CPU: canvases stacked, bitwise (model/stacked.py)
        self.batch_rows = self.device.type != "cpu" if batch_rows is None else batch_rows
        # canvases per tile of the LM head, the self-conditioning softmax and the sampler: their [n, C, V] fp32
        # temporaries are bounded by a tile, not by the batch (docs/memory.md). CPU: as many canvases as fit
        # CPU_TILE_BYTES of fp32 logits (one at the real vocabulary; the whole batch of the shipped model), every op
        # of the tile row-count invariant (docs/exactness.md, "Batch invariance"); accelerators: 4 (~0.27 GB of
        # fp32 logits per canvas at V = 262,144).
        C, V = config.canvas_length, config.vocab_size
        self.canvas_tile = max(1, CPU_TILE_BYTES // (4 * C * V)) if self.device.type == "cpu" else 4
        # images per pass of the vision tower (docs/images.md, "Where images are encoded"): 1 on CPU, each image's
        # GEMMs keep their own shape (a request's soft tokens never depend on the others'); on accelerators a tile
        # padded to its largest image, its working memory set aside in the KV cache budget (``tile_workspace_bytes``)
        self.image_tile = 1 if self.device.type == "cpu" else 4
        self.embed = weights["embed_tokens.weight"]  # [V, H]
        self.lm_head = weights.get("lm_head.weight", self.embed)  # tied unless stored and different
        self.final_norm = weights["norm.weight"]
        self.sc_pre_norm = weights["self_conditioning.pre_norm.weight"]
        self.sc_gate = weights["self_conditioning.gate_proj.weight"]
        self.sc_up = weights["self_conditioning.up_proj.weight"]
        self.sc_down = weights["self_conditioning.down_proj.weight"]
        self.layers = [LayerWeights.from_state(weights, i) for i in range(config.num_hidden_layers)]
        if self.device.type == "cpu":  # one GEMM for q/k/v and one for gate/up (the CPU's GEMM: the same bits)
            for lw in self.layers:
                lw.fuse_projections()
        # rnd(√H): the scale is rounded to md BEFORE the multiply (docs/generation.md)
        self.embed_scale = torch.tensor(config.hidden_size**0.5).to(dtype).to(self.device)
        # inv_freq built in fp32 on the CPU, then uploaded (docs/exactness.md)
        self.inv_freq = [rope_inv_freq(config, i).to(self.device) for i in range(config.num_hidden_layers)]

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        nvfp4_packed: bool | None = None,
        fp8_w8a8: bool | None = None,
        hf_overrides: dict | str | None = None,
    ) -> DiffusionGemma:
        """Load a Hugging Face-format checkpoint directory (config.json + *.safetensors).

        nvfp4_packed: serve ModelOpt NVFP4 experts in the packed W4A16 layout through ``ops.nvfp4_moe_experts``
        (default: on CUDA) instead of dequantizing them to ``dtype`` at load. fp8_w8a8: serve compressed-tensors FP8
        weights as W8A8 (default: ``model.fp8_w8a8.decide``, CUDA sm_89+) instead of dequantizing them at load.
        hf_overrides: a JSON object deep-merged into config.json first (``ModelConfig.from_pretrained``)."""
        from dgserve.model import fp8_w8a8 as w8a8_path
        from dgserve.model.quant_format import FP8, detect_format

        config = ModelConfig.from_pretrained(path, hf_overrides)
        packed = torch.device(device).type == "cuda" if nvfp4_packed is None else nvfp4_packed
        w8a8 = detect_format(os.fspath(path)) == FP8 and w8a8_path.decide(device, dtype, fp8_w8a8)[0] == w8a8_path.W8A8
        weights = load_weights(path, config, dtype=dtype, device=device, nvfp4_packed=packed, fp8_w8a8=w8a8)
        vc = VisionConfig.from_pretrained(path)
        vision = None if vc is None else VisionTower.load(path, vc, config.hidden_size, dtype, device)
        return cls(config, weights, dtype, device, vision=vision)

    # ------------------------------------------------------------------ images

    def images_unsupported(self) -> str | None:
        """Why this model cannot take images (no tower, or image token ids outside its vocabulary), or None."""
        vc = self.vision.config if self.vision is not None else None
        if vc is None:
            return "the model has no vision tower"
        if max(vc.boi_token_id, vc.eoi_token_id) >= self.config.vocab_size:
            return "the model's image token ids lie outside its vocabulary"
        return None

    @torch.inference_mode()
    def encode_images(self, images: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Per image (patches [n, 3·p²], positions [n, 2]) → soft tokens [n / k², H] in md (model/vision.py), in
        tower passes of ``image_tile`` images (one image: unpadded; several: padded to the tile's largest)."""
        if self.vision is None:
            raise ValueError("the model has no vision tower")
        out: list[torch.Tensor] = []
        for i in range(0, len(images), self.image_tile):
            tile = list(images[i : i + self.image_tile])
            out += [self.vision.encode(*tile[0])] if len(tile) == 1 else self.vision.encode_tile(tile)
        return out

    def image_workspace_bytes(self) -> int:
        """The vision tower's peak working memory for one tile of ``image_tile`` images of the largest size the
        config allows (``vision.tile_workspace_bytes``); 0 when the model cannot take images."""
        if self.vision is None or self.images_unsupported() is not None:
            return 0
        return tile_workspace_bytes(self.vision.config, self.image_tile, self.dtype)

    # ------------------------------------------------------------------ public passes

    @torch.inference_mode()
    def prefill(
        self,
        input_ids: torch.Tensor,
        cache: SlotCache | None = None,
        pixel_values: torch.Tensor | None = None,
        image_position_ids: torch.LongTensor | None = None,
    ) -> SlotCache:
        """Encode input_ids [B, T] after what `cache` holds, row b into slot b; returns the cache.

        pixel_values [N, P, 3·p²] and image_position_ids [N, P, 2] ((-1, -1) marks padding), as transformers'
        processor makes them: the images' soft tokens replace the ``image_token_id`` placeholders of input_ids in
        order (row-major over the batch), and each run of placeholders attends bidirectionally in the encoder
        (docs/images.md). An image's placeholders must all lie in this call.

        cache=None: a new zero-filled SlotCache of B slots, sized for the prompt and one canvas. A given cache
        grows in place (``SlotCache.reserve``) when the tokens would not fit, so the same object stays valid.
        """
        input_ids = torch.as_tensor(input_ids).to(self.device)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        B, T = input_ids.shape
        C = self.config.canvas_length
        if cache is None:
            cache = SlotCache(self.config, B, T + C, max(T, C), self.dtype, self.device, zero=True)
        if cache.num_slots != B:
            raise ValueError(f"input_ids has {B} rows but the cache has {cache.num_slots}")
        cache.reserve(max(cache.lengths) + T, T)
        feats: torch.Tensor | None = None
        if pixel_values is not None:
            from dgserve.media.images import unpad

            if image_position_ids is None:
                raise ValueError("pixel_values needs image_position_ids")
            feats = torch.cat(self.encode_images(unpad(pixel_values, image_position_ids)))
        used = 0
        for b in range(B):
            rows = None
            if feats is not None:
                assert self.vision is not None
                n = int((input_ids[b] == self.vision.config.image_token_id).sum())
                rows, used = feats[used : used + n], used + n
            self.encode_row(input_ids[b], cache.view(b), rows)
        if feats is not None and used != feats.shape[0]:
            raise ValueError(f"image features and image tokens do not match: {used} tokens, {feats.shape[0]} features")
        return cache

    @torch.inference_mode()
    def denoise(
        self,
        cache: SlotCache,
        canvas_ids: torch.Tensor,
        self_cond_logits: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
        self_cond_probs: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
        tiled: bool = False,
        self_cond_signal: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Decoder pass over canvas_ids [B, C] → softcapped fp32 logits [B, C, V].

        self_cond_logits [B, C, V]: the previous step's processed logits rounded to md (what transformers
        feeds); self_cond_probs [B, C, V]: their fp32 softmax (skips the recompute; ``ops.softmax_rows`` gives the
        logits path's bits, torch's softmax its values within 1e-6); self_cond_signal [B, C, H] md: the
        self-conditioning signal already made from them (``self_conditioning_rows``: what the engine keeps
        between steps, docs/memory.md). Give at most one. Each may also be a sequence of B per-row tensors
        ([C, V], or [C, H] for the signal) or None (rows at a block's first step).
        tiled=True: the decoder runs now and an iterator of (rows, logits [n, C, V]) tiles is returned
        (``logits_tiles``), so the whole [B, C, V] never exists (the engine's step).
        The cache keeps its lengths: the CPU passes read the canvas K/V where the projections leave them; the
        accelerators' batched pass writes them to scratch positions after each row's length, which the next
        ``prefill`` overwrites (the cache grows in place first when they would not fit).
        """
        hidden = self.denoise_hidden(cache, canvas_ids, self_cond_logits, self_cond_probs, self_cond_signal)
        if tiled:
            return self.logits_tiles(hidden)
        B, C = hidden.shape[:2]
        out = torch.empty(B, C, self.config.vocab_size, dtype=torch.float32, device=self.device)
        for rows, logits in self.logits_tiles(hidden):
            out[rows] = logits
        return out

    @torch.inference_mode()
    def denoise_hidden(
        self,
        cache: SlotCache,
        canvas_ids: torch.Tensor,
        self_cond_logits=None,
        self_cond_probs=None,
        self_cond_signal=None,
    ) -> torch.Tensor:
        """The decoder pass of ``denoise`` up to the final hidden states [B, C, H] (before the final norm and
        the LM head): ``logits_tiles`` turns them into logits a tile of canvases at a time."""
        if sum(t is not None for t in (self_cond_logits, self_cond_probs, self_cond_signal)) > 1:
            raise ValueError("give at most one of self_cond_logits, self_cond_probs and self_cond_signal")
        canvas_ids = torch.as_tensor(canvas_ids).to(self.device)
        B, C = canvas_ids.shape
        if cache.num_slots != B:
            raise ValueError(f"canvas_ids has {B} rows but the cache has {cache.num_slots}")
        max_len = max(cache.lengths)
        cache.reserve(max_len + C, C)  # room for the canvas's scratch keys after each row's length
        sc_l = [None if self_cond_logits is None else self_cond_logits[b] for b in range(B)]
        sc_p = [None if self_cond_probs is None else self_cond_probs[b] for b in range(B)]
        sc_s = [None if self_cond_signal is None else self_cond_signal[b] for b in range(B)]
        if self.batch_rows and B > 1:
            if not cache.zero:
                raise ValueError("the batched decoder pass needs a zero-filled cache (SlotCache(..., zero=True))")
            lengths = torch.tensor(cache.lengths, dtype=torch.int64, device=self.device)
            return decode_slots(self, cache, lengths, max_len, canvas_ids, sc_l, sc_p, sc_s)
        if B > 1 and stackable(self):  # one stacked pass, each canvas its own bits (model/stacked.py)
            return decode_stacked(
                self, [cache.view(b) for b in range(B)], canvas_ids, row_signals(self, sc_l, sc_p, sc_s)
            )
        return torch.stack(
            [self.decode_row_hidden(cache.view(b), canvas_ids[b], sc_l[b], sc_p[b], sc_s[b]) for b in range(B)]
        )

    def logits_tiles(self, hidden: torch.Tensor):
        """hidden [B, C, H] → yields (rows: slice of B, fp32 logits [n, C, V]) for tiles of ``canvas_tile``
        canvases: only one tile's logits and temporaries exist at a time."""
        B, C, H = hidden.shape
        for b0 in range(0, B, self.canvas_tile):
            n = min(self.canvas_tile, B - b0)
            # not held here past the yield: the caller frees the tile once it has used it
            yield slice(b0, b0 + n), self._tile_logits(hidden[b0 : b0 + n].reshape(n * C, H)).view(n, C, -1)

    @torch.inference_mode()
    def _tile_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``output_logits`` of one tile's hidden states [n·C, H], in inference mode (the generator above yields
        between tiles, so it holds no mode across them)."""
        return self.output_logits(x)

    @torch.inference_mode()
    def self_conditioning_rows(self, processed: torch.Tensor, rows: Sequence[int]) -> list[torch.Tensor]:
        """The next step's self-conditioning signal [C, H] md for canvases ``rows`` of one LM-head tile's processed
        logits [n, C, V] fp32 (docs/memory.md, "Self-conditioning state"): ``self_conditioning`` of rnd(processed),
        in groups of ``canvas_tile`` canvases (each canvas's bits those of its own call: ``self_conditioning``)."""
        C, V = processed.shape[1:]
        out: list[torch.Tensor] = []
        for t0 in range(0, len(rows), self.canvas_tile):
            part = list(rows[t0 : t0 + self.canvas_tile])
            if part == list(range(part[0], part[-1] + 1)):  # consecutive canvases: a view, rounded in one op
                lg = processed[part[0] : part[-1] + 1].reshape(len(part) * C, V).to(self.dtype)
            else:  # rounded row by row into one buffer (no fp32 copy of the rows)
                lg = torch.empty(len(part) * C, V, dtype=self.dtype, device=processed.device)
                for j, i in enumerate(part):
                    lg[j * C : (j + 1) * C] = processed[i]
            probs = self._softmax_canvases(lg, C)  # ``self_conditioning``'s op, lg freed first
            del lg
            out += list(self.self_conditioning(None, probs).view(len(part), C, -1).unbind(0))
        return out

    # ------------------------------------------------------------------ one row

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] → rnd(Emb[ids] · rnd(√H)) [T, H]."""
        return F.embedding(ids, self.embed) * self.embed_scale

    def encode_row(self, ids: torch.Tensor, row: SlotView, image_embeds: torch.Tensor | None = None) -> None:
        """Causal encoder pass of ids [T] at positions row.length.. ; appends to row (one slot of a SlotCache;
        its next pass sees the last W − 1 positions on sliding layers).

        image_embeds [m, H] md: the soft tokens of the m ``image_token_id`` placeholders of ids, in order; each
        run of placeholders (one image) also attends to itself bidirectionally, on sliding layers beyond the
        window too (transformers' block overlay), so an image must not be split across passes."""
        cfg, eps = self.config, self.config.rms_norm_eps
        T, p0 = ids.shape[0], row.length
        pos = torch.arange(p0, p0 + T, device=self.device)
        groups = None
        if image_embeds is not None:
            assert self.vision is not None
            is_img = ids == self.vision.config.image_token_id
            if int(is_img.sum()) != image_embeds.shape[0]:
                raise ValueError(f"{int(is_img.sum())} image tokens but {image_embeds.shape[0]} image features")
            x = self.embed_tokens(torch.where(is_img, 0, ids))
            x[is_img] = image_embeds.to(x.dtype)
            starts = is_img & ~torch.cat([is_img.new_zeros(1), is_img[:-1]])
            groups = torch.where(is_img, torch.cumsum(starts.long(), 0), -1)  # [T]: image k's run → k, text → -1
        else:
            x = self.embed_tokens(ids)
        # RoPE tables and masks depend on the layer's kind only (sliding or full): made once per pass, not per layer
        ropes: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        masks: dict[tuple[bool, int], torch.Tensor] = {}
        for i, lw in enumerate(self.layers):
            hd, sliding = cfg.head_dim(i), cfg.is_sliding(i)
            if sliding not in ropes:
                ropes[sliding] = rope_cos_sin(self.inv_freq[i], pos, self.dtype)
            cos, sin = ropes[sliding]
            h = ops.rms_norm(x, lw.input_layernorm, eps)
            k, v = project_kv(h, lw, hd, eps, cos, sin)
            keys, values, k0 = row.encode_kv(i, k, v)  # keys: cached then new, chronological
            if i == len(self.layers) - 1:
                break  # the last layer's output is never used: only its K/V matter
            if (sliding, k0) not in masks:
                masks[sliding, k0] = encoder_mask(pos, p0, k0, cfg.sliding_window if sliding else None, groups)
            attn = attend_encoder(project_q(h, lw, hd, eps, cos, sin), keys, values, masks[sliding, k0])
            x = feed_forward(attention_output(x, attn, lw, eps), lw, cfg, lw.encoder_layer_scalar)
        row.commit(T)

    def decode_row(
        self, row: SlotView, canvas: torch.Tensor, sc_logits: torch.Tensor | None, sc_probs: torch.Tensor | None
    ) -> torch.Tensor:
        """Bidirectional decoder pass of canvas [C] at positions row.length.. → fp32 logits [C, V]."""
        return self.output_logits(self.decode_row_hidden(row, canvas, sc_logits, sc_probs))

    def decode_row_hidden(
        self,
        row: SlotView,
        canvas: torch.Tensor,
        sc_logits: torch.Tensor | None,
        sc_probs: torch.Tensor | None,
        sc_signal: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``decode_row`` up to the final hidden states [C, H]; sc_signal [C, H]: the self-conditioning signal
        already made (``self_conditioning_rows``), added as is."""
        cfg, eps = self.config, self.config.rms_norm_eps
        C, P = canvas.shape[0], row.length
        pos = torch.arange(P, P + C, device=self.device)
        x = self.embed_tokens(canvas)
        if sc_signal is not None:
            x = x + sc_signal.to(self.device)
        elif sc_logits is not None or sc_probs is not None:
            x = x + self.self_conditioning(sc_logits, sc_probs)
        x = ops.rms_norm(x, None, eps)  # applied at every step, the first (sc = 0) included
        for i, lw in enumerate(self.layers):
            hd = cfg.head_dim(i)
            cos, sin = rope_cos_sin(self.inv_freq[i], pos, self.dtype)
            h = ops.rms_norm(x, lw.input_layernorm, eps)
            k, v = project_kv(h, lw, hd, eps, cos, sin)
            kc, vc = row.cached_kv(i)  # what the cache shows, then the canvas: visible to every query
            attn = ops.decode_attention(project_q(h, lw, hd, eps, cos, sin), [kc], [vc], k, v, C)
            x = feed_forward(attention_output(x, attn, lw, eps), lw, cfg, lw.layer_scalar)
        return x

    def self_conditioning(self, sc_logits: torch.Tensor | None, sc_probs: torch.Tensor | None) -> torch.Tensor:
        """Self-conditioning signal [C, H]: MLP(pre_norm(rnd(rnd(softmax(ℓ)) · Emb) · rnd(√H))) (docs/generation.md)."""
        if sc_probs is None:
            if sc_logits is None:
                raise ValueError("self_conditioning needs sc_logits or sc_probs")
            sc_probs = self._softmax_canvases(sc_logits.to(self.device), self.config.canvas_length)
        # rnd(probs)·Emb as ``linear`` with Emb read transposed in place: row-count invariant on the CPU, so the
        # signal of a canvas is the same whatever tile it is made in (docs/exactness.md, "Batch invariance")
        soft = ops.linear(sc_probs.to(self.dtype), self.embed.t()) * self.embed_scale
        n = ops.rms_norm(soft, self.sc_pre_norm, self.config.rms_norm_eps)
        return ops.gated_mlp(n, self.sc_gate, self.sc_up, self.sc_down)

    def _softmax_canvases(self, logits: torch.Tensor, C: int) -> torch.Tensor:
        """fp32 softmax over the last dim of logits [n·C, V] (``ops.softmax_rows``: on the CPU one fixed sequence per
        row, so a canvas gets the bits of its own call in any tile). Where that native op is off on the CPU, torch's
        softmax runs one canvas (C rows) per call instead (its loops place their vector tails by the tensor's size)."""
        if self.device.type != "cpu" or logits.shape[0] <= C or softmax_rows_native_ok(logits):
            return ops.softmax_rows(logits)
        # torch.softmax(x, dtype=fp32) is _softmax of x in fp32; its out= form writes each canvas in place (no copy)
        wide = logits if logits.dtype == torch.float32 else logits.float()
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        for c0 in range(0, logits.shape[0], C):
            torch.ops.aten._softmax.out(wide[c0 : c0 + C], -1, False, out=out[c0 : c0 + C])
        return out

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm, tied lm_head (rounded to md), softcap in fp32 → [T, V] fp32. The native softcap is one
        formula per element, so it runs once over the tile; where ``ops.softcap`` falls back to torch's tanh on the
        CPU it runs one canvas (``canvas_length`` rows) at a time, so a canvas's logits are the bits of its own call
        in any tile."""
        z = ops.linear(ops.rms_norm(x, self.final_norm, self.config.rms_norm_eps), self.lm_head).float()
        cap = self.config.final_logit_softcapping
        if cap:  # tanh(z / cap) * cap in place (ops.softcap: one fixed tanh formula on the CPU), no [T, V] temporaries
            # the native op is elementwise (one call for the tile); torch's tanh, its fallback, runs a canvas per call
            whole = self.device.type != "cpu" or softcap_native_ok(z)
            for part in z.split(max(z.shape[0] if whole else self.config.canvas_length, 1)):
                ops.softcap(part, cap)
        return z
