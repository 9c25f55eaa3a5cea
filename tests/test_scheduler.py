"""Scheduler: admission, bounded queue, FIFO, deadlines, abort, chunked prefill planning (no model, no torch).

The scheduler holds the engine's Request objects and relies on the engine's one lock; ``Ids`` below builds
requests from (id, prompt length) and reads plans back as ids, under a lock as the engine calls it (no owner:
the keys are (None, id))."""

from __future__ import annotations

import threading

import pytest

from dgserve.engine.request import Request
from dgserve.engine.scheduler import DuplicateRequestError, QueueFullError, Scheduler, SchedulerConfig


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Plan:
    """A ScheduleOutput with request ids in place of the Request objects."""

    def __init__(self, out):
        self.admitted = [r.request_id for r in out.admitted]
        self.expired = [r.request_id for r in out.expired]
        self.timed_out = [r.request_id for r in out.timed_out]
        self.prefill = [(r.request_id, b, e) for r, b, e in out.prefill]
        self.decode = [r.request_id for r in out.decode]


class Ids:
    """The scheduler driven by ids, each call under one lock (the engine's)."""

    def __init__(self, scheduler: Scheduler):
        self.s, self.lock = scheduler, threading.Lock()

    def add(self, rid: str, prompt_len: int, deadline: float | None = None, time_limit: float | None = None) -> None:
        with self.lock:
            req = Request(rid, [0] * prompt_len, None, None, deadline=deadline, time_limit=time_limit)  # type: ignore[arg-type]
            self.s.add(req)

    def schedule(self) -> Plan:
        with self.lock:
            return Plan(self.s.schedule())

    def abort(self, rid: str):
        with self.lock:
            return self.s.abort((None, rid))

    def finish(self, rid: str) -> None:
        with self.lock:
            self.s.finish((None, rid))

    def __getattr__(self, name):
        return getattr(self.s, name)

    def __contains__(self, rid: str) -> bool:
        return (None, rid) in self.s

    def __len__(self) -> int:
        return len(self.s)


def make(clock=None, **kw):
    return Ids(Scheduler(SchedulerConfig(**kw), clock=clock or Clock()))


def test_admits_fifo_up_to_max_num_seqs():
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(f"r{i}", 3)
    out = s.schedule()
    assert out.admitted == ["r0", "r1"] and out.decode == ["r0", "r1"]
    assert (s.num_running, s.num_waiting) == (2, 2)
    s.finish("r0")
    out = s.schedule()
    assert out.admitted == ["r2"] and out.decode == ["r1", "r2"]


def test_queue_full_rejects_at_once_with_retry_estimate():
    clock = Clock()
    s = make(clock, max_num_seqs=1, max_queue_len=1)
    s.add("a", 1)
    s.add("b", 1)
    with pytest.raises(QueueFullError) as e:
        s.add("c", 1)
    assert e.value.retry_after_s == pytest.approx(1.0)  # no history yet: the default
    assert "max_num_seqs 1" in str(e.value) and "max_queue_len 1" in str(e.value)
    s.schedule()  # a runs, b waits
    clock.t += 4.0
    s.finish("a")  # a served in 4 s
    assert s.retry_after_s() == pytest.approx(8.0)  # b waits for a slot, then a new arrival
    s.schedule()  # b runs
    assert s.retry_after_s() == pytest.approx(4.0)
    s.add("c", 1)
    assert len(s) == 2


def test_unbounded_queue_by_default():
    s = make(max_num_seqs=1)
    for i in range(1000):
        s.add(f"r{i}", 1)
    assert s.num_waiting == 1000 and s.capacity is None


def test_duplicate_in_flight_id_rejected_but_reusable_after_finish():
    s = make()
    s.add("x", 2)
    with pytest.raises(DuplicateRequestError, match="request_id"):
        s.add("x", 2)
    s.schedule()
    with pytest.raises(DuplicateRequestError):
        s.add("x", 2)
    s.finish("x")
    s.add("x", 2)


def test_abort_waiting_and_running_frees_slot_before_next_schedule():
    s = make(max_num_seqs=1)
    s.add("a", 1)
    s.add("b", 1)
    s.schedule()
    assert s.abort("b") == "waiting"
    assert s.abort("a") == "running"
    assert s.abort("a") is None and s.abort("never") is None
    s.add("c", 1)
    out = s.schedule()
    assert out.admitted == ["c"] and out.decode == ["c"]


def test_expired_waiting_requests_are_dropped_without_work():
    clock = Clock()
    s = make(clock, max_num_seqs=1)
    s.add("run", 1)
    s.schedule()
    s.add("late", 1, deadline=clock.t + 1)
    s.add("fine", 1, deadline=clock.t + 10)
    clock.t += 2
    out = s.schedule()
    assert out.expired == ["late"] and out.admitted == [] and "late" not in s
    s.finish("run")
    out = s.schedule()
    assert out.admitted == ["fine"]


