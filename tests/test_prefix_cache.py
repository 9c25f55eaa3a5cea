"""Prefix caching (docs/prefix-caching.md): the block keys, the LRU-of-leaves eviction, the slot copies, and the
promise that matters: a request's tokens are the same with or without reuse, alone or batched, with reuse ending at
every chunk boundary, inside the sliding layers' rings, and against transformers on the parity fixtures."""

from __future__ import annotations

import pytest
import torch
from hf_reference import Margins, hf_generate

from dgserve import Engine, SamplingParams
from dgserve.engine.cache_config import CacheConfig
from dgserve.engine.prefix_cache import PrefixCache, prefix_hashes
from dgserve.engine.prompt import Submission
from dgserve.engine.scheduler import SchedulerConfig
from dgserve.model.cache import SlotCache

CHUNK = 4  # prefill chunk of the engines below: many chunk boundaries in short prompts


def _engine(path, prefix_caching=True, chunk=CHUNK, **kw) -> Engine:
    sched = SchedulerConfig(max_num_seqs=8, prefill_chunk=chunk, max_prefill_tokens=chunk)
    kw.setdefault("cache_config", CacheConfig(memory=64 << 20))
    return Engine.from_pretrained(path, scheduler_config=sched, prefix_caching=prefix_caching, **kw)


def _params(seed: int, **kw) -> SamplingParams:
    kw = {"max_new_tokens": 20, "max_denoising_steps": 6, "t_min": 0.4, "t_max": 0.8, "seed": seed} | kw
    return SamplingParams(**kw)


# ---------------------------------------------------------------------------------------------------- keys


def test_keys_chain_over_whole_blocks_and_are_salted():
    ids = list(range(3, 14))  # 11 tokens: two full blocks of 4, the partial third has no key
    keys = prefix_hashes(ids, 4)
    assert len(keys) == 2 and len(set(keys)) == 2
    assert prefix_hashes(ids[:8], 4) == keys  # a key names its prefix, nothing after it
    other = prefix_hashes([99, *ids[1:]], 4)
    assert other[0] != keys[0] and other[1] != keys[1]  # a change in block 0 changes every later key
    assert prefix_hashes(ids[:4] + [98, *ids[5:]], 4)[0] == keys[0]
    assert prefix_hashes(ids, 4, "alice") != keys  # callers never share keys...
    assert prefix_hashes(ids, 4, "alice") != prefix_hashes(ids, 4, "bob")
    assert prefix_hashes(ids, 4, "") != keys  # ...and the empty identity is not "no identity"
    assert prefix_hashes(ids[:3], 4) == ()


def _kv(x: float):
    return [torch.full((1, 2, 1), x)], [torch.full((1, 2, 1), -x)]


def _full_only(capacity_bytes: int) -> PrefixCache:
    """Blocks of 2 tokens, 10 bytes, one full-attention layer."""
    return PrefixCache(2, [10], [False], 8, capacity_bytes)


def test_match_returns_the_longest_cached_run_and_counts_tokens():
    pc = _full_only(100)
    a, b, c = prefix_hashes([5, 6, 7, 8, 9, 10], 2)
    assert pc.store(a, None, *_kv(1)) and pc.store(b, a, *_kv(2)) and pc.store(c, b, *_kv(3))
    hit = pc.match([a, b, c], 7)
    assert [float(k[0][0, 0, 0]) for k, _ in hit] == [1, 2, 3]
    other = prefix_hashes([5, 6, 0, 0], 2)
    assert len(pc.match(other, 4)) == 1
    assert pc.match(prefix_hashes([1, 1], 2), 2) == []
    assert (pc.queried_tokens, pc.hit_tokens) == (13, 8)
    assert pc.held_bytes == 30 and len(pc) == 3


def test_eviction_takes_the_least_recently_used_leaf_and_never_orphans_a_block():
    pc = _full_only(35)  # room for 3 blocks
    a, b = prefix_hashes([1, 2, 3, 4], 2)
    x = prefix_hashes([7, 7], 2)[0]
    assert pc.store(a, None, *_kv(1)) and pc.store(b, a, *_kv(2)) and pc.store(x, None, *_kv(3))
    pc.match([a], 2)  # a is now the most recent, but it has a child: b goes before it
    y = prefix_hashes([8, 8], 2)[0]
    assert pc.store(y, None, *_kv(4))
    assert a in pc and b not in pc and x in pc and y in pc  # b (LRU leaf) went, not x, and a is no orphan maker
    assert pc.evicted_blocks == 1 and pc.held_bytes == 30
    # a block whose parent is gone is not kept (it could never be reached)
    assert not pc.store(prefix_hashes([1, 2, 3, 4, 5, 6], 2)[2], b, *_kv(5))
    # the parent of the block being stored is never the one evicted for it
    pc2 = _full_only(10)
    assert pc2.store(a, None, *_kv(1))
    assert not pc2.store(b, a, *_kv(2)) and a in pc2


