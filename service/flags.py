"""The flags of ``dgserve serve``, each with one environment fallback (read in ``service/__main__.py`` only), and
the ServiceConfig field it sets. A help's ``{default}`` is that field's default, read from ``ServiceConfig`` when
the parser is built (``flag_help``), so a default is written once; defaults decided at runtime (the model's, one
per core, twice another flag) are said in words."""

from __future__ import annotations

import dataclasses

from dgserve.engine.cache_config import CacheConfig, kv_cache_memory

from .config import DTYPES, ServiceConfig
from .connections import DEFAULT_CEILING

# (flag, environment variable, ServiceConfig field, parser, help)
FLAGS: list[tuple[str, str, str, object, str]] = [
    (
        "--model",
        "NIM_MODEL_PATH",
        "model",
        str,
        (
            "checkpoint directory, or a Hub id (org/name, downloaded into the huggingface_hub cache; env "
            "NIM_MODEL_NAME when NIM_MODEL_PATH is unset); an existing directory wins (default: the shipped small "
            "model)"
        ),
    ),
    (
        "--revision",
        "DGSERVE_REVISION",
        "revision",
        str,
        "Hub revision of a --model given by id: a branch, tag or commit (default: the repository's default branch)",
    ),
    (
        "--download-dir",
        "NIM_CACHE_PATH",
        "download_dir",
        str,
        "huggingface_hub cache a --model given by id is downloaded into (default: HF_HUB_CACHE, under HF_HOME)",
    ),
    (
        "--served-model-name",
        "NIM_SERVED_MODEL_NAME",
        "served_model_name",
        str,
        "name clients use in `model`; comma-separated: name,alias,... (default: the model directory's name)",
    ),
    ("--host", "DGSERVE_HOST", "host", str, "address to bind (default {default})"),
    ("--port", "DGSERVE_GRPC_PORT", "port", int, "gRPC port (default {default}; 0 = ephemeral)"),
    (
        "--http-port",
        "NIM_SERVER_PORT",
        "http_port",
        str,
        "HTTP port: OpenAI-compatible API, health, metrics (default {default}; 0 = ephemeral; off = none)",
    ),
    ("--max-model-len", "NIM_MAX_MODEL_LEN", "max_model_len", int, "context window (default: the model's)"),
    (
        "--hf-overrides",
        "DGSERVE_HF_OVERRIDES",
        "hf_overrides",
        str,
        (
            "JSON object deep-merged into the checkpoint's config.json before it is parsed, nested objects key by "
            "key, e.g. a full-attention RoPE factor (vLLM's name; docs/generation.md)"
        ),
    ),
    ("--log-level", "NIM_LOG_LEVEL", "log_level", str, "DEBUG | INFO | WARNING | ERROR | CRITICAL (default {default})"),
    ("--max-num-seqs", "DGSERVE_MAX_NUM_SEQS", "max_num_seqs", int, "requests running at once (default {default})"),
    (
        "--cpu-threads",
        "DGSERVE_CPU_THREADS",
        "cpu_threads",
        int,
        (
            "CPU threads for torch and the native ops; 0: the CPUs this process may use, its affinity and its "
            "container's CPU quota (OMP_NUM_THREADS, when set, instead) (default {default})"
        ),
    ),
    (
        "--max-queue-len",
        "DGSERVE_MAX_QUEUE_LEN",
        "max_queue_len",
        int,
        "waiting requests beyond which new ones get RESOURCE_EXHAUSTED (default {default})",
    ),
    (
        "--drain-timeout",
        "DGSERVE_DRAIN_TIMEOUT",
        "drain_timeout",
        float,
        "seconds in-flight streams get after SIGTERM (default {default})",
    ),
    (
        "--auth-token-file",
        "DGSERVE_AUTH_TOKEN_FILE",
        "auth_token_file",
        str,
        "accepted bearer tokens, one a line (health and reflection stay open)",
    ),
    (
        "--caller-header",
        "DGSERVE_CALLER_HEADER",
        "caller_header",
        str.lower,
        (
            "behind a trusted gateway: the request header (gRPC metadata key) whose value names the caller for fair "
            "shares of the running slots (default: each auth token is a caller)"
        ),
    ),
    ("--tls-cert", "DGSERVE_TLS_CERT", "tls_cert", str, "server certificate chain (PEM)"),
    ("--tls-key", "DGSERVE_TLS_KEY", "tls_key", str, "server private key (PEM)"),
    ("--tls-client-ca", "DGSERVE_TLS_CLIENT_CA", "tls_client_ca", str, "CA for client certificates: enables mTLS"),
    ("--device", "DGSERVE_DEVICE", "device", str, "torch device (default {default})"),
    (
        "--dtype",
        "DGSERVE_DTYPE",
        "dtype",
        str,
        (
            f"{' | '.join(DTYPES)} (default {{default}}: bfloat16 on CUDA, float32 "
            "on the CPU; float32 on a GPU only when the weights fit)"
        ),
    ),
    (
        "--native-ops",
        "DGSERVE_NATIVE_OPS",
        "native_ops",
        str,
        (
            "auto | off | strict: self-check the native ops at "
            "start and switch off those that disagree with their reference (auto), use none (off), or refuse to start "
            "(strict) (default {default})"
        ),
    ),
    (
        "--prefill-chunk",
        "DGSERVE_PREFILL_CHUNK",
        "prefill_chunk",
        int,
        "prompt tokens encoded per chunk and per engine iteration (default {default})",
    ),
    (
        "--kv-cache-memory",
        "DGSERVE_KV_CACHE_MEMORY",
        "kv_cache_memory",
        kv_cache_memory,
        (
            "KV cache budget: bytes (2GiB, 512MB) or a fraction of the free memory (default {default}); it decides how "
            "many requests run at once (at most --max-num-seqs)"
        ),
    ),
    (
        "--max-request-steps",
        "DGSERVE_MAX_REQUEST_STEPS",
        "max_request_steps",
        int,
        (
            "most denoising steps one request may run, all its canvases together; then it ends with finish reason "
            "length, keeping what it generated (a max_denoising_steps above it is refused) (default {default})"
        ),
    ),
    (
        "--max-tokens-policy",
        "DGSERVE_MAX_TOKENS_POLICY",
        "max_tokens_policy",
        str,
        (
            "an output limit (max_tokens, max_output_tokens, max_new_tokens) above the room left in the context: "
            "clamp (lowered to the room; finish length when it ends the output) or reject (400 / INVALID_ARGUMENT "
            "naming the field, vLLM's rule) (default {default})"
        ),
    ),
    (
        "--default-max-tokens",
        "DGSERVE_DEFAULT_MAX_TOKENS",
        "default_max_tokens",
        int,
        (
            "output limit of a request that sends none, on every door, at most the room left (default: the "
            "checkpoint's generation_config max_new_tokens or max_length; with neither, the room left for an "
            "output a grammar ends and the built-in max_new_tokens for any other)"
        ),
    ),
    (
        "--max-request-seconds",
        "DGSERVE_MAX_REQUEST_SECONDS",
        "max_request_seconds",
        float,
        (
            "wall-clock seconds one request may run from its admission into a slot (a gRPC deadline ends it sooner); "
            "then it ends with finish reason length, keeping what it generated (default {default})"
        ),
    ),
    (
        "--stall-timeout",
        "DGSERVE_STALL_TIMEOUT",
        "stall_timeout",
        float,
        "abort a stream whose reader takes nothing this long while blocks wait (default {default})",
    ),
    (
        "--max-message-bytes",
        "DGSERVE_MAX_MESSAGE_BYTES",
        "max_message_bytes",
        int,
        "largest gRPC message accepted or sent (default {default})",
    ),
    (
        "--request-timeout",
        "DGSERVE_REQUEST_TIMEOUT",
        "request_timeout",
        float,
        (
            "seconds a connection has to deliver a complete request (HTTP headers and body; gRPC: the HTTP/2 "
            "handshake) before it is closed (default {default})"
        ),
    ),
    (
        "--max-connections",
        "DGSERVE_MAX_CONNECTIONS",
        "max_connections",
        int,
        (
            "open connections on both ports together, half each when HTTP is on; beyond it the oldest connection "
            "without a request is closed (HTTP) or new ones are refused (default: the open-file limit, raised to "
            f"its hard limit, less a reserve, at most {DEFAULT_CEILING})"
        ),
    ),
    (
        "--responses-store-max-entries",
        "DGSERVE_RESPONSES_STORE_MAX_ENTRIES",
        "responses_store_max_entries",
        int,
        (
            "Responses API responses kept in memory for GET and previous_response_id, least recently used dropped "
            "first; 0 = none (default {default})"
        ),
    ),
    (
        "--responses-store-max-bytes",
        "DGSERVE_RESPONSES_STORE_MAX_BYTES",
        "responses_store_max_bytes",
        int,
        "bytes of JSON those kept responses may take in all (default {default})",
    ),
    (
        "--responses-store-max-entries-per-caller",
        "DGSERVE_RESPONSES_STORE_MAX_ENTRIES_PER_CALLER",
        "responses_store_max_entries_per_caller",
        int,
        (
            "Responses API responses one caller (bearer token) may keep, its own least recently used dropped first; "
            "beyond the global caps the caller holding the most gives way (default: --responses-store-max-entries)"
        ),
    ),
    (
        "--responses-store-max-bytes-per-caller",
        "DGSERVE_RESPONSES_STORE_MAX_BYTES_PER_CALLER",
        "responses_store_max_bytes_per_caller",
        int,
        "bytes of JSON one caller's kept responses may take (default: --responses-store-max-bytes)",
    ),
    (
        "--max-images-per-request",
        "DGSERVE_MAX_IMAGES_PER_REQUEST",
        "max_images_per_request",
        int,
        "images one chat request may carry (default {default}; 0 refuses images)",
    ),
    (
        "--max-image-bytes",
        "DGSERVE_MAX_IMAGE_BYTES",
        "max_image_bytes",
        int,
        "encoded bytes of one image, checked before decoding (default {default})",
    ),
    (
        "--max-image-pixels",
        "DGSERVE_MAX_IMAGE_PIXELS",
        "max_image_pixels",
        int,
        "pixels (width x height) one image may declare, checked on its header before decoding (default {default})",
    ),
    (
        "--allowed-media-domains",
        "DGSERVE_ALLOWED_MEDIA_DOMAINS",
        "allowed_media_domains",
        str,
        (
            "hosts http(s) image URLs may be fetched from: names, '*.domain' patterns or '*', comma-separated; a "
            "host named literally may resolve to a private or loopback address (default: none, data URLs only)"
        ),
    ),
    (
        "--media-fetch-timeout",
        "DGSERVE_MEDIA_FETCH_TIMEOUT",
        "media_fetch_timeout",
        float,
        "seconds one remote image's whole fetch may take, redirects and body included (default {default})",
    ),
    (
        "--media-fetch-max-redirects",
        "DGSERVE_MEDIA_FETCH_MAX_REDIRECTS",
        "media_fetch_max_redirects",
        int,
        "redirects one remote image's fetch follows; more is a 400 naming the part (default {default})",
    ),
    (
        "--image-workers",
        "DGSERVE_IMAGE_WORKERS",
        "image_workers",
        int,
        "threads that decode and preprocess images, apart from tokenization (default: one per core, at most 4)",
    ),
    (
        "--image-fetch-workers",
        "DGSERVE_IMAGE_FETCH_WORKERS",
        "image_fetch_workers",
        int,
        "threads that fetch remote images (I/O only: a slow host never holds a decode thread) (default {default})",
    ),
    (
        "--image-queue-len",
        "DGSERVE_IMAGE_QUEUE_LEN",
        "image_queue_len",
        int,
        (
            "images that may wait for an image thread beyond those being read; a request whose images would pass it "
            "gets RESOURCE_EXHAUSTED / 429 with a retry delay (default {default})"
        ),
    ),
    (
        "--image-decode-pixels",
        "DGSERVE_IMAGE_DECODE_PIXELS",
        "image_decode_pixels",
        int,
        (
            "pixels (width x height, as declared) decoded at once across all requests: it bounds the memory images "
            "take, whatever the number of callers; at least --max-image-pixels (default: twice it)"
        ),
    ),
    (
        "--image-token-cost",
        "DGSERVE_IMAGE_TOKEN_COST",
        "image_token_cost",
        float,
        (
            "prompt tokens one image soft token counts for in an iteration's prefill budget, 1 to 1000 (default: "
            "the device's, 2 on the CPU and 1 elsewhere)"
        ),
    ),
    (
        "--allowed-hosts",
        "DGSERVE_ALLOWED_HOSTS",
        "allowed_hosts",
        str,
        (
            "HTTP Host names served besides localhost, IP literals, the bound address and this machine's hostname "
            "and FQDN: comma-separated names or '*.domain' patterns, or '*' for any (others get 400: DNS rebinding)"
        ),
    ),
    (
        "--allowed-origins",
        "DGSERVE_ALLOWED_ORIGINS",
        "allowed_origins",
        str,
        (
            "browser origins (scheme://host[:port], comma-separated, or '*') whose cross-origin requests are served "
            "with CORS headers; requests from other origins get 403 (default: none, same-origin only)"
        ),
    ),
    (
        "--keepalive-min-ping-ms",
        "DGSERVE_KEEPALIVE_MIN_PING_MS",
        "keepalive_min_ping_ms",
        int,
        "clients may ping this often without GOAWAY (default {default})",
    ),
]
SWITCHES = [  # (flag, environment variable, field, value when set, help)
    ("--json-logs", "NIM_JSONL_LOGGING", "json_logs", True, "JSON-lines logs with the request id on every line"),
    (
        "--allow-long-max-model-len",
        "DGSERVE_ALLOW_LONG_MAX_MODEL_LEN",
        "allow_long_max_model_len",
        True,
        (
            "let --max-model-len exceed the model's max_position_embeddings (a warning is logged; vLLM's "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN)"
        ),
    ),
    ("--no-reflection", "DGSERVE_NO_REFLECTION", "reflection", False, "do not serve gRPC reflection"),
    ("--no-warm-up", "DGSERVE_NO_WARM_UP", "warm_up", False, "skip the warm-up generation before readiness"),
    (
        "--no-prefix-caching",
        "DGSERVE_NO_PREFIX_CACHING",
        "prefix_caching",
        False,
        "do not reuse the KV of prompt prefixes across requests (docs/prefix-caching.md)",
    ),
    (
        "--no-playground",
        "DGSERVE_NO_PLAYGROUND",
        "playground",
        False,
        "do not serve the playground and dashboard pages (/, /playground, /dashboard) on the HTTP port",
    ),
    (
        "--trust-request-chat-template",
        "DGSERVE_TRUST_REQUEST_CHAT_TEMPLATE",
        "trust_request_chat_template",
        True,
        (
            "let chat requests send their own chat_template (sandboxed jinja, but its work is unbounded: trusted "
            "callers only; off: 400 naming chat_template)"
        ),
    ),
]


def field_default(name: str):
    """ServiceConfig's default for field ``name`` (its default_factory called where it has one)."""
    (f,) = [f for f in dataclasses.fields(ServiceConfig) if f.name == name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[operator]


def shown_default(name: str) -> str:
    """Field ``name``'s default as a help shows it: whole MiB for byte sizes, 30 for 30.0, the KV cache fraction."""
    value = field_default(name)
    if isinstance(value, CacheConfig):
        return f"{value.fraction:g}" if value.memory is None else f"{value.memory} bytes"
    if name.endswith("_bytes") and isinstance(value, int) and value % (1 << 20) == 0:
        return f"{value >> 20} MiB"
    return f"{value:g}" if isinstance(value, float) else str(value)


def flag_help(field: str, text: str) -> str:
    """``text`` with ``{default}`` replaced by field ``field``'s default (``shown_default``)."""
    return text.replace("{default}", shown_default(field)) if "{default}" in text else text
