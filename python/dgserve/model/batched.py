"""The decoder pass over several rows at once, for accelerators (on CPU rows run one by one: docs/exactness.md).

Rows are the first B slots of a ``SlotCache`` (the ModelRunner packs running requests densely into slots
0..n−1; the public ``denoise`` passes all the slots of its cache), read in place: each layer's canvas K/V are
scattered into the slots' scratch positions, and attention runs over a fixed-shape view of the buffers with a
per-row mask:

* full layers: ``keys[:B, :, :L]`` with L = a bucket ≥ max(P) + C; key j is visible to row b iff j < P_b + C;
* sliding layers: the whole ring ``keys[:B, :, :R]``; ring index j holds the latest position q ≡ j (mod R) below
  P_b + C, visible iff q ≥ P_b − (W − 1).

No gather, pad or concatenation proportional to the context, no host sync, and shapes depend only on (B, L):
the shape CUDA graphs need. Keys are visited in ring order rather than chronologically and masked entries are
summed as zeros, so results equal the per-row pass up to rounding (tests compare within fp32 tolerance); the
CPU engine keeps the per-row path, bitwise invariant.
"""

from __future__ import annotations

import torch

from dgserve import ops

from .cache import SlotCache
from .layers import attention_output, feed_forward, project_kv, project_q, rope_cos_sin

LENGTH_BUCKET = 256  # full-layer views are sized in multiples of this (a few static shapes for CUDA graphs)


def attend_batched(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """q [B, nh, C, hd]; keys/values [B, nkv, S, hd]; valid [B, S] → [B·C, nh·hd] (eager: md scores, fp32 softmax)."""
    B, nh, C, hd = q.shape
    nkv = keys.shape[1]
    scores = torch.matmul(q.reshape(B, nkv, (nh // nkv) * C, hd), keys.transpose(2, 3)).view(B, nh, C, -1)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(p.view(B, nkv, (nh // nkv) * C, -1), values).view(B, nh, C, hd)
    return out.permute(0, 2, 1, 3).reshape(B * C, nh * hd)


def length_bucket(n: int, cap: int) -> int:
    """The full-layer view length for n positions: a multiple of LENGTH_BUCKET, at most cap."""
    return min(cap, -(-n // LENGTH_BUCKET) * LENGTH_BUCKET)


def _write_canvas(cache: SlotCache, layer: int, B: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [B, nkv, C, hd] → the scratch positions pos [B, C] of slots 0..B−1 (both ring copies when sliding)."""
    K, V = cache.keys[layer][:B], cache.values[layer][:B]
    idx = pos if not cache.sliding[layer] else pos % cache.ring
    bases = (0, cache.ring) if cache.sliding[layer] else (0,)
    for base in bases:
        index = (idx + base)[:, None, :, None].expand_as(k)
        K.scatter_(2, index, k)
        V.scatter_(2, index, v)


def _visible(cache: SlotCache, layer: int, lengths: torch.Tensor, C: int, L: int) -> torch.Tensor:
    """valid [B, S] for the view the layer attends to (see the module docstring)."""
    end = lengths[:, None] + C  # [B, 1]: one past the last canvas position
    if not cache.sliding[layer]:
        return torch.arange(L, device=lengths.device)[None, :] < end
    R = cache.ring
    j = torch.arange(R, device=lengths.device)[None, :]
    q = end - 1 - torch.remainder(end - 1 - j, R)  # the position ring index j holds
    return q >= (lengths[:, None] - (cache.window - 1)).clamp(min=0)


def decode_slots(
    model,
    cache: SlotCache,
    lengths: torch.Tensor,
    max_len: int,
    canvas: torch.Tensor,
    sc_logits: list,
    sc_probs: list,
    sc_signal: list | None = None,
) -> torch.Tensor:
    """Slots 0..B−1: lengths [B] int64 (positions encoded, on the device), max_len = max(lengths) (host),
    canvas [B, C]; sc_logits / sc_probs: per-row [C, V] or None; sc_signal: per-row [C, H] or None, the
    self-conditioning signal already made (the engine's) → final hidden states [B, C, H] (the LM head runs in
    tiles: ``DiffusionGemma.logits_tiles``)."""
    cfg, eps = model.config, model.config.rms_norm_eps
    B, C = canvas.shape
    pos = lengths[:, None] + torch.arange(C, device=model.device)[None, :]  # [B, C]
    x = model.embed_tokens(canvas.reshape(-1)).view(B, C, -1)
    signal = sc_signal or [None] * B
    given = [b for b in range(B) if signal[b] is not None]
    if given:
        x[given] = x[given] + torch.stack([signal[b].to(x.device) for b in given])
    tile = model.canvas_tile  # the self-conditioning softmax over [n·C, V] in tiles of canvases, one kind each
    for kind in (sc_logits, sc_probs):
        with_sc = [b for b in range(B) if kind[b] is not None and signal[b] is None]
        for t0 in range(0, len(with_sc), tile):
            part = with_sc[t0 : t0 + tile]
            sc = torch.cat([kind[b] for b in part])
            lg, pr = (sc, None) if kind is sc_logits else (None, sc)
            x[part] = x[part] + model.self_conditioning(lg, pr).view(len(part), C, -1)
    x = ops.rms_norm(x.view(B * C, -1), None, eps)
    L = length_bucket(max_len + C, cache.slot_len)
    for i, lw in enumerate(model.layers):
        hd = cfg.head_dim(i)
        cos, sin = rope_cos_sin(model.inv_freq[i], pos.reshape(-1), model.dtype)
        h = ops.rms_norm(x, lw.input_layernorm, eps)
        k, v = project_kv(h, lw, hd, eps, cos, sin)  # [nkv, B·C, hd]
        _write_canvas(cache, i, B, pos, k.view(-1, B, C, hd).transpose(0, 1), v.view(-1, B, C, hd).transpose(0, 1))
        S = cache.ring if cache.sliding[i] else L
        q = project_q(h, lw, hd, eps, cos, sin)
        q = q.view(q.shape[0], B, C, hd).transpose(0, 1)  # [B, nh, C, hd]
        attn = attend_batched(
            q, cache.keys[i][:B, :, :S], cache.values[i][:B, :, :S], _visible(cache, i, lengths, C, S)
        )
        x = feed_forward(attention_output(x, attn, lw, eps), lw, cfg, lw.layer_scalar)
    return x.view(B, C, -1)
