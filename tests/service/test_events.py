"""service/events.py: engine events → door-neutral events (units, NaN, the error path, cancellation), the draft
options' one set of bounds, the one token-id check, and both doors agreeing with them."""

from __future__ import annotations

import asyncio
import math

import pytest

from dgserve import Engine, SamplingParams
from dgserve.engine.async_engine import AsyncEngine, Draft, DraftSpec, Finished, Started, StreamStalledError
from dgserve.engine.prompt import Submission
from dgserve.engine.step_output import DraftOutput
from dgserve.outputs import FINISH_CANCELLED, FINISH_EOS, FINISH_LENGTH, BlockOutput, BlockStats
from dgserve.service import events
from dgserve.service.grpc import convert
from dgserve.service.http.openai import input as protocol
from dgserve.service.http.openai import output as responses
from dgserve.v1 import text_generation_pb2 as pb

NAN = float("nan")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


class FakeRequest:
    seed = 77


class FakeStream:
    """What Events reads of a RequestStream: the id, the request's seed, the events (or an error), cancel."""

    def __init__(self, items, error: BaseException | None = None):
        self.request_id, self.request = "r-1", FakeRequest()
        self.items, self.error, self.cancelled = list(items), error, []

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def cancel(self, reason: str = "client_cancelled") -> None:
        self.cancelled.append(reason)


def collect(stream) -> list:
    async def main():
        return [e async for e in events.Events(stream)]

    return run(main())


def block_output(index=0, steps=4, entropy=0.5) -> BlockOutput:
    return BlockOutput(index, [5, 6, 7], "abc", BlockStats(steps, 0.75, entropy, 0.002, 0.0125))


def finished(reason=FINISH_LENGTH, first=0.25) -> Finished:
    return Finished(reason, 11, 3, 1, 4, 0.5, first, 1.5)


# ---------------------------------------------------------------------------------------------- translation


def test_each_engine_event_becomes_its_door_neutral_event_in_milliseconds():
    params = SamplingParams(seed=77)
    draft = Draft(DraftOutput(0, 2, [1, 2, 3, 4], 0.125), "text")
    got = collect(FakeStream([Started("r-1", 77, 11, params, 0.5), draft, block_output(), finished()]))
    assert got == [
        events.StartEvent(77, 11, params, 500.0),
        events.DraftEvent(0, 2, [1, 2, 3, 4], 0.125, "text"),
        events.BlockEvent(0, [5, 6, 7], "abc", events.BlockReport(4, 0.75, 0.5, 2.0, 12.5)),
        events.FinishEvent(FINISH_LENGTH, events.Usage(11, 3, 1, 4), events.Timing(500.0, 250.0, 1500.0)),
    ]
    assert got[-1].usage.total_tokens == 14


def test_nan_and_infinite_figures_are_reported_as_zero():
    draft = Draft(DraftOutput(1, 1, [1], NAN), "")
    got = collect(FakeStream([draft, block_output(entropy=math.inf), finished(FINISH_CANCELLED, first=NAN)]))
    assert got[0].mean_entropy == 0.0 and got[1].stats.mean_entropy == 0.0
    assert got[2].timing.first_block_ms == 0.0 and got[2].reason == FINISH_CANCELLED


def test_a_failed_request_ends_with_one_error_event_after_its_blocks():
    """A RequestStream that failed raises its error on every read after it: Events ends at the first."""
    err = StreamStalledError("request r-1: the reader took nothing for 30 s; aborted")

    async def main():
        feed = events.Events(FakeStream([block_output()], err))
        got = []
        for _ in range(5):  # bounded: a feed that did not end would give ErrorEvents forever
            e = await anext(feed, None)
            if e is None:
                break
            got.append(e)
        return got

    got = run(main())
    assert [type(e) for e in got] == [events.BlockEvent, events.ErrorEvent] and got[1].error is err


def test_an_unknown_engine_event_is_an_error_event():
    got = collect(FakeStream([object()]))
    assert len(got) == 1 and isinstance(got[0].error, TypeError) and "unknown event object" in str(got[0].error)


def test_task_cancellation_is_not_swallowed():
    """A reader cancelled while it waits (the client went away) unwinds; it is not turned into an ErrorEvent."""
    with pytest.raises(asyncio.CancelledError):
        collect(FakeStream([], asyncio.CancelledError()))


def test_cancel_passes_the_reason_to_the_stream_and_seed_is_the_requests():
    stream = FakeStream([])
    feed = events.Events(stream)
    feed.cancel("deadline")
    feed.cancel()
    assert stream.cancelled == ["deadline", "client_cancelled"]
    assert feed.seed == 77 and feed.request_id == "r-1"


def test_a_real_request_reads_start_blocks_finish_with_consistent_usage(model_dir):
    engine = Engine.from_pretrained(model_dir)

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        p = SamplingParams(max_new_tokens=40, max_denoising_steps=3, seed=5, ignore_eos=True)
        feed = events.Events(await ae.submit(Submission([2, 40, 41], p, drafts=DraftSpec())))
        got = [e async for e in feed]
        await ae.stop()
        return feed, got

    feed, got = run(main())
    blocks = [e for e in got if isinstance(e, events.BlockEvent)]
    start, fin = got[0], got[-1]
    assert isinstance(start, events.StartEvent) and start.seed == feed.seed == 5 and start.params.seed == 5
    assert isinstance(fin, events.FinishEvent) and fin.reason == FINISH_LENGTH
    assert fin.usage == events.Usage(3, sum(len(b.token_ids) for b in blocks), len(blocks), fin.usage.denoising_steps)
    assert fin.usage.completion_tokens == 40 and fin.usage.denoising_steps == sum(
        b.stats.denoising_steps for b in blocks
    )
    assert 0 < fin.timing.first_block_ms <= fin.timing.total_ms


