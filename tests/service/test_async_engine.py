"""AsyncEngine and Engine scheduling without gRPC: slow consumers (docs/architecture.md, "Service behaviours", row 16),
chunked prefill (row 19),
deadlines in the queue, abort bookkeeping."""

from __future__ import annotations

import asyncio
import time

import pytest

from dgserve import Engine, SamplingParams
from dgserve.engine.async_engine import AsyncEngine, DraftSpec, EngineObserver, Finished, StreamStalledError
from dgserve.engine.prompt import Submission
from dgserve.engine.scheduler import SchedulerConfig
from dgserve.outputs import BlockOutput


class Counting(EngineObserver):
    def __init__(self):
        self.dropped = 0
        self.aborts = []

    def on_draft_dropped(self):
        self.dropped += 1

    def on_abort(self, reason):
        self.aborts.append(reason)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_slow_reader_keeps_every_block_and_drops_drafts(model_dir):
    """docs/architecture.md, "Service behaviours", row 16: a reader that stops reading loses drafts (latest wins), never
    committed blocks."""
    engine = Engine.from_pretrained(model_dir)
    obs = Counting()

    async def main():
        ae = AsyncEngine(engine, observer=obs, stall_timeout_s=1e9)
        ae.start()
        p = SamplingParams(max_new_tokens=80, max_denoising_steps=6, seed=3, ignore_eos=True)
        stream = await ae.submit(Submission([2, 40, 41], p, drafts=DraftSpec()))
        # the reader sleeps while the request runs to the end (polling the engine thread: no event to await)
        while engine.has_unfinished():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        events = [e async for e in stream]
        await ae.stop()
        return events

    events = run(main())
    blocks = [e for e in events if isinstance(e, BlockOutput)]
    assert [b.index for b in blocks] == list(range(5)) and isinstance(events[-1], Finished)
    ref = engine.generate(
        [2, 40, 41], SamplingParams(max_new_tokens=80, max_denoising_steps=6, seed=3, ignore_eos=True)
    )
    assert [t for b in blocks for t in b.token_ids] == ref.token_ids
    assert obs.dropped >= 20  # 5 blocks × 5 drafts each, all but the unread last one replaced or cleared


def test_stalled_reader_is_aborted(model_dir):
    engine = Engine.from_pretrained(model_dir)
    obs = Counting()

    async def main():
        ae = AsyncEngine(engine, observer=obs, stall_timeout_s=0.2)
        ae.start()
        p = SamplingParams(max_new_tokens=16 * 250, max_denoising_steps=2, seed=1, ignore_eos=True)
        stream = await ae.submit(Submission([2, 5], p))
        t0 = time.monotonic()
        while engine.has_unfinished() and time.monotonic() - t0 < 30:  # noqa: ASYNC110 - polls the engine thread
            await asyncio.sleep(0.05)
        got = []
        with pytest.raises(StreamStalledError):
            async for e in stream:
                got.append(e)  # noqa: PERF401 - a comprehension would lose what arrived before the error
        await ae.stop()
        return got

    got = run(main())
    assert "stalled" in obs.aborts and len(got) >= 2 and not engine.has_unfinished()


def test_chunked_prefill_equals_whole_prompt(model_dir):
    """A long prompt encoded in 64-token chunks gives the same tokens as encoded at once."""
    prompt = [2] + [(7 * i) % 290 + 5 for i in range(300)]
    p = SamplingParams(max_new_tokens=32, max_denoising_steps=5, seed=4, ignore_eos=True)
    whole = Engine.from_pretrained(model_dir).generate(prompt, p)
    chunked = Engine.from_pretrained(
        model_dir, scheduler_config=SchedulerConfig(prefill_chunk=64, max_prefill_tokens=64)
    )
    assert chunked.generate(prompt, p).token_ids == whole.token_ids


def test_long_prompt_does_not_stall_running_streams(model_dir):
    """docs/architecture.md, "Service behaviours", row 19: while a 1200-token prompt prefills in chunks, a running
    request takes a denoising step in
    every engine iteration and its output is unchanged."""
    eng = Engine.from_pretrained(model_dir, scheduler_config=SchedulerConfig(prefill_chunk=128, max_prefill_tokens=128))
    p = SamplingParams(max_new_tokens=48, max_denoising_steps=4, seed=2, ignore_eos=True)
    alone = eng.generate([2, 9, 10], p)
    streaming = eng.add_request([2, 9, 10], p)
    eng.step()
    huge = eng.add(
        eng.make_request(
            Submission([2] + [11] * 1200, SamplingParams(max_new_tokens=16, max_denoising_steps=2, seed=0))
        )
    )
    blocks = []
    while eng.has_unfinished():
        alive = streaming in eng.scheduler
        before = huge.prefilled
        out = eng.step()
        assert not alive or streaming in [r.request_id for r in out.stepped]
        assert huge.prefilled - before <= 128
        blocks += [b for r, b in out.blocks if r.request_id == streaming]
    assert [t for b in blocks for t in b.token_ids] == alone.token_ids


def test_deadline_in_queue_drops_without_work(model_dir):
    eng = Engine.from_pretrained(model_dir, scheduler_config=SchedulerConfig(max_num_seqs=1))
    p = SamplingParams(max_new_tokens=16, max_denoising_steps=3, seed=1)
    eng.add_request([2, 5], p, "first")
    eng.add_request([2, 6], p, "late", deadline=time.monotonic() - 1)
    out = eng.step()
    assert ("late", "cancelled") in [(r.request_id, b.finish_reason) for r, b in out.blocks]
    late = next(r for r, _ in out.blocks if r.request_id == "late")
    assert late.finished and late.result().token_ids == [] and [r.request_id for r in out.admitted] == ["first"]
