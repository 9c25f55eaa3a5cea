"""The decoder pass of several canvases at once on the CPU (docs/exactness.md, "Batch invariance").

B canvases of C tokens are stacked into one [B·C, H] pass: every row-wise op of a layer (the norms, the q/k/v/o
projections, the dense MLP, the MoE router and experts) runs once over all B·C rows. Those ops are batch-invariant on
the CPU (each output element one fixed fp32 sequence, whatever the number of rows), so every canvas gets the bits of
its own one-canvas pass (``DiffusionGemma.decode_row_hidden``). What is not row-wise stays per canvas, as the
one-canvas pass does it: RoPE's cos/sin (torch vectorises them over the whole tensor, so they are made on each
canvas's own [C, hd] positions, once per distinct start). Attention is one ``ops.decode_attention`` call per layer:
each canvas over what its own slot shows (``SlotView.cached_kv``), then its own canvas K/V, read from the stacked
projections where they are (nothing is written to the cache).

The encoder is stacked the same way (``encode_stacked``): several rows' token chunks (prompt chunks, committed blocks;
text only) in one pass, the row-wise ops over all their tokens, RoPE tables, the K/V hand-off, the causal masks and
attention per row as ``DiffusionGemma.encode_row`` makes them, so each row's cache gets the bits of its own pass.

Public contract:
    if stackable(model):   # CPU, experts in the model dtype
        hidden[B, C, H] = decode_stacked(model, rows, canvases[B, C], signals)   # rows: SlotViews; signals: [C, H]|None
        encode_stacked(model, rows, ids)   # ids[b]: row b's tokens [T_b] after what it holds; each row commits T_b
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from dgserve import ops

from .cache import SlotView
from .layers import (
    attend_encoder,
    attention_output,
    encoder_mask,
    feed_forward,
    project_kv,
    project_q,
    project_qkv,
    rope_cos_sin,
)


def stackable(model) -> bool:
    """Whether ``decode_stacked`` gives each canvas its own bits on this model: on the CPU, with the experts in the
    model dtype (``ops.moe_experts``: per-expert ``linear``); NVFP4 or FP8 experts served as such keep the
    per-canvas pass."""
    return model.device.type == "cpu" and all(
        lw.experts_packed is None and lw.experts_fp8 is None for lw in model.layers
    )


def _stacked_rope(model, rows: Sequence[SlotView], C: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (cos, sin) [B·C, hd]: each canvas's own [C, hd] table, the bits ``rope_cos_sin`` makes from its
    positions in its one-canvas pass. A table depends only on the canvas's first position, so canvases that start at
    the same position share one (made once, then gathered). The angles (an fp32 product per element) and the
    roundings to md are made for all distinct starts at once; cos and sin, torch loops whose vector tails sit by the
    tensor's size, run one start at a time on [C, hd] blocks, as ``rope_cos_sin`` runs them. Layers of one kind and
    head dim share their inv_freq, so the tables are made once per (kind, head dim). (Not kept between steps: they
    would be state per stream.)"""
    cfg, dev = model.config, model.device
    starts = [r.length for r in rows]
    distinct = list(dict.fromkeys(starts))  # in order of first use: all distinct → the canvases' own order
    pos = (torch.tensor(distinct, dtype=torch.int64)[:, None] + torch.arange(C)).reshape(-1).to(dev)
    which = None  # the distinct start of each canvas, when some share one
    if len(distinct) < len(rows):
        at = {s: u for u, s in enumerate(distinct)}
        which = torch.tensor([at[s] for s in starts], dtype=torch.int64, device=dev)
    made: dict[tuple[bool, int], tuple[torch.Tensor, torch.Tensor]] = {}
    out = []
    for i in range(cfg.num_hidden_layers):
        key = (cfg.is_sliding(i), cfg.head_dim(i))
        if key not in made:
            freqs = pos[:, None].float() * model.inv_freq[i][None, :]
            emb = torch.cat([freqs, freqs], dim=-1)  # [U·C, hd] fp32
            cos, sin = torch.empty_like(emb), torch.empty_like(emb)
            for u in range(len(distinct)):
                block = slice(u * C, (u + 1) * C)
                torch.cos(emb[block], out=cos[block])
                torch.sin(emb[block], out=sin[block])
            cos, sin = cos.to(model.dtype), sin.to(model.dtype)
            if which is not None:  # [U·C, hd] → each canvas's block, [B·C, hd]
                hd = emb.shape[1]
                cos = cos.view(-1, C, hd).index_select(0, which).view(-1, hd)
                sin = sin.view(-1, C, hd).index_select(0, which).view(-1, hd)
            made[key] = cos, sin
        out.append(made[key])
    return out


def row_signals(model, logits: Sequence, probs: Sequence, signals: Sequence) -> list[torch.Tensor | None]:
    """Per canvas, its self-conditioning signal [C, H] or None: the signal given, else ``self_conditioning`` of its
    logits or probs (what ``decode_row_hidden`` adds), else None."""
    return [
        s if s is not None or (lg is None and p is None) else model.self_conditioning(lg, p)
        for lg, p, s in zip(logits, probs, signals, strict=True)
    ]