def test_no_room_caches_nothing():
    pc = _full_only(9)
    assert not pc.store(prefix_hashes([1] * 2, 2)[0], None, *_kv(1))
    assert len(pc) == 0 and pc.held_bytes == 0


def test_the_cache_yields_to_the_room_the_process_has_left():
    """With a room reading, a store first frees blocks until it leaves ``min_room``; with none to free it stores
    nothing. Capacity alone would hold all four."""
    free = [100]
    pc = PrefixCache(2, [10], [False], 2, capacity_bytes=1000, room=lambda: free[0], min_room=70)
    keys = [prefix_hashes([i, i], 2)[0] for i in range(4)]
    assert pc.store(keys[0], None, *_kv(0)) and pc.store(keys[1], None, *_kv(1))  # 100 − 10 ≥ 70
    free[0] = 75  # the process grew: storing would leave 65 < 70, so the least recent block goes first
    assert pc.store(keys[2], None, *_kv(2)) and keys[0] not in pc and pc.evicted_blocks == 1
    free[0] = 20  # 60 short, 20 to give: everything goes, and still no room
    assert not pc.store(keys[3], None, *_kv(3)) and len(pc) == 0 and pc.held_bytes == 0
    free[0] = None  # unreadable: capacity alone decides
    assert pc.store(keys[3], None, *_kv(3))


def _anon_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("RssAnon:"))


def test_page_backed_blocks_give_their_pages_back():
    """Host blocks live in maps of their own: evicting one, or dropping its sliding part, returns its pages at
    once (the resident set falls by its size), and the copies hold the slot's values."""
    mib = 1 << 20
    k = [torch.full((1, 2, 4 * mib), float(i)) for i in range(2)]  # 32 MiB per tensor, 64 MiB per layer
    v = [torch.full((1, 2, 4 * mib), -float(i)) for i in range(2)]
    layer = 2 * k[0].nbytes
    pc = PrefixCache(2, [layer, layer], [True, False], 2, capacity_bytes=3 * layer, page_backed=True)
    a, b = prefix_hashes([1, 1], 2)[0], prefix_hashes([2, 2], 2)[0]
    before = _anon_mib()
    assert pc.store(a, None, k, v)
    assert _anon_mib() - before > 120  # 128 MiB copied
    (hit,) = pc.match([a], 2)
    assert all(torch.equal(x, y) for x, y in zip(hit[0] + hit[1], k + v, strict=True))
    assert hit[0][0].data_ptr() != k[0].data_ptr()
    del hit
    assert pc.store(b, None, k, v)  # 256 MiB > 192: block a (LRU leaf) is evicted
    assert a not in pc and 120 < _anon_mib() - before < 136
    pc._free_some(keep=None)  # b is a leaf: evicted whole
    assert len(pc) == 0 and _anon_mib() - before < 8


def _two_layers(x: float):
    """Keys/values of a block on two layers: layer 0 sliding, layer 1 full."""
    return [torch.full((1, 2, 1), x), torch.full((1, 2, 1), x + 0.5)], [torch.full((1, 2, 1), -x)] * 2


def test_under_pressure_inner_blocks_drop_their_sliding_part_before_anything_is_evicted():
    # blocks of 2 tokens: 6 bytes on the sliding layer (W = 3: a prefix needs it in its last block only) + 4 full
    pc = PrefixCache(2, [6, 4], [True, False], 3, capacity_bytes=34)
    keys = prefix_hashes(list(range(3, 11)), 2)  # a chain of 4 blocks
    assert pc.store(keys[0], None, *_two_layers(0)) and pc.store(keys[1], keys[0], *_two_layers(1))
    assert pc.store(keys[2], keys[1], *_two_layers(2))  # 30 bytes held
    assert pc.store(keys[3], keys[2], *_two_layers(3))  # 40 > 34: block 0 (LRU, inner) drops its sliding part
    assert pc.dropped_sliding == 1 and pc.evicted_blocks == 0 and pc.held_bytes == 34 and len(pc) == 4
    # a prompt ending after block 0 can no longer be restored from it, one ending later can
    assert pc.match(keys[:1], 2) == []
    hit = pc.match(keys[:2], 4)
    assert len(hit) == 2 and hit[0][0][0] is None and hit[0][0][1] is not None and hit[1][0][0] is not None
    assert len(pc.match(keys, 8)) == 4


