"""Request lifecycle on a real server: duplicate ids, overload, cancellation, deadlines, Abort
(docs/architecture.md, "Service behaviours", rows 8, 9, 12-15). The shared server has 4 running slots and a queue of
4."""

from __future__ import annotations

import grpc
import pytest
from service_helpers import HANG_GUARD_S, long_params, params, wait_until

from dgserve.v1 import text_generation_pb2 as pb


@pytest.fixture
def idle(server):
    """The server is idle before and after the test; yields (server, metrics)."""
    wait_until(lambda: not server.engine.engine.has_unfinished())
    yield server, server.server.metrics
    wait_until(lambda: not server.engine.engine.has_unfinished())


def start_long(stub, request_id: str = "", **kw):
    call = stub.Generate(pb.GenerateRequest(request_id=request_id, prompt="long", params=long_params(**kw)))
    first = next(call)
    assert first.HasField("started")
    return call


def fill_slots(stub, n=4):
    return [start_long(stub, seed=i) for i in range(n)]


def test_duplicate_in_flight_request_id(stub, idle):
    """docs/architecture.md, "Service behaviours", row 8: ALREADY_EXISTS; the original stream is unaffected."""
    call = start_long(stub, "dup-id")
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(request_id="dup-id", prompt="x", params=params())))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "dup-id" in e.value.details()
    for _ in range(2):
        assert next(call).HasField("block")
    call.cancel()


def test_overload_rejects_at_once_with_retry_pushback(stub, idle):
    """docs/architecture.md, "Service behaviours", row 9: slots + queue full → RESOURCE_EXHAUSTED with
    grpc-retry-pushback-ms and RetryInfo;
    the queued requests still complete; the queue beyond the free slots never exceeds max_queue_len."""
    server, m = idle
    reqs = [
        pb.GenerateRequest(
            prompt=f"load {i}", params=params(seed=i, max_new_tokens=256, max_denoising_steps=6, ignore_eos=True)
        )
        for i in range(8)
    ]
    calls = [stub.Generate(r) for r in reqs]
    wait_until(lambda: server.engine.num_running + server.engine.num_waiting == 8)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prompt="one too many", params=params())))
    err = e.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue_len 4" in err.details()
    pushback = dict(err.trailing_metadata())["grpc-retry-pushback-ms"]
    assert int(pushback) >= 1
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in rpc_status.from_call(err).details)
    # requests not yet moved into a free slot count as waiting until the next engine step: the bound is on
    # the queue beyond the free slots (running + waiting <= max_num_seqs + max_queue_len = 4 + 4)
    running, waiting = server.engine.num_running, server.engine.num_waiting
    assert running + waiting <= 8 and waiting - (4 - running) <= 4
    finished = [list(c)[-1].finished for c in calls]
    assert all(f.finish_reason == pb.FINISH_REASON_LENGTH and f.usage.completion_tokens == 256 for f in finished)


