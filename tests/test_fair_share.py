"""Fair shares of the running slots between callers: the share arithmetic, the scheduler's round-robin queue and
parking at block boundaries (no torch), and an engine whose parked requests end with exactly the tokens they
have alone (docs/architecture.md, "Fair shares between callers")."""

from __future__ import annotations

import pytest

from dgserve import Engine, SamplingParams
from dgserve.engine.fair_share import fair_shares, next_caller, over_share, slots_wanted
from dgserve.engine.prompt import Submission
from dgserve.engine.request import Request
from dgserve.engine.scheduler import Scheduler, SchedulerConfig
from dgserve.model.tiny import make_random_checkpoint

# ---------------------------------------------------------------------------------------------- the arithmetic


@pytest.mark.parametrize(
    "demand, slots, expected",
    [
        ({"a": 32}, 32, {"a": 32}),
        ({"a": 32, "b": 1}, 32, {"a": 31, "b": 1}),
        ({"a": 32, "b": 32}, 32, {"a": 16, "b": 16}),
        ({"a": 40, "b": 3, "c": 40}, 32, {"a": 15, "b": 3, "c": 14}),
        ({"a": 2, "b": 3}, 32, {"a": 2, "b": 3}),
        ({None: 7}, 4, {None: 4}),
        ({"a": 5, "b": 5, "c": 5}, 4, {"a": 2, "b": 1, "c": 1}),
    ],
)
def test_fair_shares_are_max_min_fair(demand, slots, expected):
    shares = fair_shares(demand, slots)
    assert shares == expected
    assert sum(shares.values()) == min(slots, sum(demand.values()))  # never idle while someone waits
    # the remainder follows ``order``
    assert fair_shares({"a": 5, "b": 5, "c": 5}, 4, ["c", "b", "a"]) == {"a": 1, "b": 1, "c": 2}


def test_next_caller_is_round_robin_within_shares():
    shares = {"a": 2, "b": 2}
    # a is at its share: b is served though a waited longer
    assert next_caller(["a", "b"], {"a": 2, "b": 1}, shares, {}) == "b"
    # both under their share: the one served longest ago
    assert next_caller(["a", "b"], {"a": 0, "b": 0}, shares, {"a": 5, "b": 3}) == "b"
    assert next_caller(["a", "b"], {}, shares, {}) == "a"  # never served: in queue order
    # both at their share (a slot free by rounding): still served, never idle
    assert next_caller(["a", "b"], {"a": 2, "b": 2}, shares, {"a": 1, "b": 2}) == "a"
    assert over_share({"a": 5, "b": 1, "c": 3}, {"a": 2, "b": 2, "c": 2}) == ["a", "c"]
    assert slots_wanted({"b": 3, "c": 1}, {"a": 4, "b": 1}, {"a": 2, "b": 2, "c": 2}) == 2


# ---------------------------------------------------------------------------------------------- the scheduler


class Sched:
    """The scheduler with requests named "caller:i" (one-token prompts), read back by name."""

    def __init__(self, max_num_seqs: int):
        self.s = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_queue_len=100))
        self.reqs: dict[str, Request] = {}

    def add(self, caller: str, n: int) -> None:
        for _ in range(n):
            name = f"{caller}:{sum(1 for k in self.reqs if k.startswith(caller + ':'))}"
            req = Request(name, [0], None, None, owner=caller, caller=caller)  # type: ignore[arg-type]
            self.reqs[name] = req
            self.s.add(req)

    def step(self):
        out = self.s.schedule()
        for r in out.decode:  # every running request is mid-canvas until ``boundary``
            r.block = object()  # type: ignore[assignment]
        return out

    def boundary(self, *names: str) -> None:
        for n in names or list(self.reqs):
            self.reqs[n].block = None

    def running(self) -> list[str]:
        return sorted(r.request_id for r in self.s.requests() if r.status == "running")