def test_a_run_ends_where_its_window_still_has_the_sliding_part():
    # W = 5: a prefix needs the sliding part of the blocks holding its last 4 positions (two blocks of 2)
    pc = PrefixCache(2, [6, 4], [True, False], 5, capacity_bytes=1000)
    keys = prefix_hashes(list(range(3, 11)), 2)
    for i, k in enumerate(keys):
        assert pc.store(k, keys[i - 1] if i else None, *_two_layers(i))
    pc._blocks[keys[2]].sliding = False  # as if dropped
    pc._blocks[keys[2]].keys = [None, pc._blocks[keys[2]].keys[1]]
    assert len(pc.match(keys, 8)) == 2  # ends of 4 and 3 blocks need block 2's sliding part; 2 blocks do not


# ---------------------------------------------------------------------------------------------------- slot copies


@pytest.mark.parametrize("n", [4, 8, 12, 28, 44])  # within the window, past it, and past the ring's wrap (R = 23)
def test_copy_in_gives_the_slot_what_encoding_gave_it(tiny_checkpoint, n):
    from dgserve.model import DiffusionGemma

    m = DiffusionGemma.from_pretrained(tiny_checkpoint("base"))
    cfg = m.config
    ids = torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
    src = SlotCache(cfg, 1, 64, 16, m.dtype, m.device)
    blocks = []
    with torch.inference_mode():
        for p in range(0, n, CHUNK):
            m.encode_row(ids[p : p + CHUNK], src.view(0))
            blocks.append(src.copy_out(0, p, p + CHUNK))
    dst = SlotCache(cfg, 2, 64, 16, m.dtype, m.device, zero=True)
    dst.copy_in(1, blocks, CHUNK)
    assert dst.lengths[1] == n
    for layer in range(cfg.num_hidden_layers):  # what the next pass sees: identical bits
        start = src.visible_start(layer, n)
        for a, b in zip(src.read(0, layer, start, n), dst.read(1, layer, start, n), strict=True):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------- exactness


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    path = tiny_checkpoint("base")
    return _engine(path, prefix_caching=False), path


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_reuse_ending_at_every_chunk_boundary_gives_the_same_tokens(engines):
    cold, path = engines
    prompt = _prompt(47, 1)  # 11 full chunks: boundaries inside the window (W − 1 = 7) and past the ring (23)
    want = cold.generate(prompt, _params(7))
    warm = _engine(path)
    assert warm.runner.prefix is not None
    for k in range(1, len(prompt) // CHUNK + 1):
        warm.runner.prefix.clear()
        warm.generate(prompt[: k * CHUNK] + _prompt(5, 100 + k), _params(3, max_new_tokens=4))  # shares k chunks
        got = warm.generate(prompt, _params(7))
        assert got.cached_tokens == k * CHUNK, k
        assert got.token_ids == want.token_ids, f"reuse of {k} chunks changed the tokens"
        assert got.finish_reason == want.finish_reason


def test_whole_prompt_cached_and_batched_with_others(engines):
    cold, path = engines
    prompts = [_prompt(32, 2), _prompt(32, 2)[:24] + _prompt(9, 3), _prompt(13, 4)]
    params = [_params(11), _params(12, max_new_tokens=33), _params(13)]
    want = [cold.generate(p, sp).token_ids for p, sp in zip(prompts, params, strict=True)]
    warm = _engine(path)
    warm.generate(prompts[0], _params(1, max_new_tokens=4))  # caches all 8 chunks of prompt 0
    got = warm.generate_batch(prompts, params)
    assert [r.cached_tokens for r in got] == [32, 24, 0]  # a whole prompt, a shared head, nothing
    assert [r.token_ids for r in got] == want
    again = warm.generate_batch(prompts, params)  # now every full chunk of every prompt is cached
    assert [r.cached_tokens for r in again] == [32, 32, 12]
    assert [r.token_ids for r in again] == want


def test_callers_do_not_share_blocks(engines):
    _, path = engines
    warm = _engine(path)
    prompt = _prompt(20, 5)
    first = warm.add(warm.make_request(Submission(prompt, _params(1), owner="alice")))
    while not first.finished:
        warm.step()
    for owner, hit in (("bob", 0), (None, 0), ("alice", 20)):
        req = warm.add(warm.make_request(Submission(prompt, _params(1), owner=owner)))
        while not req.finished:
            warm.step()
        assert req.cached_tokens == hit, owner


def test_turned_off_or_without_room_nothing_is_reused(engines):
    cold, path = engines
    prompt = _prompt(20, 6)
    for e in (
        cold,
        _engine(
            path,
            cache_config=CacheConfig(
                memory=SlotCache.bytes_per_slot(cold.model.config, cold.max_model_len, 16, cold.model.dtype) * 8
            ),
        ),
    ):
        e.generate(prompt, _params(1))
        assert e.generate(prompt, _params(1)).cached_tokens == 0
    assert cold.runner.prefix is None


def test_eviction_under_pressure_keeps_results_exact(engines):
    cold, path = engines
    block = CHUNK * SlotCache.position_bytes(cold.model.config, cold.model.dtype)
    slots = 8 * SlotCache.bytes_per_slot(cold.model.config, cold.max_model_len, 16, cold.model.dtype)
    e = _engine(path, cache_config=CacheConfig(memory=slots + 5 * block))  # room for 5 whole blocks
    prefix = e.runner.prefix
    assert prefix is not None and prefix.capacity_bytes == 5 * block
    prompts = [_prompt(24, 20 + i) for i in range(3)]  # 6 blocks each
    for _ in range(2):
        for i, p in enumerate(prompts):
            hit = prefix.hit_tokens
            r = e.generate(p, _params(i))
            assert r.token_ids == cold.generate(p, _params(i)).token_ids
            assert r.cached_tokens == prefix.hit_tokens - hit
            assert prefix.held_bytes <= prefix.capacity_bytes
    assert prefix.evicted_blocks > 0 and prefix.dropped_sliding > 0


def test_reuse_from_blocks_without_their_sliding_part_is_exact(engines):
    """A long shared head whose inner blocks gave up their sliding part (pressure) still restores exactly."""
    cold, path = engines
    e = _engine(path)
    prefix = e.runner.prefix
    assert prefix is not None
    head = _prompt(40, 30)
    e.generate(head, _params(1, max_new_tokens=4))  # 10 blocks of 4
    while prefix._free_some(keep=None) and prefix.dropped_sliding < 8:  # strip the inner blocks
        pass
    assert prefix.dropped_sliding == 8 and prefix.evicted_blocks == 0
    for tail_seed, n in ((31, 5), (32, 13)):
        prompt = head + _prompt(n, tail_seed)
        got = e.generate(prompt, _params(2))
        # W − 1 = 7 positions: the prefix's last two blocks (8 .. 9) kept their sliding part
        assert got.cached_tokens == 40
        assert got.token_ids == cold.generate(prompt, _params(2)).token_ids


# ---------------------------------------------------------------------------------------------------- parity


def test_reused_prefix_matches_transformers_generate(tiny_checkpoint, hf_model_loader):
    """The parity fixtures' check (transformers' generate with the noise contract, margins away from near-ties)
    on prompts whose head the engine has cached: reuse ends at every chunk boundary of the prompt."""
    path = tiny_checkpoint("base")
    hf = hf_model_loader(path, torch.float32, attn="sdpa")
    engine = _engine(path)
    g = torch.Generator().manual_seed(42)
    case = dict(max_new_tokens=20, steps=8, t_min=0.4, t_max=0.8, entropy_bound=0.1)
    for seed, n in ((0, 29), (2**40 + 3, 45)):
        prompt = torch.randint(3, 300, (n,), generator=g).tolist()
        margins = Margins()
        ref, _ = hf_generate(
            hf,
            prompt,
            seed,
            max_new_tokens=case["max_new_tokens"],
            steps=case["steps"],
            t_min=case["t_min"],
            t_max=case["t_max"],
            entropy_bound=case["entropy_bound"],
            stability_threshold=1,
            confidence_threshold=0.005,
            eos_ids=(1,),
            pad_id=0,
            margins=margins,
        )
        assert margins.worst() > 1, f"seed {seed}: near-tie {margins}"
        params = SamplingParams(
            max_new_tokens=case["max_new_tokens"],
            max_denoising_steps=case["steps"],
            t_min=case["t_min"],
            t_max=case["t_max"],
            entropy_bound=case["entropy_bound"],
            stability_threshold=1,
            confidence_threshold=0.005,
            seed=seed,
        )
        for k in range(n // CHUNK + 1):
            prefix = engine.runner.prefix
            assert prefix is not None
            prefix.clear()
            if k:
                engine.generate(prompt[: k * CHUNK] + [5, 6, 7], _params(9, max_new_tokens=4))
            res = engine.generate(prompt, params)
            assert res.cached_tokens == k * CHUNK
            assert res.token_ids == ref[: len(res.token_ids)], f"seed {seed}, reuse of {k} chunks"


def test_a_cache_salt_keeps_requests_apart(engines):
    _, path = engines
    warm = _engine(path)
    prompt = _prompt(20, 7)

    def run(**kw) -> int:
        req = warm.add(warm.make_request(Submission(prompt, _params(1), **kw)))
        while not req.finished:
            warm.step()
        return req.cached_tokens

    assert run(cache_salt="team-a") == 0
    assert run() == 0 and run(cache_salt="team-b") == 0 and run(owner="x", cache_salt="team-a") == 0
    assert run(cache_salt="team-a") == 20 and run() == 20
    for bad in ("", "x" * 257):
        with pytest.raises(ValueError, match="cache_salt"):
            warm.make_request(Submission(prompt, _params(1), cache_salt=bad))
