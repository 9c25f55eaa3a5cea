"""The KV cache (model/cache.py): a slot's in-place writes, read back as views of the mirrored sliding rings,
give the same bits as concatenating the cached keys with each pass's new ones (prompt chunks that wrap the rings,
committed blocks, the decoder's cached views); the public prefill/denoise grow their cache in place and keep those
bits."""

from __future__ import annotations

import pytest
import torch

from dgserve import DiffusionGemma
from dgserve.model import SlotCache
from dgserve.model.tiny import preset, random_weights


class ConcatCache:
    """Reference: one row's cache as one tensor per layer, ``cat([cached, new])`` per pass, sliding layers trimmed
    to their last W − 1 positions after each encode (transformers' DynamicCache). Duck-types ``SlotView``."""

    def __init__(self, config):
        self.config, self.length = config, 0
        self.keys: list[torch.Tensor | None] = [None] * config.num_hidden_layers
        self.values: list[torch.Tensor | None] = [None] * config.num_hidden_layers

    def _cat(self, layer, k, v):
        if self.keys[layer] is None:
            return k, v
        return torch.cat([self.keys[layer], k], dim=1), torch.cat([self.values[layer], v], dim=1)

    def encode_kv(self, layer, k, v):
        keys, values = self._cat(layer, k, v)
        start = self.length - (0 if self.keys[layer] is None else self.keys[layer].shape[1])
        keep = keys.shape[1]
        if self.config.is_sliding(layer):
            keep = min(keep, self.config.sliding_window - 1)
        self.keys[layer], self.values[layer] = keys[:, -keep:], values[:, -keep:]
        return keys, values, start

    def cached_kv(self, layer):
        if self.keys[layer] is None:
            nkv, hd = self.config.num_kv_heads(layer), self.config.head_dim(layer)
            return torch.empty(nkv, 0, hd), torch.empty(nkv, 0, hd)
        return self.keys[layer], self.values[layer]

    def commit(self, n):
        self.length += n


def _model(seed=1):
    cfg = preset("tiny")
    return DiffusionGemma(cfg, random_weights(cfg, seed), torch.float32)


@pytest.mark.parametrize("chunk, prompt_len", [(5, 29), (16, 40), (3, 7)])
def test_slot_views_equal_concatenation_bitwise(chunk, prompt_len):
    """Encoder chunks and decoder steps over a slot (ring wrap-arounds included) give exactly the bits of the
    concatenating layout: the keys are the same, in the same order, only read in place."""
    m = _model()
    cfg = m.config
    C, V = cfg.canvas_length, cfg.vocab_size
    assert prompt_len + 5 * C > 2 * (cfg.sliding_window - 1 + max(chunk, C))  # beyond the window, rings wrap
    g = torch.Generator().manual_seed(chunk)
    prompt = torch.randint(0, V, (prompt_len,), generator=g)
    ref, slots = ConcatCache(cfg), SlotCache(cfg, 3, 256, max(chunk, C), torch.float32, torch.device("cpu"))
    slot = slots.view(2)
    for s in range(0, prompt_len, chunk):
        m.encode_row(prompt[s : s + chunk], ref)
        m.encode_row(prompt[s : s + chunk], slot)
    for _ in range(5):  # > R / C blocks: the ring wraps several times
        canvas = torch.randint(0, V, (C,), generator=g)
        sc = torch.randn(C, V, generator=g)
        for _ in range(2):  # two steps of one block: the scratch written by the first is overwritten
            assert torch.equal(m.decode_row(ref, canvas, sc, None), m.decode_row(slot, canvas, sc, None))
        m.encode_row(canvas, ref)
        m.encode_row(canvas, slot)
    assert ref.length == slot.length == prompt_len + 5 * C
    assert slots.layer_lengths(2) == [k.shape[1] for k in ref.keys]


def test_public_prefill_grows_in_place_and_keeps_the_bits():
    """prefill in chunks that outgrow the cache (longer slots, a larger ring: reallocated, then copied) and
    denoise between them: the same cache object, the same bits as the concatenating layout, row by row."""
    m = _model(2)
    cfg = m.config
    C, V, W = cfg.canvas_length, cfg.vocab_size, cfg.sliding_window
    g = torch.Generator().manual_seed(3)
    refs = [ConcatCache(cfg), ConcatCache(cfg)]
    cache = None
    for T in (3, 5, 2 * C + W, C, C):  # the third chunk exceeds the first ring; the slots grow several times
        ids = torch.randint(0, V, (2, T), generator=g)
        before = None if cache is None else (id(cache), cache.slot_len, cache.chunk)
        out = m.prefill(ids, cache)
        assert cache is None or out is cache
        cache = out
        for b, ref in enumerate(refs):
            m.encode_row(ids[b], ref)
        if before is not None and T > before[2]:
            assert cache.chunk >= T and cache.slot_len > before[1]
        canvas = torch.randint(0, V, (2, C), generator=g)
        sc = torch.randn(2, C, V, generator=g)
        logits = m.denoise(cache, canvas, self_cond_logits=sc)
        for b, ref in enumerate(refs):
            assert torch.equal(logits[b], m.decode_row(ref, canvas[b], sc[b], None))
    assert cache.lengths == [r.length for r in refs] == [3 + 5 + 2 * C + W + 2 * C] * 2
    assert cache.layer_lengths(1) == [k.shape[1] for k in refs[1].keys]


def test_stack_copies_rows_of_different_lengths():
    m = _model(4)
    V = m.config.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (1, n), generator=g) for n in (2, 30)]
    caches = [m.prefill(p) for p in prompts]
    stacked = SlotCache.stack(caches)
    assert stacked.num_slots == 2 and stacked.lengths == [2, 30]
    for b, c in enumerate(caches):
        assert stacked.layer_lengths(b) == c.layer_lengths(0)
        for layer in range(m.config.num_hidden_layers):
            n = c.lengths[0]
            start = c.visible_start(layer, n)
            for x, y in zip(stacked.read(b, layer, start, n), c.read(0, layer, start, n), strict=True):
                assert torch.equal(x, y)


def test_row_count_must_match_the_cache():
    m = _model()
    cache = m.prefill(torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="3 rows but the cache has 2"):
        m.prefill(torch.zeros(3, 4, dtype=torch.int64), cache)
    with pytest.raises(ValueError, match="1 rows but the cache has 2"):
        m.denoise(cache, torch.zeros(1, m.config.canvas_length, dtype=torch.int64))


def test_cached_span_names_the_positions_of_the_cached_view():
    """``SlotCache.cached_span`` (the stacked decoder's form for ``ops.decode_attention``) points at exactly the
    positions ``SlotView.cached_kv`` views, on full layers and on sliding rings before and after they wrap."""
    cfg = preset("tiny")
    W = cfg.sliding_window
    c = SlotCache(cfg, 3, 200, 16, torch.float32, torch.device("cpu"))
    c.keys = [torch.randn(k.shape) for k in c.keys]
    for length in (0, 3, W - 1, W + 5, 3 * W + 7):
        c.lengths[1] = length
        for layer in range(cfg.num_hidden_layers):
            slot, start, count = c.cached_span(1, layer)
            kc, _ = c.view(1).cached_kv(layer)
            assert slot == 1 and torch.equal(c.keys[layer][slot, :, start : start + count], kc), (length, layer)