def test_cancel_mid_stream_frees_slot(stub, idle):
    """docs/architecture.md, "Service behaviours", row 12: the client cancels between blocks; the slot is freed, no more
    work, abort counted."""
    server, m = idle
    before = m.value("dgserve_request_aborted_total", {"reason": "client_cancelled"})
    call = start_long(stub)
    assert next(call).HasField("block")
    assert server.engine.num_running == 1
    call.cancel()
    # the abort is counted once the engine dropped the request: its slot is free at that moment, not some time later
    wait_until(lambda: m.value("dgserve_request_aborted_total", {"reason": "client_cancelled"}) == before + 1)
    assert server.engine.num_running == 0
    wait_until(lambda: not server.engine.engine.has_unfinished(), timeout=HANG_GUARD_S)
    with pytest.raises(grpc.RpcError) as e:
        next(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED


def test_cancel_and_abort_while_queued(stub, idle):
    """docs/architecture.md, "Service behaviours", row 12 (queued): cancelling a waiting request removes it from the
    queue without model work;
    Abort of a queued request ends its stream with Finished{CANCELLED} and no Started."""
    server, _ = idle
    running = fill_slots(stub)
    queued = stub.Generate(pb.GenerateRequest(request_id="queued-1", prompt="q", params=params()))
    aborted = stub.Generate(pb.GenerateRequest(request_id="queued-2", prompt="q", params=params()))
    wait_until(lambda: server.engine.num_waiting == 2)
    queued.cancel()
    wait_until(lambda: server.engine.num_waiting == 1)
    assert stub.Abort(pb.AbortRequest(request_id="queued-2")).outcome == pb.ABORT_OUTCOME_CANCELLED
    events = list(aborted)
    assert [e.WhichOneof("event") for e in events] == ["finished"]
    assert events[0].finished.finish_reason == pb.FINISH_REASON_CANCELLED
    assert server.engine.num_waiting == 0 and server.engine.num_running == 4
    for c in running:
        c.cancel()


def test_deadline_mid_stream(stub, idle):
    """docs/architecture.md, "Service behaviours", row 13: DEADLINE_EXCEEDED; engine work stops as for a cancel."""
    server, m = idle
    before = m.value("dgserve_request_aborted_total", {"reason": "deadline"})
    call = stub.Generate(pb.GenerateRequest(prompt="slow", params=long_params()), timeout=0.5)
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # as for a cancel: the slot is free once the abort is counted
    wait_until(lambda: m.value("dgserve_request_aborted_total", {"reason": "deadline"}) == before + 1)
    assert server.engine.num_running == 0


class _DeadlineContext:
    """The one thing the servicer reads of a grpc context when no interceptor ran: the time remaining."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def time_remaining(self) -> float:
        return self.seconds


def test_a_request_the_engine_ends_after_the_deadline_answers_deadline_exceeded(idle, monkeypatch):
    """docs/architecture.md, "Service behaviours", row 13, when grpc's own cancel at the deadline does not reach the
    request first (a loaded machine): the engine ends it at its backstop, and the finish it then sends is not an OK
    but DEADLINE_EXCEEDED. With no grace, the engine's end comes right at the deadline: the servicer (here without
    grpc, so nothing else ends the call) must still answer the deadline's way."""
    from service.errors import DeadlineExceededError
    from service.grpc import interceptors
    from service.grpc.errors import classify
    from service.grpc.servicer import TextGenerationServicer

    server, _ = idle
    monkeypatch.setattr(interceptors, "DEADLINE_GRACE_S", 0.0)
    servicer = TextGenerationServicer(server.server.state)
    request = pb.GenerateRequest(prompt="slow", params=long_params())

    async def run():
        return [r async for r in servicer.Generate(request, _DeadlineContext(0.3))]

    with pytest.raises(DeadlineExceededError) as e:
        server.call(run, timeout=30)
    assert classify(e.value)[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert server.engine.num_running == 0  # the engine freed the slot when it ended the request, before its finish


def test_deadline_shorter_than_queue_wait(stub, idle):
    """docs/architecture.md, "Service behaviours", row 14: DEADLINE_EXCEEDED; the request leaves the queue without ever
    starting."""
    server, m = idle
    running = fill_slots(stub)
    started_before = m.value("dgserve_request_queue_time_seconds_count")
    events = []
    with pytest.raises(grpc.RpcError) as e:
        for ev in stub.Generate(pb.GenerateRequest(prompt="late", params=params()), timeout=0.4):
            events.append(ev)  # noqa: PERF402 - list() would lose what arrived before the error
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and events == []
    # it leaves the queue (the event), by the cancel or the scheduler's expiry, whichever comes first on a loaded
    # machine; the guard only prevents a hang. That it never started is the queue-time count below.
    wait_until(lambda: server.engine.num_waiting == 0, timeout=HANG_GUARD_S)
    assert m.value("dgserve_request_queue_time_seconds_count") == started_before
    for c in running:
        c.cancel()


def test_abort_running_stream(stub, idle):
    """docs/architecture.md, "Service behaviours", row 15: Abort → OK (CANCELLED); the stream ends with
    Finished{CANCELLED}; a second Abort
    → OK (ALREADY_FINISHED); an unknown id → NOT_FOUND."""
    server, m = idle
    call = start_long(stub, "abort-me")
    assert next(call).HasField("block")
    assert stub.Abort(pb.AbortRequest(request_id="abort-me")).outcome == pb.ABORT_OUTCOME_CANCELLED
    rest = list(call)
    assert rest[-1].finished.finish_reason == pb.FINISH_REASON_CANCELLED
    assert all(e.HasField("block") for e in rest[:-1])
    assert stub.Abort(pb.AbortRequest(request_id="abort-me")).outcome == pb.ABORT_OUTCOME_ALREADY_FINISHED
    wait_until(lambda: server.engine.num_running == 0)
    done = list(stub.Generate(pb.GenerateRequest(request_id="done-id", prompt="x", params=params(max_new_tokens=1))))
    assert done[-1].HasField("finished")
    assert stub.Abort(pb.AbortRequest(request_id="done-id")).outcome == pb.ABORT_OUTCOME_ALREADY_FINISHED
    with pytest.raises(grpc.RpcError) as e:
        stub.Abort(pb.AbortRequest(request_id="no-such-id"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_many_cancels_keep_memory_flat(stub, idle):
    """docs/architecture.md, "Service behaviours", row 12 (memory, grpc#43360): hundreds of streams cancelled mid-stream
    leave no growth behind."""
    server, _ = idle

    def cycle(n):
        for i in range(n):
            call = stub.Generate(pb.GenerateRequest(prompt="cancel me", params=long_params(seed=i)))
            next(call)
            call.cancel()
        wait_until(lambda: not server.engine.engine.has_unfinished(), timeout=10)

    cycle(100)  # warm-up: allocator pools, channel state
    rss0 = _rss_mb()
    cycle(300)
    assert _rss_mb() - rss0 < 30
    assert server.engine.num_running == 0 and server.engine.num_in_flight == 0
