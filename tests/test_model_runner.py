"""ModelRunner and its slot cache (the layout's bitwise checks: tests/test_kv_cache.py): dense slot packing keeps
requests exact; the KV cache budget decides the slots and rejects a request that can never fit."""

from __future__ import annotations

import pytest
import torch

from dgserve import DiffusionGemma, Engine, SamplingParams
from dgserve.config import ConfigError
from dgserve.engine.cache_config import CacheConfig
from dgserve.engine.model_runner import ModelRunner
from dgserve.engine.prompt import Submission
from dgserve.engine.scheduler import SchedulerConfig
from dgserve.model.cache import SlotCache
from dgserve.model.tiny import preset, random_weights


def test_packing_keeps_tokens_exact(tiny_checkpoint):
    """Requests finishing at different blocks move the last slot into the hole; the others' tokens do not change."""
    path = tiny_checkpoint("base")
    eng = Engine.from_pretrained(path, scheduler_config=SchedulerConfig(max_num_seqs=3))
    prompts = [[5, 6, 7], list(range(3, 30)), [9], [4, 4, 4, 4]]
    params = [
        SamplingParams(max_new_tokens=n, max_denoising_steps=4, seed=s, ignore_eos=True)
        for n, s in ((16, 1), (64, 2), (32, 3), (48, 4))
    ]
    alone = [eng.generate(p, sp).token_ids for p, sp in zip(prompts, params, strict=True)]
    assert [r.token_ids for r in eng.generate_batch(prompts, params)] == alone
    assert eng.runner.occupants == [] and eng.runner.num_slots == 3


