"""ServiceConfig: everything the server needs, built once in ``service/__main__.py`` (flags + environment) or
directly by tests and embedders. Frozen; ValueError naming the field on a bad value."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from dgserve.engine.cache_config import CacheConfig
from dgserve.engine.request_checks import MAX_TOKENS_POLICIES
from dgserve.engine.scheduler import DEFAULT_MAX_NUM_SEQS, check_image_token_cost
from dgserve.sampling_params import MAX_NEW_TOKENS_LIMIT

DTYPES = ("auto", "float32", "bfloat16")  # auto: bfloat16 on CUDA, float32 on the CPU (dgserve.model.runtime)
NATIVE_OPS_MODES = ("auto", "off", "strict")  # dgserve.ops.native_check
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_LABELS = r"[a-z0-9_-]+(\.[a-z0-9_-]+)*"
HOST_PATTERN = re.compile(rf"\*|(\*\.)?{_LABELS}\.?", re.I)  # a name, a *.domain pattern, or * (any)
ORIGIN_PATTERN = re.compile(rf"\*|https?://({_LABELS}|\[[0-9a-f:.]+\])(:[0-9]{{1,5}})?/?", re.I)
CALLER_HEADER_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
MAX_REQUEST_SECONDS = 7 * 86400  # the largest --max-request-seconds: a week
MAX_MEDIA_FETCH_SECONDS = 600.0  # the largest --media-fetch-timeout
MAX_MEDIA_REDIRECTS = 20  # the largest --media-fetch-max-redirects


@dataclass(frozen=True)
class ServiceConfig:
    model: str | None = None  # checkpoint directory or Hub id (org/name); None = dgserve.default_model_path()
    revision: str | None = None  # Hub revision of a model given by id: branch, tag or commit; None = the default
    download_dir: str | None = None  # huggingface_hub cache Hub models go to; None = its own (HF_HUB_CACHE)
    served_model_name: tuple[str, ...] = ()  # name, then aliases; empty = the model directory's name
    host: str = "0.0.0.0"
    port: int = 50051  # gRPC; 0 = ephemeral
    http_port: int | None = 8000  # OpenAI-compatible API + health + metrics; 0 = ephemeral; None = off
    device: str = "cpu"
    dtype: str = "auto"
    native_ops: str = "auto"  # auto: self-check, failing ops off; off: none; strict: refuse to start
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    hf_overrides: dict | None = None  # deep-merged into config.json before it is parsed (--hf-overrides)
    allow_long_max_model_len: bool = False  # max_model_len may exceed max_position_embeddings (with a warning)
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # running requests (the engine's default too)
    cpu_threads: int = 0  # torch's CPU threads; 0 = the CPUs the process may use (docs/deployment.md, "CPU threads")
    max_queue_len: int = 256  # waiting requests beyond which new ones get RESOURCE_EXHAUSTED
    prefill_chunk: int = 512  # prompt tokens per encoder chunk and per engine iteration
    kv_cache_memory: CacheConfig = field(
        default_factory=CacheConfig
    )  # KV cache budget: bytes or a fraction of free memory
    max_request_steps: int = 16384  # denoising steps one request may run, all canvases (then: "length")
    max_tokens_policy: str = "clamp"  # an output limit above the room left: "clamp" to it or "reject" (400)
    default_max_tokens: int | None = None  # a request without one; None = the checkpoint's (docs/generation.md)
    max_request_seconds: float = 600.0  # wall-clock seconds a request may run from admission (then: "length")
    drain_timeout: float = 30.0  # seconds in-flight streams get after SIGTERM
    stall_timeout: float = 30.0  # a reader taking nothing this long while blocks wait is aborted
    auth_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # given: mTLS (clients must present a certificate it signed)
    log_level: str = "INFO"
    json_logs: bool = False
    max_message_bytes: int = 16 << 20  # largest request / response message
    keepalive_time_ms: int = 60_000  # server pings idle connections this often
    keepalive_min_ping_ms: int = 10_000  # clients may ping this often (with or without calls)
    request_timeout: float = 30.0  # seconds a connection has to deliver a complete request (both ports)
    max_connections: int | None = None  # both ports together; None = from the open-file limit (service/connections)
    reflection: bool = True
    warm_up: bool = True
    prefix_caching: bool = True  # reuse the KV of cached prompt prefixes (docs/prefix-caching.md)
    trust_request_chat_template: bool = False  # chat requests may send their own chat_template (docs/generation.md)
    responses_store_max_entries: int = 1024  # Responses API responses kept in memory (docs/responses-api.md)
    responses_store_max_bytes: int = 64 << 20  # their JSON bytes in all
    # what one caller (bearer token) may keep of them; None = the global cap. Beyond the global cap the caller
    # holding the most gives way (docs/responses-api.md, "The store")
    responses_store_max_entries_per_caller: int | None = None
    responses_store_max_bytes_per_caller: int | None = None
    # HTTP Host names served besides localhost, IP literals, the bound address and the machine's names; ("*",): any
    allowed_hosts: tuple[str, ...] = ()
    # origins (scheme://host[:port]) whose browser requests are served besides same-origin ones; ("*",): any
    allowed_origins: tuple[str, ...] = ()
    playground: bool = True  # serve the playground and dashboard pages on the HTTP port (docs/playground.md)
    # a trusted gateway's header naming the caller, for fair shares of the running slots (docs/architecture.md,
    # "Fair shares between callers"); None: callers are tokens (auth on) or there is one caller
    caller_header: str | None = None
    # image caps, checked before any pixel is decoded (docs/images.md, "Limits")
    max_images_per_request: int = 8
    max_image_bytes: int = 20 << 20  # encoded bytes of one image
    max_image_pixels: int = 40_000_000  # width x height one image declares
    # hosts remote images may be fetched from (names, *.domain patterns, "*"); () refuses every http(s) image URL
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout: float = 10.0  # seconds one remote image's whole fetch may take (every hop, the body)
    media_fetch_max_redirects: int = 3  # redirects one remote image's fetch follows
    # the image stage (docs/images.md, "Admission"): decode threads (None: one per core, at most 4), fetch threads,
    # images queued beyond the decode threads (then RESOURCE_EXHAUSTED / 429), and pixels decoded at once across all
    # requests (None: twice max_image_pixels; at least max_image_pixels)
    image_workers: int | None = None
    image_fetch_workers: int = 16
    image_queue_len: int = 64
    image_decode_pixels: int | None = None
    # what one image soft token counts in the per-iteration prefill budget (docs/images.md, "Bounded like text");
    # None = the device's default
    image_token_cost: float | None = None

    def __post_init__(self) -> None:
        for name, lo, hi in (
            ("port", 0, 65535),
            ("max_num_seqs", 1, 1 << 20),
            ("cpu_threads", 0, 4096),
            ("max_queue_len", 0, 1 << 24),
            ("prefill_chunk", 1, 1 << 24),
            ("max_request_steps", 1, 1 << 31),
            ("max_message_bytes", 1024, 1 << 31),
            ("keepalive_time_ms", 1000, 1 << 31),
            ("keepalive_min_ping_ms", 100, 1 << 31),
            ("responses_store_max_entries", 0, 1 << 24),
            ("responses_store_max_bytes", 0, 1 << 40),
            ("max_images_per_request", 0, 1 << 16),
            ("max_image_bytes", 1, 1 << 31),
            ("max_image_pixels", 1, 1 << 40),
            ("media_fetch_max_redirects", 0, MAX_MEDIA_REDIRECTS),
            ("image_fetch_workers", 1, 1024),
            ("image_queue_len", 0, 1 << 20),
        ):
            _int(name, getattr(self, name), lo, hi)
        if self.image_workers is not None:
            _int("image_workers", self.image_workers, 1, 1024)
        if self.default_max_tokens is not None:
            _int("default_max_tokens", self.default_max_tokens, 1, MAX_NEW_TOKENS_LIMIT)
        if self.max_tokens_policy not in MAX_TOKENS_POLICIES:
            policies = ", ".join(MAX_TOKENS_POLICIES)
            raise ValueError(f"max_tokens_policy must be one of {policies}, got {self.max_tokens_policy!r}")
        if self.image_decode_pixels is not None:
            _int("image_decode_pixels", self.image_decode_pixels, 1, 1 << 42)
            if self.image_decode_pixels < self.max_image_pixels:
                raise ValueError(
                    f"image_decode_pixels must be at least max_image_pixels ({self.max_image_pixels}): an image under "
                    f"the per-image cap must fit the budget, got {self.image_decode_pixels}"
                )
        if self.caller_header is not None and not CALLER_HEADER_PATTERN.fullmatch(self.caller_header):
            raise ValueError(
                "caller_header must be a lowercase header name (letters, digits and '-', at most 64 characters), "
                f"got {self.caller_header!r}"
            )
        if self.caller_header in ("authorization", "x-api-key", "cookie"):
            raise ValueError(f"caller_header must not be a credential header, got {self.caller_header!r}")
        if self.http_port is not None:
            _int("http_port", self.http_port, 0, 65535)
        if self.max_model_len is not None:
            _int("max_model_len", self.max_model_len, 1, 1 << 30)
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a JSON object, got {type(self.hf_overrides).__name__}")
        for name, hi in (
            ("responses_store_max_entries_per_caller", 1 << 24),
            ("responses_store_max_bytes_per_caller", 1 << 40),
        ):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), 0, hi)
        if self.max_connections is not None:
            _int("max_connections", self.max_connections, 2, 1 << 24)  # at least one per port
        v = self.request_timeout
        # grpc takes milliseconds: below 1 ms would round to its "no timeout" 0
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.001 <= v <= 86400:
            raise ValueError(f"request_timeout must be a number of seconds in [0.001, 86400], got {v!r}")
        _seconds("max_request_seconds", self.max_request_seconds, MAX_REQUEST_SECONDS)
        _seconds("media_fetch_timeout", self.media_fetch_timeout, MAX_MEDIA_FETCH_SECONDS)
        check_image_token_cost(self.image_token_cost)
        for name in ("drain_timeout", "stall_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.native_ops not in NATIVE_OPS_MODES:
            raise ValueError(f"native_ops must be one of {', '.join(NATIVE_OPS_MODES)}, got {self.native_ops!r}")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        if any(not n for n in self.served_model_name):
            raise ValueError("served_model_name: names must be non-empty")
        for name, pattern, what in (
            ("allowed_hosts", HOST_PATTERN, "a host name, a '*.domain' pattern or '*'"),
            ("allowed_media_domains", HOST_PATTERN, "a host name, a '*.domain' pattern or '*'"),
            ("allowed_origins", ORIGIN_PATTERN, "an origin (http[s]://host[:port]) or '*'"),
        ):
            for entry in getattr(self, name):
                if not isinstance(entry, str) or not pattern.fullmatch(entry):
                    raise ValueError(f"{name}: {entry!r} is not {what}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _int(name: str, v, lo: int, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")


def _seconds(name: str, v, hi: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= hi:
        raise ValueError(f"{name} must be a number of seconds in (0, {hi:g}], got {v!r}")
