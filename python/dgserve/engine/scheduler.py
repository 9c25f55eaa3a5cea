"""Admission, queueing and batch formation for continuous batching (pure Python: no torch, no model).

A request is *waiting* (queued) until a running slot is free, then *running* until it finishes or is aborted.
One engine iteration is planned in two halves, ``admit()`` then ``plan(out)`` (``schedule()`` is both, for a caller
without a prefix cache); between them the engine has the prefix cache's hit of each admitted request written on it
(``Request.cached_tokens``): the scheduler never calls up into the runner.

``admit()``:

* end running requests whose time is up (``Request.ends_at``: their deadline, or their time limit counted from
  admission), which frees their slots for this iteration's admissions;
* admit waiting requests while fewer than ``max_num_seqs`` run: FIFO for one caller; between callers
  (``Request.caller``), each holds at most its fair share of the slots while others wait and the queue is served
  round-robin by caller, each caller's requests in their order (engine/fair_share.py; docs/architecture.md, "Fair
  shares between callers"). A caller over its share while another waits under its own gives back slots at its
  requests' block boundaries: such a request is *parked* (``ScheduleOutput.parked``: the runner keeps its KV cache
  aside) and waits at the head of its caller's queue; re-admitted, it is *resumed* (``ScheduleOutput.resumed``)
  where it stopped, with the same tokens it would have had. Drop waiting requests whose deadline has passed (they
  never cost model work; a parked one ends "length" with what it committed).

``plan(out)``:

* a request admitted now is prefilled from its ``cached_tokens`` on (the leading prompt tokens the prefix cache
  holds: a multiple of ``prefill_chunk``, so the chunk boundaries stay those of the prompt alone);
* chunked prefill: a running request's prompt is encoded in fixed chunks of ``prefill_chunk`` tokens (the chunk
  boundaries depend on the prompt alone, never on the batch, so a request's numbers do not depend on who else
  runs); at most ``max_prefill_tokens`` prompt tokens are planned per iteration (always at least one chunk), so
  one long prompt cannot stall the running streams; an image's soft tokens count ``image_token_cost`` each, the
  vision tower's work included;
* every running request whose prompt is fully encoded (after this iteration's chunks) takes one denoising step;
  with ``fair_step_canvases`` set and more than one caller with canvases ready, each caller's at most that many
  per iteration, those that waited longest first: where the device's cost grows with the canvases of a step (the
  CPU), callers then share the compute, not only the slots. A request's tokens do not depend on which iterations
  step it.

``add`` rejects at once when ``max_num_seqs + max_queue_len`` requests are in the system (``QueueFullError``
with a retry delay estimated from recent service times) or when the caller has a request with that id in flight
(``DuplicateRequestError``). Requests are keyed by ``Request.key``, (owner, request_id): ids are per caller.
The scheduler holds ``Request`` objects (dgserve.engine.request), the engine's own, and has no lock: the engine calls it
under its one lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from dgserve.engine.fair_share import fair_shares, next_caller, over_share, slots_wanted
from dgserve.engine.request import FINISHED, RUNNING, WAITING, Request, RequestKey

DEFAULT_RETRY_AFTER_S = 1.0
DEFAULT_MAX_NUM_SEQS = 32  # requests running at once: the engine's default and the server's (--max-num-seqs)
MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S = 0.05, 60.0


class QueueFullError(Exception):
    """All running slots and the waiting queue are full; retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DuplicateRequestError(ValueError):
    """A request with this id is already waiting or running."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Capacity and batching limits.

    max_num_seqs: requests running at once (each holds a canvas and a KV cache row).
    max_queue_len: requests waiting beyond the running ones; None = unbounded.
    prefill_chunk: prompt tokens per encoder chunk (fixed per request, so results are batch-invariant).
    max_prefill_tokens: prompt tokens encoded per engine iteration over all requests (>= one chunk is always run).
    image_token_cost: what one image soft token counts for in ``max_prefill_tokens`` (its placeholder plus its
    share of the vision tower), in prompt tokens; None: the engine's default for its device (docs/images.md,
    "Bounded like text").
    fair_step_canvases: when more than one caller has canvases ready, the most canvases of one caller denoised
    per iteration; 0: every ready canvas, every iteration; None: the engine's default for its device (1 where
    canvases are denoised one at a time, as on the CPU; else 0) (docs/architecture.md, "Fair shares between
    callers").
    """

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_queue_len: int | None = None
    prefill_chunk: int = 512
    max_prefill_tokens: int = 512
    image_token_cost: float | None = None
    fair_step_canvases: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "prefill_chunk", "max_prefill_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        q = self.max_queue_len
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 0):
            raise ValueError(f"max_queue_len must be an integer >= 0 or None, got {q!r}")
        check_image_token_cost(self.image_token_cost)
        f = self.fair_step_canvases
        if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f < 0):
            raise ValueError(f"fair_step_canvases must be an integer >= 0 or None, got {f!r}")


