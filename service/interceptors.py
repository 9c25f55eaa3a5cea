"""Server interceptors: bearer-token auth, and the per-call wrapper (request id, error mapping, access log).

The call wrapper is where ``errors.abort`` is applied: servicer methods just raise domain exceptions.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time

import grpc

from service import errors
from service.logs import request_id_var

log = logging.getLogger("dgserve.access")
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
OUR_PREFIX = "/dgserve.v1."


def load_tokens(path: str) -> list[str]:
    """Accepted bearer tokens: one a line; blank lines and '#' comments ignored. ValueError when none."""
    with open(path, encoding="utf-8") as f:
        tokens = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    if not tokens:
        raise ValueError(f"auth_token_file: {path} holds no tokens")
    return tokens


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on every call except health and reflection.

    Tokens are compared as SHA-256 digests with ``hmac.compare_digest`` against every accepted token (constant
    time in the token's content). A denied call gets a handler of the same kind that aborts UNAUTHENTICATED.
    """

    def __init__(self, tokens: list[str]):
        self._digests = [hashlib.sha256(t.encode()).digest() for t in tokens]

    async def intercept_service(self, continuation, details):
        if details.method.startswith(EXEMPT_PREFIXES) or self._authorized(details.invocation_metadata or ()):
            return await continuation(details)
        handler = await continuation(details)
        return None if handler is None else _deny(handler)

    def _authorized(self, metadata) -> bool:
        value = next((v for k, v in metadata if k == "authorization"), "")
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        digest = hashlib.sha256(token.strip().encode()).digest()
        ok = False
        for d in self._digests:
            ok |= hmac.compare_digest(digest, d)
        return ok


_DENIED = "missing or invalid bearer token (send metadata 'authorization: Bearer <token>')"


async def _deny_unary(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)


async def _deny_stream(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
    yield  # pragma: no cover - makes this an async generator like the real handler


def _deny(handler):
    if handler.unary_unary:
        return handler._replace(unary_unary=_deny_unary)
    if handler.unary_stream:
        return handler._replace(unary_stream=_deny_stream)
    if handler.stream_unary:
        return handler._replace(stream_unary=_deny_unary)
    return handler._replace(stream_stream=_deny_stream)


class CallInterceptor(grpc.aio.ServerInterceptor):
    """For dgserve.v1 calls: sets the request id log context, maps exceptions to statuses (errors.abort), logs
    one access line and counts the outcome (``on_rpc(method, code_name, seconds)`` of the metrics object)."""

    def __init__(self, metrics=None):
        self.metrics = metrics

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(OUR_PREFIX):
            return handler
        metadata = dict(details.invocation_metadata or ())
        handler = handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
        if handler.unary_unary:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, details.method, metadata))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._stream(handler.unary_stream, details.method, metadata))
        return handler

    def _unary(self, behavior, method, metadata):
        async def wrapper(request, context):
            t0, outcome = self._enter(request, metadata), ["OK"]
            try:
                _check_decoded(request)
                return await behavior(request, context)
            except BaseException as e:  # noqa: BLE001 - _fail re-raises all but Exceptions (a status)
                await self._fail(e, context, outcome)
            finally:
                self._exit(method, context, outcome[0], t0)

        return wrapper

    def _stream(self, behavior, method, metadata):
        async def wrapper(request, context):
            t0, outcome = self._enter(request, metadata), ["OK"]
            try:
                _check_decoded(request)
                async for item in behavior(request, context):
                    yield item
            except BaseException as e:  # noqa: BLE001 - _fail re-raises all but Exceptions (a status)
                await self._fail(e, context, outcome)
            finally:
                self._exit(method, context, outcome[0], t0)

        return wrapper

    @staticmethod
    def _enter(request, metadata) -> float:
        rid = getattr(request, "request_id", "") or metadata.get("x-request-id", "")
        request_id_var.set(rid if isinstance(rid, str) else rid.decode())
        return time.perf_counter()

    @staticmethod
    async def _fail(e: BaseException, context, outcome: list) -> None:
        if isinstance(e, asyncio.CancelledError):
            outcome[0] = "CANCELLED"
            raise e
        if isinstance(e, grpc.aio.AbortError):
            outcome[0] = (context.code() or grpc.StatusCode.UNKNOWN).name
            raise e
        if not isinstance(e, Exception):
            raise e
        outcome[0] = errors.classify(e)[0].name
        await errors.abort(context, e)

    def _exit(self, method: str, context, code: str, t0: float) -> None:
        dt = time.perf_counter() - t0
        log.info(
            "%s %s %.1f ms",
            method,
            code,
            dt * 1e3,
            extra={"rpc": method, "code": code, "duration_ms": round(dt * 1e3, 3), "peer": context.peer()},
        )
        if self.metrics is not None:
            self.metrics.on_rpc(method, code, dt)


class _Undecodable:
    """Stands in for a request whose bytes are not a valid message (grpcio would answer UNKNOWN and log a
    traceback; we answer INVALID_ARGUMENT)."""

    request_id = ""

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserializer):
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError (and others on odd input)
            return _Undecodable(e)

    return deserialize


def _check_decoded(request) -> None:
    if isinstance(request, _Undecodable):
        raise ValueError(f"request: not a valid protobuf message ({request.error})")