# ---------------------------------------------------------------------------------------------- request checks


@pytest.mark.parametrize("every", [None, 1, 7, events.MAX_DRAFT_EVERY])
def test_draft_every_n_steps_in_bounds(every):
    spec = events.draft_spec(every, True)
    assert spec == DraftSpec(every_n_steps=every or 1, include_text=True)


@pytest.mark.parametrize("every", [0, -1, events.MAX_DRAFT_EVERY + 1, True, 1.5, "2"])
def test_draft_every_n_steps_out_of_bounds_names_the_field(every):
    with pytest.raises(ValueError, match=r"^drafts\.every_n_steps must be an integer in \[1, 1024\], got "):
        events.draft_spec(every)


def test_draft_include_text_must_be_a_boolean():
    assert events.draft_spec() == DraftSpec(every_n_steps=1, include_text=False)  # None: the defaults
    for bad in ("yes", 1, 0):
        with pytest.raises(ValueError, match=r"^drafts\.include_text must be a boolean"):
            events.draft_spec(2, bad)


def test_token_ids_checked_and_copied():
    ids = [0, 5, 9]
    out = events.token_ids(ids, 10, "prompt", 8)
    assert out == ids and out is not ids
    with pytest.raises(ValueError, match=r"^prompt\[1\]: token id 10 is outside the vocabulary \[0, 10\)$"):
        events.token_ids([1, 10], 10, "prompt")
    with pytest.raises(ValueError, match=r"^x\.ids\[0\]: token id -1 is outside"):
        events.token_ids([-1], 10, "x.ids")
    with pytest.raises(ValueError, match=r"^prompt: must not be empty$"):
        events.token_ids([], 10, "prompt")


def test_token_ids_too_long_is_refused_by_its_length_alone():
    class Unreadable(list):
        def __iter__(self):
            raise AssertionError("the items were read")

    with pytest.raises(ValueError, match=r"^prompt: 9 token ids exceed the context window of 8 positions$"):
        events.token_ids(Unreadable([1] * 9), 10, "prompt", 8)


# ---------------------------------------------------------------------------------------------- the two doors


def test_both_doors_name_every_finish_reason():
    assert set(convert.FINISH_REASONS) == set(events.FINISH_REASONS)
    assert set(responses.FINISH_REASONS) == set(events.FINISH_REASONS)
    assert pb.FINISH_REASON_UNSPECIFIED not in convert.FINISH_REASONS.values()


def test_both_doors_have_the_same_draft_bounds():
    for every in (1, 1024):
        grpc_spec = convert.draft_spec(pb.DraftOptions(enabled=True, every_n_steps=every))
        http_spec = protocol._drafts({"every_n_steps": every}, stream=True)
        assert grpc_spec == http_spec == DraftSpec(every_n_steps=every)
    with pytest.raises(ValueError) as grpc_err:
        convert.draft_spec(pb.DraftOptions(enabled=True, every_n_steps=1025))
    with pytest.raises(ValueError) as http_err:
        protocol._drafts({"every_n_steps": 1025}, stream=True)
    assert (
        str(grpc_err.value) == str(http_err.value) == "drafts.every_n_steps must be an integer in [1, 1024], got 1025"
    )
    assert convert.draft_spec(pb.DraftOptions(enabled=True)) == DraftSpec(every_n_steps=1)  # proto3's 0: unset
    assert convert.draft_spec(pb.DraftOptions(enabled=False, every_n_steps=5000)) is None


def test_both_doors_check_token_ids_alike():
    with pytest.raises(ValueError) as grpc_err:
        convert.token_ids(pb.TokenIds(ids=[1, 300]), 300, 8)
    with pytest.raises(ValueError) as http_err:
        protocol.completion_request({"prompt": [1, 300]}, SamplingParams(), 300, 8)
    assert str(grpc_err.value) == "token_ids.ids[1]: token id 300 is outside the vocabulary [0, 300)"
    assert str(http_err.value) == "prompt[1]: token id 300 is outside the vocabulary [0, 300)"


@pytest.mark.parametrize(
    "reason, content, calls",
    [
        (FINISH_LENGTH, "Checking ", 1),  # cut: the piece of a marker and the cut call are dropped
        (FINISH_CANCELLED, "Checking ", 1),
        (FINISH_EOS, "Checking <", 1),  # ended on its own: a held "<" was text after all
    ],
)
def test_the_finish_rule_drops_what_a_cut_output_left_half_written(reason, content, calls):
    """One rule for every door: the parser's finish is told whether the output was cut (any reason but EOS)."""
    from dgserve.structured.chat_output import ChatOutputParser

    chat = events.ChatOutput(ChatOutputParser(True, True, b"k"))
    stats = events.BlockReport(1, 1.0, 0.0, 0.0, 0.0)
    call = '<|tool_call>call:f{"a":1}<tool_call|>'
    tail = "Checking <" if reason == FINISH_EOS else 'Checking <|tool_call>call:f{"a":"x'
    pieces = [chat.block(events.BlockEvent(0, [], call + tail[:5], stats))]
    pieces.append(chat.block(events.BlockEvent(1, [], tail[5:], stats)))
    end = chat.finish(events.FinishEvent(reason, events.Usage(3, 9, 2, 8), events.Timing(0.0, 1.0, 2.0)))
    assert "".join(p.content for p in [*pieces, end]) == content
    assert len(end.calls) == calls and sum(len(p.call_deltas) for p in [*pieces, end]) == 2 * calls
    assert end.reason == (events.FINISH_TOOL_CALLS if reason == FINISH_EOS else reason)
