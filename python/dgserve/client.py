"""Python clients for a dgserve server: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

    with Client("localhost:50051") as c:
        for event in c.generate("Hello", max_new_tokens=64, seed=1):       # GenerateResponse messages
            if event.HasField("block"):
                print(event.block.text, end="", flush=True)
        result = c.generate_text("Hello", max_new_tokens=64)               # the whole answer at once

Sampling knobs are keyword arguments named as ``dgserve.SamplingParams`` (``stop`` takes a list). Errors are
``grpc.RpcError`` with the server's status code and message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import grpc

from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

FINISH_REASONS = {
    pb.FINISH_REASON_EOS: "eos",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_UNSPECIFIED: "unspecified",
}
HEALTH_SERVICE = "dgserve.v1.TextGeneration"
RpcError = grpc.RpcError


def error_text(e: grpc.RpcError) -> str:
    """ "CODE: details" of a failed call."""
    return f"{e.code().name}: {e.details()}"


@dataclass
class GenerateResult:
    """A finished stream, collected."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    seed: int = 0
    usage: pb.Usage | None = None
    timing: pb.Timing | None = None
    blocks: list[pb.Block] = field(default_factory=list)

    def add(self, event: pb.GenerateResponse) -> None:
        self.request_id = event.request_id
        kind = event.WhichOneof("event")
        if kind == "started":
            self.seed = event.started.seed
        elif kind == "block":
            self.blocks.append(event.block)
            self.text += event.block.text
            self.token_ids.extend(event.block.token_ids)
        elif kind == "finished":
            f = event.finished
            self.finish_reason, self.usage, self.timing = FINISH_REASONS[f.finish_reason], f.usage, f.timing


def build_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[dict[str, Any]] | None = None,
    request_id: str = "",
    model: str = "",
    drafts: bool = False,
    draft_every: int = 1,
    enable_thinking: bool = False,
    **params: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest from exactly one of prompt / token_ids / messages ({"role", "content"} dicts)."""
    given = [x is not None for x in (prompt, token_ids, messages)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, token_ids, messages")
    req = pb.GenerateRequest(
        request_id=request_id,
        model=model,
        params=pb.SamplingParams(**{k: v for k, v in params.items() if v is not None}),
        drafts=pb.DraftOptions(enabled=drafts, every_n_steps=draft_every),
    )
    if prompt is not None:
        req.prompt = prompt
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    elif messages is not None:
        req.chat.CopyFrom(chat_message(messages, enable_thinking))
    return req


def chat_message(messages: Sequence[dict[str, Any]], enable_thinking: bool = False) -> pb.Chat:
    return pb.Chat(
        messages=[pb.ChatMessage(role=m["role"], content=m.get("content", "")) for m in messages],
        enable_thinking=enable_thinking,
    )


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def _credentials(
    root_certificates: bytes | None, client_cert: bytes | None, client_key: bytes | None
) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=root_certificates, private_key=client_key, certificate_chain=client_cert
    )


_KEEPALIVE = (("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_permit_without_calls", 1))


class Client:
    """Blocking client. ``tls``: use TLS (``root_certificates`` PEM bytes, else the system roots); mTLS with
    ``client_cert`` and ``client_key``. ``token``: bearer token sent on every call."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        client_cert: bytes | None = None,
        client_key: bytes | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ):
        opts = list(_KEEPALIVE) + list(options)
        self.channel = (
            grpc.secure_channel(target, _credentials(root_certificates, client_cert, client_key), opts)
            if tls
            else grpc.insecure_channel(target, opts)
        )
        self.stub = pb_grpc.TextGenerationStub(self.channel)
        self.metadata = _metadata(token)

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> Iterator[pb.GenerateResponse]:
        """Stream the events of one request (see build_request for the arguments). Closing the iterator early
        cancels the request on the server."""
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout, metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def generate_text(self, prompt: str | None = None, **kwargs: Any) -> GenerateResult:
        result = GenerateResult()
        for event in self.generate(prompt, **kwargs):
            result.add(event)
        return result

    def abort(self, request_id: str) -> str:
        """ "cancelled" or "already_finished"; grpc.RpcError NOT_FOUND for an unknown id."""
        r = self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self.metadata)
        return pb.AbortOutcome.Name(r.outcome).removeprefix("ABORT_OUTCOME_").lower()

    def tokenize(self, prompt: str | None = None, *, messages: Sequence[dict[str, Any]] | None = None) -> list[int]:
        req = pb.TokenizeRequest(prompt=prompt) if messages is None else pb.TokenizeRequest(chat=chat_message(messages))
        return list(self.stub.Tokenize(req, metadata=self.metadata).token_ids)

    def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        info: pb.GetModelInfoResponse = self.stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata
        )
        return info

    def health(self, service: str = HEALTH_SERVICE, timeout: float | None = 5.0) -> str:
        """ "SERVING", "NOT_SERVING", ... of grpc.health.v1 ("" and the default name: readiness; "liveness")."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        # types-grpcio-health-checking declares HealthStub without the methods grpc sets in its __init__
        r = health_pb2_grpc.HealthStub(self.channel).Check(  # type: ignore[attr-defined]
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


class AsyncClient:
    """asyncio client; same methods as Client, as coroutines (``generate`` is an async iterator)."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        client_cert: bytes | None = None,
        client_key: bytes | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ):
        opts = list(_KEEPALIVE) + list(options)
        self.channel = (
            grpc.aio.secure_channel(target, _credentials(root_certificates, client_cert, client_key), opts)
            if tls
            else grpc.aio.insecure_channel(target, opts)
        )
        self.stub = pb_grpc.TextGenerationStub(self.channel)
        self.metadata = _metadata(token)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout, metadata=self.metadata)
        try:
            async for event in call:
                yield event
        finally:
            call.cancel()

    async def generate_text(self, prompt: str | None = None, **kwargs: Any) -> GenerateResult:
        result = GenerateResult()
        async for event in self.generate(prompt, **kwargs):
            result.add(event)
        return result

    async def abort(self, request_id: str) -> str:
        r = await self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self.metadata)
        return pb.AbortOutcome.Name(r.outcome).removeprefix("ABORT_OUTCOME_").lower()

    async def tokenize(
        self, prompt: str | None = None, *, messages: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        req = pb.TokenizeRequest(prompt=prompt) if messages is None else pb.TokenizeRequest(chat=chat_message(messages))
        return list((await self.stub.Tokenize(req, metadata=self.metadata)).token_ids)

    async def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        info: pb.GetModelInfoResponse = await self.stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata
        )
        return info