def check_image_token_cost(c: object) -> None:
    """ValueError unless ``c`` is None (the device's default) or a number in [1, 1000] (``image_token_cost``)."""
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not 1 <= c <= 1000):
        raise ValueError(f"image_token_cost must be a number in [1, 1000] or None, got {c!r}")


@dataclass
class ScheduleOutput:
    """The plan of one engine iteration."""

    admitted: list[Request] = field(default_factory=list)  # moved from waiting to running now (first time)
    parked: list[Request] = field(default_factory=list)  # running → waiting, at a block boundary (fair shares)
    resumed: list[Request] = field(default_factory=list)  # parked → running again
    expired: list[Request] = field(default_factory=list)  # dropped from the queue: deadline passed
    timed_out: list[Request] = field(default_factory=list)  # running past Request.ends_at: ended (marked finished)
    prefill: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, start, end) prompt slices
    decode: list[Request] = field(default_factory=list)  # one denoising step each, in admission order

    @property
    def empty(self) -> bool:
        return not (
            self.admitted
            or self.parked
            or self.resumed
            or self.expired
            or self.timed_out
            or self.prefill
            or self.decode
        )


class Scheduler:
    """Waiting queue + running set with admission control and chunked-prefill planning."""

    def __init__(
        self,
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config or SchedulerConfig()
        self.clock = clock
        self._waiting: OrderedDict[RequestKey, Request] = OrderedDict()
        self._running: OrderedDict[RequestKey, Request] = OrderedDict()
        self._service_ema: float | None = None  # seconds from admission to finish, smoothed
        self._turns: dict[object, int] = {}  # caller → the admission count when it was last served (round-robin)
        self._admissions = 0
        self._iterations = 0  # plan() calls: what Request.last_iteration counts in

    # ------------------------------------------------------------------ state

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def __contains__(self, key: RequestKey) -> bool:
        return key in self._waiting or key in self._running

    def __len__(self) -> int:
        return len(self._waiting) + len(self._running)

    def get(self, key: RequestKey) -> Request | None:
        """The request in flight under ``key`` = (owner, request_id)."""
        return self._running.get(key) or self._waiting.get(key)

    def requests(self) -> list[Request]:
        """Every request in the system: running ones first, then the queue in order."""
        return [*self._running.values(), *self._waiting.values()]

    @property
    def capacity(self) -> int | None:
        q = self.config.max_queue_len
        return None if q is None else self.config.max_num_seqs + q

    # ------------------------------------------------------------------ admission

    def add(self, req: Request) -> None:
        """Queue a request. Raises DuplicateRequestError or QueueFullError; never blocks."""
        if req.prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {req.prompt_len}")
        if req.key in self:
            raise DuplicateRequestError(f"request_id: {req.request_id!r} is already in flight")
        cap = self.capacity
        if cap is not None and len(self) >= cap:
            raise QueueFullError(self._capacity_message(), self.retry_after_s())
        req.arrival, req.status = self.clock(), WAITING
        self._waiting[req.key] = req

    def _capacity_message(self) -> str:
        # requests not yet moved into a free slot count as waiting until the next schedule(), so "waiting" alone
        # may exceed max_queue_len: the limit is on the sum, and the message says exactly that
        c = self.config
        return (
            f"server at capacity: {self.num_running} running + {self.num_waiting} waiting = {len(self)} "
            f"requests, the limit of max_num_seqs {c.max_num_seqs} + max_queue_len {c.max_queue_len}"
        )

    def abort(self, key: RequestKey) -> str | None:
        """Remove a request (marked finished): returns "waiting" or "running" (where it was), or None if unknown."""
        for where, table in ((WAITING, self._waiting), (RUNNING, self._running)):
            req = table.pop(key, None)
            if req is not None:
                req.status = FINISHED
                return where
        return None

    def finish(self, key: RequestKey) -> None:
        """A running request completed; its slot is free and its service time feeds the retry estimate."""
        req = self._running.pop(key, None)
        if req is not None:
            req.status = FINISHED
        if req is not None and req.admitted_at is not None:
            dt = self.clock() - req.admitted_at
            self._service_ema = dt if self._service_ema is None else 0.8 * self._service_ema + 0.2 * dt

    def retry_after_s(self) -> float:
        """Estimated wait until a slot frees up for a request arriving now."""
        if self._service_ema is None:
            return DEFAULT_RETRY_AFTER_S
        rounds = 1 + self.num_waiting // self.config.max_num_seqs
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, self._service_ema * rounds))

    # ------------------------------------------------------------------ one iteration

    def admit(self) -> ScheduleOutput:
        """The first half of an iteration (mutates): end what is over (``expired``, ``timed_out``), park and admit
        (``parked``, ``resumed``, ``admitted``). Between this and ``plan`` the engine sets each newly admitted
        request's ``cached_tokens`` (the prefix cache's hit); the scheduler never asks for it."""
        out = ScheduleOutput()
        now = self.clock()
        self._expire(now, out)
        self._time_out(now, out)
        self._admit(now, out)
        return out

    def plan(self, out: ScheduleOutput) -> ScheduleOutput:
        """The second half (mutates ``out`` and advances planned prefill): each request admitted now is prefilled
        from its ``cached_tokens`` on (a multiple of ``prefill_chunk``, so the chunk boundaries stay those of the
        prompt alone), the prompt chunks within the token budget, then the requests that take a denoising step."""
        for req in out.admitted:
            req.prefilled = req.cached_tokens
        self._plan_prefill(out)
        out.decode = self._stepped([req for req in self._running.values() if req.prefill_done])
        self._iterations += 1
        return out

    def schedule(self) -> ScheduleOutput:
        """``admit`` then ``plan``, for a caller without a prefix cache: the next engine iteration's plan."""
        return self.plan(self.admit())

    def _stepped(self, ready: list[Request]) -> list[Request]:
        """The ready requests that take a denoising step this iteration, in admission order: all of them, or with
        ``fair_step_canvases`` and several callers, each caller's that waited longest, up to the limit."""
        limit = self.config.fair_step_canvases
        if not limit or len({req.caller for req in ready}) < 2:
            chosen = ready
        else:
            by_caller: dict = {}
            for req in ready:
                by_caller.setdefault(req.caller, []).append(req)
            picked = {
                id(req) for reqs in by_caller.values() for req in sorted(reqs, key=lambda r: r.last_iteration)[:limit]
            }
            chosen = [req for req in ready if id(req) in picked]
        for req in chosen:
            req.last_iteration = self._iterations
        return chosen

    def _expire(self, now: float, out: ScheduleOutput) -> None:
        """Waiting requests whose deadline passed leave the queue: never admitted, "cancelled" (``expired``);
        parked ones (admitted before) like a running one whose time is up (``timed_out``)."""
        for key in [key for key, req in self._waiting.items() if (end := _queue_end(req)) is not None and end <= now]:
            req = self._waiting.pop(key)
            req.status = FINISHED
            (out.timed_out if req.admitted_at is not None else out.expired).append(req)

    def _time_out(self, now: float, out: ScheduleOutput) -> None:
        for key in [key for key, req in self._running.items() if (end := req.ends_at) is not None and end <= now]:
            req = self._running.pop(key)
            req.status = FINISHED
            out.timed_out.append(req)

    def _admit(self, now: float, out: ScheduleOutput) -> None:
        """Fill the free slots from the queue: round-robin by caller within fair shares, after parking what callers
        over their share hold beyond it while others wait (one caller: FIFO, nothing parked)."""
        if not self._waiting:
            return
        waiting, running = self._counts()
        demand = _demand(waiting, running)
        turns = self._turns
        order = sorted(demand, key=lambda c: (-running.get(c, 0), turns.get(c, -1)))  # who keeps the remainder
        shares = fair_shares(demand, self.config.max_num_seqs, order)
        # a caller with nothing in the system leaves the rotation (so the table holds present callers only)
        self._turns = {c: t for c, t in self._turns.items() if c in shares}
        if len(shares) > 1:
            self._park(waiting, running, shares, out)
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            callers = list(dict.fromkeys(req.caller for req in self._waiting.values()))  # by their oldest waiting
            caller = next_caller(callers, running, shares, self._turns)
            key, req = next((k, r) for k, r in self._waiting.items() if r.caller == caller)
            del self._waiting[key]
            self._admissions += 1
            self._turns[caller], running[caller] = self._admissions, running.get(caller, 0) + 1
            req.status = RUNNING
            self._running[key] = req
            if req.admitted_at is not None:  # parked: back where it stopped
                out.resumed.append(req)
                continue
            req.admitted_at = now
            out.admitted.append(req)

    def _counts(self) -> tuple[dict, dict]:
        """({caller: requests waiting}, {caller: requests running}), each in the order callers first appear."""
        waiting: dict = {}
        running: dict = {}
        for req in self._waiting.values():
            waiting[req.caller] = waiting.get(req.caller, 0) + 1
        for req in self._running.values():
            running[req.caller] = running.get(req.caller, 0) + 1
        return waiting, running

    def _park(self, waiting: dict, running: dict, shares: dict, out: ScheduleOutput) -> None:
        """Park running requests of callers over their share, as many as the waiting callers under theirs would
        take beyond the free slots: each time the newest request of the caller furthest over its share that sits
        at a block boundary (no canvas in progress: ``Request.block`` None), so no denoising work is lost; it goes
        to the head of its caller's queue. At most ``max_num_seqs`` requests are parked at once (their KV copies
        are bounded by the slots' own size)."""
        free = self.config.max_num_seqs - len(self._running)
        want = slots_wanted(waiting, running, shares) - free
        parked = sum(1 for req in self._waiting.values() if req.admitted_at is not None)
        while want > 0 and parked < self.config.max_num_seqs:
            req = self._parkable(running, shares)
            if req is None:
                return  # every over-share request is mid-canvas: try again at the next step
            del self._running[req.key]
            req.status = WAITING
            self._waiting[req.key] = req
            self._waiting.move_to_end(req.key, last=False)  # ahead of its caller's other waiting requests
            running[req.caller] -= 1
            out.parked.append(req)
            want, parked = want - 1, parked + 1

    def _parkable(self, running: dict, shares: dict) -> Request | None:
        for caller in over_share(running, shares):
            for req in reversed(self._running.values()):  # the newest first: the older keep their slots
                if req.caller == caller and req.block is None:
                    return req
        return None

    def _plan_prefill(self, out: ScheduleOutput) -> None:
        chunk, budget = self.config.prefill_chunk, float(self.config.max_prefill_tokens)
        extra = (self.config.image_token_cost or 1) - 1  # an image's soft tokens beyond their placeholders
        for req in self._running.values():
            while not req.prefill_done:
                end = chunk_end(req, chunk)
                soft = sum(im.tokens for s, im in req.images if req.prefilled <= s < end)
                cost = end - req.prefilled + extra * soft
                if out.prefill and cost > budget:
                    return
                out.prefill.append((req, req.prefilled, end))
                budget -= cost
                req.prefilled = end


def _demand(waiting: dict, running: dict) -> dict:
    """{caller: requests running or waiting}, callers in the order they appear (running first)."""
    demand = dict(running)
    for c, n in waiting.items():
        demand[c] = demand.get(c, 0) + n
    return demand


def _queue_end(req: Request) -> float | None:
    """When a waiting request leaves the queue unserved: its deadline; a parked one also at its time limit."""
    return req.ends_at if req.admitted_at is not None else req.deadline


def chunk_end(req: Request, chunk: int) -> int:
    """Where the prompt chunk starting at ``req.prefilled`` ends: the next multiple of ``chunk`` (the prefix
    cache's blocks), or the prompt's end; never inside an image, whose placeholders attend to each other both ways
    and so are encoded in one pass (docs/images.md): the chunk stops before an image it would split, and a chunk
    that starts with an image ends after it (an image never has more tokens than a chunk: admission checks it,
    ``request_checks.prompt_ids``)."""
    start = req.prefilled
    end = min(req.prompt_len, (start // chunk + 1) * chunk)
    for s, image in req.images:
        e = s + image.tokens
        if s < end < e:
            end = s if s > start else e
            break
    return end