@torch.inference_mode()
def decode_stacked(
    model,
    rows: Sequence[SlotView],
    canvases: torch.Tensor,
    signals: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    """``decode_row_hidden`` of B canvases [B, C] at once → final hidden states [B, C, H], canvas b bit for bit its
    own one-canvas pass. model: the DiffusionGemma (untyped: it imports this module); rows[b]: canvas b's cache slot
    (read only: the canvas K/V are attended to where the projections leave them); signals[b]: its self-conditioning
    signal [C, H] md, or None."""
    cfg, eps = model.config, model.config.rms_norm_eps
    B, C = canvases.shape
    if len(rows) != B or len(signals) != B:
        raise ValueError(f"{B} canvases but {len(rows)} cache rows and {len(signals)} signals")
    x = model.embed_tokens(canvases.reshape(-1).to(model.device))
    if all(s is not None for s in signals):  # in place (one add: elementwise, so the values of each ``x + signal``)
        x += torch.cat([s.to(model.device) for s in signals])  # type: ignore[union-attr]
    else:
        for b, s in enumerate(signals):
            if s is not None:  # in place: the values of the one-canvas pass's ``x + signal``
                x[b * C : (b + 1) * C] += s.to(model.device)
    x = ops.rms_norm(x, None, eps)  # applied at every step, the first (sc = 0) included
    cache = rows[0].cache
    one_cache = all(r.cache is cache for r in rows)
    slots = [r.slot for r in rows]
    spans: dict[bool, list[tuple[int, int, int]]] = {}  # what each slot shows depends only on the layer's kind
    for i, (lw, (cos, sin)) in enumerate(zip(model.layers, _stacked_rope(model, rows, C), strict=True)):
        hd = cfg.head_dim(i)
        h = ops.rms_norm(x, lw.input_layernorm, eps)
        q, k, v = project_qkv(h, lw, hd, eps, cos, sin)
        # one attention call: each canvas over what its slot shows, then its own K/V (read where they are)
        if one_cache:  # the cache's buffers and each canvas's (slot, start, count): no view per canvas
            kind = cache.sliding[i]
            if kind not in spans:
                spans[kind] = [cache.cached_span(s, i) for s in slots]
            attn = ops.decode_attention(q, cache.keys[i], cache.values[i], k, v, C, spans[kind])
        else:
            cached = [r.cached_kv(i) for r in rows]
            attn = ops.decode_attention(q, [kc for kc, _ in cached], [vc for _, vc in cached], k, v, C)
        x = feed_forward(attention_output(x, attn, lw, eps), lw, cfg, lw.layer_scalar)
    return x.view(B, C, -1)


@torch.inference_mode()
def encode_stacked(model, rows: Sequence[SlotView], ids: Sequence[torch.Tensor]) -> None:
    """``encode_row`` of B rows' text chunks at once: ids[b] [T_b] at positions rows[b].length.. of row b's slot;
    each row's K/V and length afterwards are bit for bit those of its own ``encode_row``. The lengths move only
    once the whole pass has run (a pass that fails leaves every row as it was, its scratch writes uncommitted)."""
    cfg, eps, dev = model.config, model.config.rms_norm_eps, model.device
    if len(rows) != len(ids):
        raise ValueError(f"{len(rows)} rows but {len(ids)} token chunks")
    lens = [int(t.shape[0]) for t in ids]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    per = [slice(a, b) for a, b in itertools.pairwise(starts)]
    p0 = [r.length for r in rows]
    pos = [torch.arange(p, p + n, device=dev) for p, n in zip(p0, lens, strict=True)]
    x = model.embed_tokens(torch.cat([t.to(dev) for t in ids]))
    ropes: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}  # per layer kind, each row's own table, concatenated
    masks: dict[tuple[int, bool, int], torch.Tensor] = {}
    last = len(model.layers) - 1
    for i, lw in enumerate(model.layers):
        hd, sliding = cfg.head_dim(i), cfg.is_sliding(i)
        if sliding not in ropes:
            cs = [rope_cos_sin(model.inv_freq[i], p, model.dtype) for p in pos]
            ropes[sliding] = torch.cat([c for c, _ in cs]), torch.cat([s for _, s in cs])
        cos, sin = ropes[sliding]
        h = ops.rms_norm(x, lw.input_layernorm, eps)
        k, v = project_kv(h, lw, hd, eps, cos, sin)
        kv = [rows[b].encode_kv(i, k[:, s], v[:, s]) for b, s in enumerate(per)]  # keys: cached then new
        if i == last:
            break  # the last layer's output is never used: only its K/V matter
        q = project_q(h, lw, hd, eps, cos, sin)
        parts = []
        for b, (s, (keys, values, k0)) in enumerate(zip(per, kv, strict=True)):
            if (b, sliding, k0) not in masks:
                masks[b, sliding, k0] = encoder_mask(pos[b], p0[b], k0, cfg.sliding_window if sliding else None, None)
            parts.append(attend_encoder(q[:, s], keys, values, masks[b, sliding, k0]))
        x = feed_forward(attention_output(x, torch.cat(parts), lw, eps), lw, cfg, lw.encoder_layer_scalar)
    for r, n in zip(rows, lens, strict=True):
        r.commit(n)