def test_batched_slots_match_per_row(tiny_checkpoint):
    """The in-place batched pass (forced on CPU) gives the per-row tokens (fp32: ~1e-7 apart in logits)."""
    path = tiny_checkpoint("wide")
    ref = Engine.from_pretrained(path)
    m = DiffusionGemma.from_pretrained(path)
    m.batch_rows = True
    eng = Engine(m)
    prompts = [[5, 6, 7], list(range(3, 30)), [9]]
    params = [SamplingParams(max_new_tokens=48, max_denoising_steps=4, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    assert [r.token_ids for r in eng.generate_batch(prompts, params)] == [
        r.token_ids for r in ref.generate_batch(prompts, params)
    ]


def test_cache_budget_decides_slots_and_rejects_what_never_fits():
    cfg = preset("tiny")
    m = DiffusionGemma(cfg, random_weights(cfg, 0), torch.float32)
    per_slot = SlotCache.bytes_per_slot(cfg, 4096, 512, torch.float32)
    eng = Engine(m, cache_config=CacheConfig(memory=3 * per_slot + 1))
    assert eng.runner.num_slots == 3 and eng.scheduler.config.max_num_seqs == 3
    small = Engine(m, cache_config=CacheConfig(memory=per_slot // 2))  # less than one full slot
    assert small.runner.num_slots == 1 and cfg.canvas_length < small.runner.slot_len < 4096
    fits = small.runner.slot_len - cfg.canvas_length
    assert small.generate([5] * fits, SamplingParams(max_new_tokens=16, max_denoising_steps=2, seed=0)).token_ids
    with pytest.raises(ValueError, match="KV cache budget"):
        small.add_request([5] * (fits + 1), SamplingParams(max_new_tokens=16))
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        Engine(m, cache_config=CacheConfig(memory=1000))


@pytest.mark.parametrize(
    "text, memory, fraction",
    [("2GiB", 2 << 30, 0.9), ("512MB", 512 * 10**6, 0.9), ("0.5", None, 0.5), ("1000", 1000, 0.9)],
)
def test_cache_config_parse(text, memory, fraction):
    c = CacheConfig.parse(text)
    assert (c.memory, c.fraction) == (memory, fraction)


def test_cache_config_parse_rejects_garbage():
    with pytest.raises(ValueError, match="kv_cache_memory"):
        CacheConfig.parse("lots")


def test_runner_knobs_are_rows_of_slot_tables():
    """Admission writes a request's knob rows once; the step reads a prefix slice (a view: no copy)."""
    cfg = preset("tiny")
    m = DiffusionGemma(cfg, random_weights(cfg, 0), torch.float32)
    runner = ModelRunner(m, 4, 256, 16, CacheConfig(memory=1 << 24))
    rows = runner._rows([0, 1])
    assert rows == slice(0, 2)
    assert runner.knobs.rows(rows).seed.data_ptr() == runner.knobs.seed.data_ptr()
    assert isinstance(runner._rows([1, 0]), torch.Tensor)


def test_one_record_steps_left_goes_down_once_per_step(tiny_checkpoint):
    """The Request holds the block's progress: each engine step lowers steps_left by exactly one (the runner's one
    decrement), the runner's slot table gets k from the request before the step, and a committed block starts the
    next one at N again with the next block index."""
    eng = Engine.from_pretrained(tiny_checkpoint("base"))
    N = 5
    # stability over more steps than a block has: adaptive stopping never fires, every block runs its N steps
    C = eng.model.config.canvas_length
    params = SamplingParams(max_new_tokens=2 * C, max_denoising_steps=N, stability_threshold=N, seed=3, ignore_eos=True)
    req = eng.add(eng.make_request(Submission([5, 6, 7], params)))
    seen = []
    while not req.finished:
        out = eng.step()
        if req in out.stepped:
            slot = req.slot if req.slot is not None else 0
            used = int(eng.runner.knobs.steps_left[slot]) if req.slot is not None else None
            seen.append((req.block_index if req.block is not None else req.block_index - 1, req.steps_left, used))
    # block 0: k = 5, 4, 3, 2, 1 used; steps_left after each step 4 .. 0; the block commits at k = 1
    assert [s[1] for s in seen[:N]] == [4, 3, 2, 1, 0]
    assert [s[2] for s in seen[: N - 1]] == [5, 4, 3, 2]
    assert [s[0] for s in seen] == [0] * N + [1] * N
    assert [b.stats.denoising_steps for b in req.blocks] == [N, N]
    assert req.seed == 3 and req.params.seed == 3


def test_kv_cache_usage_is_the_held_fraction(tiny_checkpoint):
    """Positions the occupied slots hold over every slot's positions (without prefix caching): the prompts once
    admitted, growing with each committed block, 0 again when the requests are done (the metrics gauge reads it:
    docs/deployment.md)."""
    eng = Engine.from_pretrained(
        tiny_checkpoint("base"), scheduler_config=SchedulerConfig(max_num_seqs=2), prefix_caching=False
    )
    r = eng.runner
    assert eng.kv_cache_usage() == 0.0
    prompts = [[5, 6, 7], list(range(3, 30))]
    sp = SamplingParams(max_new_tokens=48, max_denoising_steps=2, seed=1, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, sp)
    eng.step()
    capacity = r.num_slots * r.slot_len
    assert eng.kv_cache_usage() == pytest.approx(sum(map(len, prompts)) / capacity, rel=1e-12)
    seen = [eng.kv_cache_usage()]
    while eng.has_unfinished():
        eng.step()
        seen.append(eng.kv_cache_usage())
    assert max(seen) > seen[0] and all(0 <= u <= 1 for u in seen) and seen[-1] == 0.0


def test_requests_aborted_after_the_last_release_still_free_their_slots(tiny_checkpoint):
    """A request aborted while a step runs, after that step freed the finished slots (another thread's cancel), leaves
    the scheduler empty but its slot held: the engine still has work (``has_unfinished``) until a step frees it,
    so an idle server's KV gauge returns to 0 and holds no request."""
    eng = Engine.from_pretrained(
        tiny_checkpoint("base"), scheduler_config=SchedulerConfig(max_num_seqs=2), prefix_caching=False
    )
    sp = SamplingParams(max_new_tokens=48, max_denoising_steps=2, seed=1, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in ([5, 6, 7], [8, 9])]
    eng.step()
    assert len(eng.runner.occupants) == 2 and eng.kv_cache_usage() > 0
    for rid in ids:  # as if cancelled from the event loop just after the step's last slot release
        assert eng.abort(rid) is not None
    assert eng.num_running == eng.num_waiting == 0
    assert eng.has_unfinished()  # the two slots still to free
    eng.step()
    assert eng.runner.occupants == [] and eng.kv_cache_usage() == 0.0 and not eng.has_unfinished()


def test_kv_cache_usage_counts_the_prefix_cache_blocks(tiny_checkpoint):
    """With prefix caching the budget has two parts: what a finished request leaves in the prefix cache still
    counts (its blocks, over the slots' bytes plus the prefix cache's capacity)."""
    sched = SchedulerConfig(max_num_seqs=2, prefill_chunk=4, max_prefill_tokens=4)
    eng = Engine.from_pretrained(
        tiny_checkpoint("base"), scheduler_config=sched, cache_config=CacheConfig(memory=8 << 20)
    )
    r, prefix = eng.runner, eng.runner.prefix
    assert prefix is not None and eng.kv_cache_usage() == 0.0
    eng.generate(list(range(3, 30)), SamplingParams(max_new_tokens=8, max_denoising_steps=2, seed=1))
    assert len(prefix) == 27 // 4
    want = prefix.held_bytes / (r.cache_bytes + prefix.capacity_bytes)
    assert eng.kv_cache_usage() == pytest.approx(want, rel=1e-12) and want > 0
