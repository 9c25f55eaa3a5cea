"""Fair shares of the running slots between callers (docs/architecture.md, "Fair shares between callers"): pure
Python, no torch, used by the scheduler under the engine's lock.

A *caller* is ``Request.caller``: the token's identity with auth on (or a trusted gateway's header), None for
everyone when neither is set (then there is one caller and nothing here changes the FIFO order).

Public contract:
    shares = fair_shares({caller: demand}, slots)      # max-min fair: {caller: slots it may hold}
    caller = next_caller(waiting_callers, running, shares, turns)   # whose queue is served next (round-robin)

``fair_shares`` is water-filling: every caller may hold an equal part of the slots, a caller that wants less
keeps only what it wants, and what it leaves is split between the others, so the shares sum to
min(slots, total demand) and the slots are never left idle while someone waits. Whole slots: the remainder of
the split goes to the callers first in ``order`` (the scheduler puts the callers holding the most running slots
first, so shares do not move while the callers stay: no slot changes hands back and forth; then the caller
served longest ago, so with fewer slots than callers the slots go round).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

Caller = Hashable  # str | None in practice: Request.caller


def fair_shares(demand: Mapping[Caller, int], slots: int, order: Sequence[Caller] | None = None) -> dict[Caller, int]:
    """The running slots each caller may hold: ``demand`` {caller: requests it has running or waiting, >= 1} (each
    ``n`` choice is a request), ``slots`` the running slots in all, ``order`` who gets the remainder first (default:
    ``demand``'s order). Max-min fair (module docstring)."""
    pending = list(order) if order is not None else list(demand)
    shares: dict[Caller, int] = {}
    left = slots
    while pending:  # callers wanting no more than an equal part take what they want; the rest share what is left
        part = left // len(pending)
        small = [c for c in pending if demand[c] <= part]
        if not small:
            break
        for c in small:
            shares[c] = demand[c]
            left -= demand[c]
        pending = [c for c in pending if c not in shares]
    if pending:
        base, extra = divmod(left, len(pending))
        for i, c in enumerate(pending):
            shares[c] = base + (1 if i < extra else 0)
    return shares


def next_caller(
    waiting: Sequence[Caller], running: Mapping[Caller, int], shares: Mapping[Caller, int], turns: Mapping[Caller, int]
) -> Caller:
    """Whose oldest waiting request is admitted next: among the callers with requests waiting (``waiting``, in the
    order of their oldest waiting request), those holding fewer running slots than their share; of those, the one
    served longest ago (``turns``: the admission count at which a caller was last served; never served: first).
    When every waiting caller holds its share (a slot is free only because the shares round down), the same rule
    over all of them, so a free slot is never left idle. ``waiting`` must not be empty."""
    under = [c for c in waiting if running.get(c, 0) < shares.get(c, 0)]
    pool = under or list(waiting)
    return min(pool, key=lambda c: turns.get(c, -1))  # min is stable: ties go to the earliest waiting


def over_share(running: Mapping[Caller, int], shares: Mapping[Caller, int]) -> list[Caller]:
    """The callers holding more running slots than their share, the furthest over first (ties: as ``running``)."""
    over = [c for c, n in running.items() if n > shares.get(c, 0)]
    return sorted(over, key=lambda c: shares.get(c, 0) - running[c])


def slots_wanted(waiting: Mapping[Caller, int], running: Mapping[Caller, int], shares: Mapping[Caller, int]) -> int:
    """How many running slots the waiting callers under their share would take: Σ min(waiting, share − running)."""
    return sum(max(0, min(n, shares.get(c, 0) - running.get(c, 0))) for c, n in waiting.items())
