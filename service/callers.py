"""Who a request's fair share of the running slots belongs to (docs/architecture.md, "Fair shares between callers").

With auth on, each token is a caller: the engine keys a request by its owner, so nothing is needed here. Behind a
trusted gateway that authenticates its users itself, ``--caller-header NAME`` keys callers by that header
instead (with auth on too: then by token and header). The doors read it once per call (``note``: the HTTP gate,
the gRPC interceptor) into a context variable of the call's task, and ``events.open_events`` gives it to every
submission of the call (``Submission.caller``). A call without the header is its owner's.
"""

from __future__ import annotations

import contextvars

MAX_CALLER_CHARS = 256  # a longer header value is cut: it only names a queue

caller_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("dgserve_caller", default=None)


def note(owner: str | None, header: str | bytes | None) -> None:
    """Record the current call's caller: ``header``'s value (the configured header; None or empty: absent),
    joined to ``owner`` when auth is on, so that one token's users never share a queue with another token's."""
    if isinstance(header, bytes):
        header = header.decode("latin-1")
    if not header:
        return
    header = header[:MAX_CALLER_CHARS]
    caller_var.set(header if owner is None else f"{owner}/{header}")


def current() -> str | None:
    """The current call's caller from its header, or None (the request's owner decides)."""
    return caller_var.get()