def test_running_requests_end_at_their_deadline_or_time_limit():
    """A running request is not dropped as expired (that is for the queue, before model work): once its deadline
    or its time limit from admission has passed, it is planned as timed out (the engine ends it with "length"),
    leaves the running set, and its slot is admitted into in the same iteration."""
    clock = Clock()
    s = make(clock, max_num_seqs=2)
    s.add("a", 1, deadline=clock.t + 1)
    s.add("b", 1, time_limit=3.0)
    clock.t += 0.5
    s.schedule()  # both admitted at t + 0.5: b ends at t + 3.5, a at its deadline t + 1
    s.add("c", 1, time_limit=3.0)
    clock.t += 0.4
    out = s.schedule()
    assert out.timed_out == [] and out.decode == ["a", "b"]
    clock.t += 0.2
    out = s.schedule()
    assert out.expired == [] and out.timed_out == ["a"] and "a" not in s and out.admitted == ["c"]
    assert out.decode == ["b", "c"]
    clock.t += 2.5  # b's 3 s since admission are up; c's are not
    out = s.schedule()
    assert out.timed_out == ["b"] and out.decode == ["c"]


def test_chunked_prefill_fixed_boundaries_and_budget():
    s = make(prefill_chunk=4, max_prefill_tokens=8)
    s.add("long", 10)
    s.add("short", 3)
    plans = []
    while True:
        out = s.schedule()
        plans.append((out.prefill, out.decode))
        if out.decode == ["long", "short"]:
            break
    # chunk boundaries follow the prompt alone: [0,4) [4,8) [8,10); budget 8 tokens per iteration
    assert plans[0] == ([("long", 0, 4), ("long", 4, 8)], [])
    assert plans[1] == ([("long", 8, 10), ("short", 0, 3)], ["long", "short"])


def test_prefill_always_makes_progress_when_chunk_exceeds_budget():
    s = make(prefill_chunk=16, max_prefill_tokens=4)
    s.add("a", 40)
    s.add("b", 2)
    outs = [s.schedule() for _ in range(4)]
    assert [o.prefill for o in outs] == [[("a", 0, 16)], [("a", 16, 32)], [("a", 32, 40)], [("b", 0, 2)]]
    assert outs[2].decode == ["a"] and outs[3].decode == ["a", "b"]


def test_long_prompt_does_not_stall_running_decoders():
    s = make(prefill_chunk=8, max_prefill_tokens=8)
    s.add("streaming", 2)
    s.schedule()
    s.add("huge", 1000)
    for _ in range(10):
        out = s.schedule()
        assert "streaming" in out.decode
        assert sum(e - b for _, b, e in out.prefill) <= 8


def test_chunk_boundaries_independent_of_other_requests():
    def plan(extra: int):
        s = make(prefill_chunk=5, max_prefill_tokens=7)
        for i in range(extra):
            s.add(f"other{i}", 6)
        s.add("me", 23)
        mine = []
        for _ in range(100):
            out = s.schedule()
            mine += [(b, e) for rid, b, e in out.prefill if rid == "me"]
            if "me" in out.decode:
                return mine
        raise AssertionError("never finished prefill")

    assert plan(0) == plan(3) == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 23)]


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(prefill_chunk=0), "prefill_chunk"),
        (dict(max_prefill_tokens=-1), "max_prefill_tokens"),
        (dict(max_queue_len=-1), "max_queue_len"),
        (dict(max_num_seqs=True), "max_num_seqs"),
    ],
)
def test_config_validation_names_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kw)


def test_concurrent_add_and_abort_keep_counts_consistent():
    s = make(max_num_seqs=4, max_queue_len=50)
    errors = []

    def worker(k):
        for i in range(200):
            rid = f"{k}-{i}"
            try:
                s.add(rid, 1)
            except QueueFullError:
                continue
            if i % 2:
                s.abort(rid)
            else:
                s.schedule()
                s.abort(rid)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(s) == 0 and s.num_running == 0 and s.num_waiting == 0


def test_capacity_message_states_running_waiting_and_limits_exactly():
    """Requests not yet moved into a free slot count as waiting, so "waiting" alone may exceed max_queue_len: the
    message gives both counts and the limit of their sum."""
    s = make(Clock(), max_num_seqs=1, max_queue_len=2)
    for rid in "abc":
        s.add(rid, 1)
    with pytest.raises(QueueFullError) as e:
        s.add("d", 1)
    assert str(e.value) == (
        "server at capacity: 0 running + 3 waiting = 3 requests, the limit of max_num_seqs 1 + max_queue_len 2"
    )
    s.schedule()
    with pytest.raises(QueueFullError, match=r": 1 running \+ 2 waiting = 3 requests"):
        s.add("d", 1)


def test_request_ids_are_a_namespace_per_owner():
    """Two callers may use the same id; one caller's duplicate is still refused; each owner aborts its own."""
    s = Scheduler(SchedulerConfig(max_num_seqs=4))
    a, b = (Request("same", [0], None, None, owner=o) for o in ("alice", "bob"))  # type: ignore[arg-type]
    s.add(a)
    s.add(b)
    with pytest.raises(DuplicateRequestError):
        s.add(Request("same", [0], None, None, owner="alice"))  # type: ignore[arg-type]
    assert s.get(("alice", "same")) is a and s.get(("bob", "same")) is b and s.get((None, "same")) is None
    assert s.abort(("bob", "same")) == "waiting" and s.get(("alice", "same")) is a and len(s) == 1
