"""The decoder pass over several rows at once, for accelerators (DESIGN Decision 3: on CPU rows run one by one).

Rows may hold different amounts of cache: each layer's cached keys/values are right-padded to the longest row
and masked, the canvas keys follow, and every linear layer, the router and the experts run once over all
B·C canvas tokens. Results equal the per-row pass up to GEMM rounding (a GEMM's row results may depend on the
number of rows), so the CPU engine keeps the per-row path; tests compare the two within fp32 tolerance.
"""

from __future__ import annotations

import torch

from dgserve import ops

from .cache import RowCache
from .layers import attention_output, feed_forward, project_kv, project_q, rope_cos_sin


def padded_cache(rows: list[RowCache], layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """→ keys, values [B, nkv, Lmax, hd] (right-padded with zeros) and valid [B, Lmax] bool."""
    ks = [r.keys[layer] for r in rows]
    lmax = max(k.shape[1] for k in ks)
    nkv, _, hd = ks[0].shape
    keys = ks[0].new_zeros(len(rows), nkv, lmax, hd)
    values = keys.clone()
    valid = torch.zeros(len(rows), lmax, dtype=torch.bool, device=keys.device)
    for b, r in enumerate(rows):
        n = r.keys[layer].shape[1]
        keys[b, :, :n], values[b, :, :n], valid[b, :n] = r.keys[layer], r.values[layer], True
    return keys, values, valid


def attend_batched(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """q [B, nh, C, hd]; keys/values [B, nkv, S, hd]; valid [B, S] → [B·C, nh·hd] (eager: md scores, fp32 softmax)."""
    B, nh, C, hd = q.shape
    nkv = keys.shape[1]
    scores = torch.matmul(q.reshape(B, nkv, (nh // nkv) * C, hd), keys.transpose(2, 3)).view(B, nh, C, -1)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(p.view(B, nkv, (nh // nkv) * C, -1), values).view(B, nh, C, hd)
    return out.permute(0, 2, 1, 3).reshape(B * C, nh * hd)


def decode_batched(model, rows: list[RowCache], canvas: torch.Tensor, sc_logits: list, sc_probs: list) -> torch.Tensor:
    """canvas [B, C]; sc_logits / sc_probs: per-row [C, V] or None → final hidden states [B, C, H] (the LM head
    runs in tiles: ``DiffusionGemma.logits_tiles``)."""
    cfg, eps = model.config, model.config.rms_norm_eps
    B, C = canvas.shape
    pos = torch.cat([torch.arange(r.length, r.length + C, device=model.device) for r in rows])  # [B·C]
    x = model.embed_tokens(canvas.reshape(-1)).view(B, C, -1)
    with_sc = [b for b in range(B) if sc_logits[b] is not None or sc_probs[b] is not None]
    tile = model.canvas_tile  # the self-conditioning softmax over [n·C, V] in tiles of canvases
    for t0 in range(0, len(with_sc), tile):
        part = with_sc[t0 : t0 + tile]
        lg = None if sc_logits[part[0]] is None else torch.cat([sc_logits[b] for b in part])
        pr = None if lg is not None else torch.cat([sc_probs[b] for b in part])
        x[part] = x[part] + model.self_conditioning(lg, pr).view(len(part), C, -1)
    x = ops.rms_norm(x.view(B * C, -1), None, eps)
    valid_canvas = torch.ones(B, C, dtype=torch.bool, device=model.device)
    for i, lw in enumerate(model.layers):
        hd = cfg.head_dim(i)
        cos, sin = rope_cos_sin(model.inv_freq[i], pos, model.dtype)
        h = ops.rms_norm(x, lw.input_layernorm, eps)
        k, v = project_kv(h, lw, hd, eps, cos, sin)  # [nkv, B·C, hd]
        k = k.view(k.shape[0], B, C, hd).transpose(0, 1)
        v = v.view(v.shape[0], B, C, hd).transpose(0, 1)
        q = project_q(h, lw, hd, eps, cos, sin)
        q = q.view(q.shape[0], B, C, hd).transpose(0, 1)  # [B, nh, C, hd]
        if rows[0].keys:
            ck, cv, cvalid = padded_cache(rows, i)
            k, v = torch.cat([ck, k], dim=2), torch.cat([cv, v], dim=2)
            valid = torch.cat([cvalid, valid_canvas], dim=1)
        else:
            valid = valid_canvas
        attn = attend_batched(q, k, v, valid)
        x = feed_forward(attention_output(x, attn, lw, eps), lw, cfg, lw.layer_scalar)
    return x.view(B, C, -1)
