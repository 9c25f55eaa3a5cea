"""What the routes need from the server: its serving state, auth and limits (all owned by Server)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request

from .. import callers, errors
from ..in_flight import InFlight
from .errors import HttpError
from .responses.store import ResponseStore


class Gate:
    """The serving state, the auth check, the body limit, the generation requests in flight and the Responses
    API's store."""

    def __init__(
        self,
        state,
        metrics,
        *,
        live: Callable[[], bool],
        owner: Callable[[str], str] | None,
        max_body_bytes: int,
        responses: ResponseStore | None = None,
        trust_chat_template: bool = False,
        caller_header: str | None = None,
    ):
        # owner: the caller's identity from its Authorization header (errors.UnauthenticatedError when the token
        # is not accepted); None when auth is off. The same BearerAuth.owner the gRPC door uses, so a request
        # started over HTTP can be aborted over gRPC only with the same token.
        self.state, self.metrics, self.live, self.owner = state, metrics, live, owner
        self.max_body_bytes = max_body_bytes
        self.trust_chat_template = trust_chat_template  # requests may send a chat_template (an operator's choice)
        self.caller_header = caller_header  # a trusted gateway's header naming the caller (service/callers.py)
        self.calls = InFlight()  # generation requests not yet finished (the drain waits for them)
        # the Responses API's stored responses, scoped by the same owner as request ids
        self.responses = responses if responses is not None else ResponseStore(1024, 64 << 20)

    def ready(self) -> bool:
        return self.live() and self.state.engine is not None and not self.state.draining

    def authorize(self, request: Request) -> str | None:
        """The caller's identity (None when auth is off); HttpError UNAUTHENTICATED without an accepted token.

        The token travels as ``Authorization: Bearer <token>`` (OpenAI's clients) or, on every HTTP route alike,
        as ``x-api-key: <token>`` (Anthropic's clients); with both, Authorization is the one checked. Either way
        it is the same token of the token file, so the caller is the same owner on every door. With a caller
        header configured, its value is noted as the call's caller (``callers.note``)."""
        owner = self._owner(request)
        if self.caller_header is not None:
            callers.note(owner, request.headers.get(self.caller_header))
        return owner

    def _owner(self, request: Request) -> str | None:
        if self.owner is None:
            return None
        header = request.headers.get("authorization")
        if header is None and request.headers.get("x-api-key"):
            header = "Bearer " + request.headers["x-api-key"]
        try:
            return self.owner(header or "")
        except errors.UnauthenticatedError:
            raise HttpError(
                "UNAUTHENTICATED",
                "missing or invalid API token (send 'Authorization: Bearer <token>' or 'x-api-key: <token>')",
            ) from None
