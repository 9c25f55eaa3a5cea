"""Connection budget for both front doors: the process's open-file limit, the connection cap derived from it, its
split between the gRPC and the HTTP port, and the rate-limited record of connections the server closes or sheds.

Why: every connection is a file descriptor. A client that opens connections and never finishes a request would
otherwise hold them until the process hits RLIMIT_NOFILE, after which accept() fails in a loop on both ports and
nothing (health checks included) gets in. The server therefore raises its soft file limit to the hard one, keeps
``RESERVE_FDS`` descriptors for itself (model files, logs, the engine, grpc core's own pipes and eventfds) and caps
the connections each door may hold so that the sum stays below the limit; accept() never runs out of descriptors.

Sharing: with the HTTP port on, the gRPC door may hold ``total // 2`` connections and the HTTP door the rest; with
the HTTP port off, gRPC gets all. The split is static because grpc core enforces its cap itself
(``grpc.max_allowed_incoming_connections``) and tells Python nothing about its connections.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
from collections import Counter
from dataclasses import dataclass

log = logging.getLogger("dgserve.connections")

RESERVE_MIN = 128  # descriptors kept for the process itself at any file limit
DEFAULT_CEILING = 16384  # a default cap beyond this buys nothing for one model server and costs memory
LOG_INTERVAL_S = 10.0  # at most one summary line of closed / shed connections this often


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (as far as the platform allows); (before, after) soft."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:  # e.g. macOS caps it at OPEN_MAX: keep what we have
            log.debug("cannot raise the file limit from %d to %d: %s", soft, target, e)
            return soft, soft
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def reserve_fds(nofile: int) -> int:
    """Descriptors kept out of the connection budget at a file limit of ``nofile``."""
    return max(RESERVE_MIN, nofile // 8)


def default_max_connections(nofile: int) -> int:
    """The default total connection cap at a file limit of ``nofile`` (at least 2: one per door)."""
    return max(2, min(DEFAULT_CEILING, nofile - reserve_fds(nofile)))


@dataclass(frozen=True)
class ConnectionPlan:
    """The caps the doors enforce. ``nofile``: the soft file limit after raising it."""

    nofile: int
    total: int
    grpc: int
    http: int
    raised_from: int = 0  # the soft file limit before start_plan raised it

    def describe(self) -> str:
        http = f", HTTP {self.http}" if self.http else ""
        return f"at most {self.total} connections (gRPC {self.grpc}{http}) under a file limit of {self.nofile}"


def plan(max_connections: int | None, http_on: bool, nofile: int) -> ConnectionPlan:
    """Split ``max_connections`` (None: the default for ``nofile``) between the doors (module docstring)."""
    total = default_max_connections(nofile) if max_connections is None else max_connections
    if not http_on:
        return ConnectionPlan(nofile, total, total, 0)
    grpc_cap = max(1, total // 2)
    return ConnectionPlan(nofile, total, grpc_cap, max(1, total - grpc_cap))


def start_plan(max_connections: int | None, http_on: bool) -> ConnectionPlan:
    """Raise the file limit and derive the caps (``log_plan`` reports them once the ports are bound, so that a
    startup that fails prints only its one error line)."""
    before, nofile = raise_nofile_limit()
    return dataclasses.replace(plan(max_connections, http_on, nofile), raised_from=before)


def log_plan(p: ConnectionPlan) -> None:
    """One line with the caps; a warning when an explicit cap leaves the process less than its reserve (accept()
    may then fail on descriptors instead of shedding)."""
    raised = f" (raised from {p.raised_from})" if p.nofile > p.raised_from else ""
    if p.total > p.nofile - reserve_fds(p.nofile):
        log.warning(
            "connections: %s%s leaves fewer than %d descriptors for the process (lower --max-connections / env "
            "DGSERVE_MAX_CONNECTIONS or raise ulimit -n)",
            p.describe(),
            raised,
            reserve_fds(p.nofile),
        )
    else:
        log.info("connections: %s%s", p.describe(), raised)


class ConnectionEvents:
    """Counts connections a door closed or shed, into ``counter`` (a Prometheus Counter labelled door, reason) at
    once and into the log as one summary line per ``interval`` seconds at most, however many there were: a storm
    of hostile connections must not become a storm of log lines. Call ``note`` on the event loop."""

    def __init__(self, counter, interval: float = LOG_INTERVAL_S):
        self.counter, self.interval = counter, interval
        self._pending: Counter[tuple[str, str]] = Counter()
        self._flush: asyncio.TimerHandle | None = None

    def note(self, door: str, reason: str) -> None:
        self.counter.labels(door, reason).inc()
        self._pending[(door, reason)] += 1
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self.interval, self.flush)

    def flush(self) -> None:
        """Log what was noted since the last line (nothing when nothing was)."""
        self._flush = None
        if not self._pending:
            return
        parts = ", ".join(f"{door} {reason} {n}" for (door, reason), n in sorted(self._pending.items()))
        log.warning("connections closed or shed in the last %.0f s: %s", self.interval, parts)
        self._pending.clear()

    def close(self) -> None:
        """Log what is pending now and stop the timer (at shutdown)."""
        if self._flush is not None:
            self._flush.cancel()
        self.flush()