def _names(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def test_one_caller_is_fifo_and_never_parked():
    s = Sched(2)
    s.add("a", 4)
    assert _names(s.step().admitted) == ["a:0", "a:1"]
    s.boundary()
    out = s.step()
    assert not out.parked and not out.admitted
    s.s.finish(("a", "a:0"))
    assert _names(s.step().admitted) == ["a:2"]


def test_a_caller_over_its_share_gives_back_a_slot_at_a_block_boundary():
    s = Sched(4)
    s.add("a", 6)
    assert _names(s.step().admitted) == ["a:0", "a:1", "a:2", "a:3"]
    s.add("b", 1)
    out = s.step()  # every request of a is mid-canvas: b waits
    assert not out.parked and not out.admitted
    s.boundary("a:1")  # one of a's canvases committed: that slot goes to b
    out = s.step()
    assert _names(out.parked) == ["a:1"] and _names(out.admitted) == ["b:0"]
    assert s.running() == ["a:0", "a:2", "a:3", "b:0"]
    # a's parked request is first in a's queue: resumed (not admitted anew) when a slot frees
    s.s.finish(("b", "b:0"))
    out = s.step()
    assert _names(out.resumed) == ["a:1"] and not out.admitted
    s.s.finish(("a", "a:0"))
    assert _names(s.step().admitted) == ["a:4"]  # then a's queue in order


def test_the_queue_is_round_robin_by_caller_and_each_callers_order_is_kept():
    s = Sched(1)
    s.add("a", 3)
    s.add("b", 2)
    s.add("c", 1)
    order = []
    for _ in range(6):
        out = s.step()
        order += _names(out.admitted)
        for r in out.admitted:
            s.s.finish(r.key)
    assert order == ["a:0", "b:0", "c:0", "a:1", "b:1", "a:2"]


def test_shares_split_the_slots_when_both_callers_fill_them():
    s = Sched(8)
    s.add("a", 16)
    s.step()
    s.add("b", 16)
    s.boundary()
    out = s.step()
    assert len(out.parked) == 4 and len(out.admitted) == 4
    assert [r.split(":")[0] for r in s.running()].count("a") == 4


def test_a_parked_request_whose_time_is_up_ends_as_timed_out_not_cancelled():
    clock = [100.0]
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_queue_len=10), clock=lambda: clock[0])
    a = [Request(f"a{i}", [0], None, None, caller="a", time_limit=5.0) for i in range(2)]  # type: ignore[arg-type]
    b = Request("b", [0], None, None, caller="b")  # type: ignore[arg-type]
    for r in a:
        sched.add(r)
    sched.schedule()
    sched.add(b)
    out = sched.schedule()  # a's requests hold no canvas (block None): a's newest is parked for b
    assert out.parked == [a[1]] and out.admitted == [b]
    clock[0] += 6
    out = sched.schedule()
    assert a[1] in out.timed_out and not out.expired


def test_fair_stepping_gives_each_caller_the_same_canvases_per_iteration():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, fair_step_canvases=1))
    a = [Request(f"a{i}", [0], None, None, caller="a") for i in range(5)]  # type: ignore[arg-type]
    b = Request("b", [0], None, None, caller="b")  # type: ignore[arg-type]
    for r in a:
        sched.add(r)
    assert len(sched.schedule().decode) == 5  # one caller: every ready canvas steps
    sched.add(b)
    stepped = [[r.request_id for r in sched.schedule().decode] for _ in range(5)]
    assert all(len(x) == 2 and "b" in x for x in stepped)  # b every iteration, one of a's
    assert sorted(x[0] for x in stepped) == ["a0", "a1", "a2", "a3", "a4"]  # a's in turn, none starved
    # 0: every ready canvas steps, whatever the callers
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, fair_step_canvases=0))
    for r in [*a, b]:
        r.status, r.last_iteration = "waiting", -1
        sched.add(r)
    assert len(sched.schedule().decode) == 6


# ---------------------------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_random_checkpoint(tmp_path_factory.mktemp("fair"), "tiny", seed=5)
    return Engine.from_pretrained(path, scheduler_config=SchedulerConfig(max_num_seqs=3, max_queue_len=20))


def _params(seed: int, tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=tokens, max_denoising_steps=4, seed=seed, ignore_eos=True)


def test_parked_requests_end_with_their_tokens_alone_and_the_other_caller_starts_within_a_block(engine):
    """Caller a fills every slot with long requests; caller b's short request is admitted at the first block
    boundary of a's batch (a request of a is parked), and every request, parked or not, ends with exactly the
    tokens it has alone."""
    C = engine.model.config.canvas_length
    long = [([5 + i, 6, 7, 8 + i], _params(100 + i, 4 * C)) for i in range(3)]
    short = ([9, 10], _params(7, C))
    alone = [engine.generate(p, sp).token_ids for p, sp in [*long, short]]

    reqs = [engine.add(engine.make_request(Submission(p, sp, f"a{i}", owner="a"))) for i, (p, sp) in enumerate(long)]
    steps, started = 0, None
    while not any(r.blocks for r in reqs):  # a's first blocks: every slot busy, mid-canvas
        engine.step()
        steps += 1
    b = engine.add(engine.make_request(Submission(short[0], short[1], "b0", owner="b")))
    parked = []
    while engine.has_unfinished():
        out = engine.step()
        parked += [r for r in reqs if r.parked is not None and r not in parked]
        if b in out.admitted:
            started = max(len(r.blocks) for r in reqs)
    assert parked, "a request of caller a was parked for b"
    assert started is not None and started <= 2, "b started within one block of a's running batch"
    for r, want in zip([*reqs, b], alone, strict=True):
        assert r.result().token_ids == want
