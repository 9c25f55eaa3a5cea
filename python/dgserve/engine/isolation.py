"""A request fails alone: the two guards ``Engine.step`` runs its work through (docs/architecture.md, "Failures").

Public contract:
    ok = alone(phase, reqs, work, end)   # work(req) for each unfinished req; its exception → end(req, failure)
    failure = own_failure(req, phase, error)  # the error that ends a request whose own work raised ``error``
    error = grammar_failure(req)         # the error of the request's grammar once it failed, else None
    hit = cached_prefix(match, req)      # match(req), the prefix cache's hit; its exception → [] (no reuse)
    value = shared(phase, work)          # work(); its exception → SharedWorkError naming the phase
    ran = together(phase, reqs, work)    # several requests' own work as one; its exception → False (then each alone)

A request's own work (admission into a slot, its prompt chunks, the start of a block, the commit of a block) runs
through ``alone``: an exception there ends that request, with the exception itself when it is a ValueError (the
request's input caused it: INVALID_ARGUMENT / 400 naming the field), else with a ``RequestFailedError`` (INTERNAL
for that request only), and the others go on. The work shared by every running request (scheduling, slot
bookkeeping, the batched denoising pass) runs through ``shared``: an exception there belongs to no single request
and is an engine fault. Several requests' own work done as one (the stacked encoder pass of their prompt chunks or
committed blocks) runs through ``together``: when it raises, nothing is ended and each request's work runs again on
its own, through ``alone``, so a failure still ends only the request that causes it. Log lines name the request,
the phase and the exception's type, never its message (which may quote the request's content); tracebacks are at
DEBUG.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from dgserve.engine.request import Request, RequestFailedError, SharedWorkError

log = logging.getLogger("dgserve.engine.engine")  # the engine's log: these are its step's lines
_T = TypeVar("_T")


def alone(
    phase: str,
    reqs: Sequence[Request],
    work: Callable[[Request], object],
    end: Callable[[Request, Exception], None],
) -> list[Request]:
    """``work(req)`` for each request still in flight, each on its own: an exception ends that request alone
    (``end(req, own_failure(...))``) and the others go on. Returns the requests whose work succeeded."""
    ok = []
    for req in reqs:
        if req.finished:  # aborted meanwhile, or failed at an earlier phase of this step
            continue
        try:
            work(req)
        except Exception as e:  # noqa: BLE001 - whatever one request's work raises ends that request only
            end(req, own_failure(req, phase, e))
        else:
            ok.append(req)
    return ok


def own_failure(req: Request, phase: str, error: Exception) -> Exception:
    """What ends ``req`` after its own work raised ``error`` in ``phase``: ``error`` itself when it is a ValueError
    (its message names the field), else a ``RequestFailedError`` naming the request and the phase only."""
    kind = type(error).__name__
    failure: Exception
    if isinstance(error, ValueError):
        log.info("request %s: its input failed at %s (%s); ending it alone", req.request_id, phase, kind)
        failure = error
    else:
        log.error("request %s: %s failed (%s); ending it alone", req.request_id, phase, kind)
        failure = RequestFailedError(f"request {req.request_id}: failed during {phase} (an internal error)")
    log.debug("request %s: %s failed", req.request_id, phase, exc_info=error)
    return failure


def grammar_failure(req: Request) -> Exception | None:
    """The error that ends ``req`` because its own state failed (its grammar), or None while it has not (or the
    request has already finished)."""
    grammar = req.grammar
    if grammar is None or grammar.error is None or req.finished:
        return None
    log.info("request %s ended by its grammar: %s", req.request_id, grammar.error)
    return grammar.error


def shared(phase: str, work: Callable[[], _T]) -> _T:
    """``work()``, shared by every running request: an exception there belongs to no single request and is raised
    as a ``SharedWorkError`` naming ``phase`` and the cause's type (chained)."""
    try:
        return work()
    except Exception as e:
        raise SharedWorkError(
            f"engine fault in {phase}, work shared by every running request (no single request's): {type(e).__name__}"
        ) from e


def together(phase: str, reqs: Sequence[Request], work: Callable[[], object]) -> bool:
    """``work()``, the own work of every request in ``reqs`` done as one: True when it ran; when it raises, the
    failure is logged (type only) and False is returned, and the caller runs each request's work alone. ``work`` must
    leave every request as it was when it raises (the stacked encoder commits only once its whole pass has run)."""
    try:
        work()
    except Exception as e:
        log.warning("%s of %d requests as one pass failed (%s); each runs alone", phase, len(reqs), type(e).__name__)
        log.debug("%s as one pass failed", phase, exc_info=e)
        return False
    return True


def cached_prefix(match: Callable[[Request], list[_T]], req: Request) -> list[_T]:
    """The cached blocks that start ``req``'s prompt (``match``: ``ModelRunner.match_prefix``), looked up at its
    admission. A lookup that raises costs that request its reuse only ([]: its whole prompt is encoded, with the
    same tokens as a hit gives), never the scheduling of the others."""
    try:
        return match(req)
    except Exception as e:
        log.error(
            "request %s: prefix cache lookup failed (%s); encoding its whole prompt", req.request_id, type(e).__name__
        )
        log.debug("request %s: prefix cache lookup failed", req.request_id, exc_info=e)
        return []
