"""``dgserve serve`` (also ``python -m dgserve.service``): flags, each with one environment fallback (read here and
nowhere else), → ServiceConfig → run the gRPC and OpenAI-compatible HTTP server until SIGTERM (graceful drain).
``--dry-run`` prints the resolved config as JSON and exits.

Precedence: a flag given on the command line, then its environment variable, then the default.

Exit status: 0 after a graceful drain; 2 when startup cannot succeed (a bad flag or env value, a port in use, a
missing or unreadable model, auth or TLS file, a model that fails to load), with one line on stderr naming the
problem and the flag / env var that fixes it (the traceback too only with ``--log-level debug``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import traceback

from dgserve.engine.cache_config import kv_cache_memory

from .config import DTYPES, ServiceConfig

_TRUE = {"1", "true", "yes", "on"}

# (flag, environment variable, ServiceConfig field, parser, help)
FLAGS: list[tuple[str, str, str, object, str]] = [
    ("--model", "NIM_MODEL_PATH", "model", str, "checkpoint directory (default: the shipped small model)"),
    (
        "--served-model-name",
        "NIM_SERVED_MODEL_NAME",
        "served_model_name",
        str,
        "name clients use in `model`; comma-separated: name,alias,... (default: the model directory's name)",
    ),
    ("--host", "DGSERVE_HOST", "host", str, "address to bind (default 0.0.0.0)"),
    ("--port", "DGSERVE_GRPC_PORT", "port", int, "gRPC port (default 50051; 0 = ephemeral)"),
    (
        "--http-port",
        "NIM_SERVER_PORT",
        "http_port",
        str,
        "HTTP port: OpenAI-compatible API, health, metrics (default 8000; 0 = ephemeral; off = none)",
    ),
    ("--max-model-len", "NIM_MAX_MODEL_LEN", "max_model_len", int, "context window (default: the model's)"),
    ("--log-level", "NIM_LOG_LEVEL", "log_level", str, "DEBUG | INFO | WARNING | ERROR | CRITICAL"),
    ("--max-num-seqs", "DGSERVE_MAX_NUM_SEQS", "max_num_seqs", int, "requests running at once (default 32)"),
    (
        "--max-queue-len",
        "DGSERVE_MAX_QUEUE_LEN",
        "max_queue_len",
        int,
        "waiting requests beyond which new ones get RESOURCE_EXHAUSTED (default 256)",
    ),
    (
        "--drain-timeout",
        "DGSERVE_DRAIN_TIMEOUT",
        "drain_timeout",
        float,
        "seconds in-flight streams get after SIGTERM (default 30)",
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
    ("--device", "DGSERVE_DEVICE", "device", str, "torch device (default cpu)"),
    (
        "--dtype",
        "DGSERVE_DTYPE",
        "dtype",
        str,
        (
            f"{' | '.join(DTYPES)} (default auto: bfloat16 on CUDA, float32 "
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
            "(strict)"
        ),
    ),
    (
        "--prefill-chunk",
        "DGSERVE_PREFILL_CHUNK",
        "prefill_chunk",
        int,
        "prompt tokens encoded per chunk and per engine iteration (default 512)",
    ),
    (
        "--kv-cache-memory",
        "DGSERVE_KV_CACHE_MEMORY",
        "kv_cache_memory",
        kv_cache_memory,
        (
            "KV cache budget: bytes (2GiB, 512MB) or a fraction of the free memory (default 0.9); it decides how "
            "many requests run at once (at most --max-num-seqs)"
        ),
    ),
    (
        "--max-request-steps",
        "DGSERVE_MAX_REQUEST_STEPS",
        "max_request_steps",
        int,
        (
            "most denoising steps one request may ask for: max_denoising_steps x its canvases (max_new_tokens / "
            "canvas length); more is refused with INVALID_ARGUMENT / 400 (default 16384)"
        ),
    ),
    (
        "--max-request-seconds",
        "DGSERVE_MAX_REQUEST_SECONDS",
        "max_request_seconds",
        float,
        (
            "wall-clock seconds one request may run from its admission into a slot (a gRPC deadline ends it sooner); "
            "then it ends with finish reason length, keeping what it generated (default 600)"
        ),
    ),
    (
        "--stall-timeout",
        "DGSERVE_STALL_TIMEOUT",
        "stall_timeout",
        float,
        "abort a stream whose reader takes nothing this long while blocks wait (default 30)",
    ),
    (
        "--max-message-bytes",
        "DGSERVE_MAX_MESSAGE_BYTES",
        "max_message_bytes",
        int,
        "largest gRPC message accepted or sent (default 16 MiB)",
    ),
    (
        "--request-timeout",
        "DGSERVE_REQUEST_TIMEOUT",
        "request_timeout",
        float,
        (
            "seconds a connection has to deliver a complete request (HTTP headers and body; gRPC: the HTTP/2 "
            "handshake) before it is closed (default 30)"
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
            "its hard limit, less a reserve, at most 16384)"
        ),
    ),
    (
        "--responses-store-max-entries",
        "DGSERVE_RESPONSES_STORE_MAX_ENTRIES",
        "responses_store_max_entries",
        int,
        (
            "Responses API responses kept in memory for GET and previous_response_id, least recently used dropped "
            "first; 0 = none (default 1024)"
        ),
    ),
    (
        "--responses-store-max-bytes",
        "DGSERVE_RESPONSES_STORE_MAX_BYTES",
        "responses_store_max_bytes",
        int,
        "bytes of JSON those kept responses may take in all (default 64 MiB)",
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
        "images one chat request may carry (default 8; 0 refuses images)",
    ),
    (
        "--max-image-bytes",
        "DGSERVE_MAX_IMAGE_BYTES",
        "max_image_bytes",
        int,
        "encoded bytes of one image, checked before decoding (default 20 MiB)",
    ),
    (
        "--max-image-pixels",
        "DGSERVE_MAX_IMAGE_PIXELS",
        "max_image_pixels",
        int,
        "pixels (width x height) one image may declare, checked on its header before decoding (default 40000000)",
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
        "seconds one remote image's whole fetch may take, redirects and body included (default 10)",
    ),
    (
        "--media-fetch-max-redirects",
        "DGSERVE_MEDIA_FETCH_MAX_REDIRECTS",
        "media_fetch_max_redirects",
        int,
        "redirects one remote image's fetch follows; more is a 400 naming the part (default 3)",
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
        "threads that fetch remote images (I/O only: a slow host never holds a decode thread) (default 16)",
    ),
    (
        "--image-queue-len",
        "DGSERVE_IMAGE_QUEUE_LEN",
        "image_queue_len",
        int,
        (
            "images that may wait for an image thread beyond those being read; a request whose images would pass it "
            "gets RESOURCE_EXHAUSTED / 429 with a retry delay (default 64)"
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
        "clients may ping this often without GOAWAY (default 10000)",
    ),
]
SWITCHES = [  # (flag, environment variable, field, value when set, help)
    ("--json-logs", "NIM_JSONL_LOGGING", "json_logs", True, "JSON-lines logs with the request id on every line"),
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dgserve serve", description=__doc__.split("\n\n")[0])
    for flag, env, _, _, help_ in FLAGS:
        p.add_argument(flag, default=None, help=f"{help_} [env {env}]")
    for flag, env, _, _, help_ in SWITCHES:
        p.add_argument(flag, action="store_true", default=None, help=f"{help_} [env {env}=1]")
    p.add_argument("--dry-run", action="store_true", help="print the resolved configuration as JSON and exit")
    return p


def build_config(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> tuple[ServiceConfig, bool]:
    """(config, dry_run) from the command line and the environment (os.environ by default). ValueError naming the
    field, then the flag and env var that set it."""
    env = dict(os.environ if environ is None else environ)
    args = _parser().parse_args(argv)
    try:
        kw: dict = {}
        for flag, var, field, parse, _ in FLAGS:
            raw = getattr(args, flag[2:].replace("-", "_"))
            raw = raw if raw is not None else env.get(var)
            if raw is not None and raw != "":
                kw[field] = _convert(field, raw, parse)
        kw.update(
            {
                field: value
                for flag, var, field, value, _ in SWITCHES
                if getattr(args, flag[2:].replace("-", "_")) or env.get(var, "").strip().lower() in _TRUE
            }
        )
        return ServiceConfig(**kw), args.dry_run
    except ValueError as e:
        raise ValueError(f"{e}{_fix_hint(str(e))}") from None


def _fix_hint(message: str) -> str:
    """ " (set --flag / env VAR)" for each config field a ServiceConfig message names; "" when none."""
    hints = [f"{flag} / env {var}" for flag, var, field, *_ in FLAGS + SWITCHES if re.search(rf"\b{field}\b", message)]
    return f" (set {'; '.join(hints)})" if hints else ""


def _convert(field: str, raw: str, parse):
    if field in ("served_model_name", "allowed_hosts", "allowed_origins", "allowed_media_domains"):
        return tuple(n.strip() for n in raw.split(",") if n.strip())
    if field == "http_port":
        return None if raw.strip().lower() in ("off", "none", "-1") else int(raw)
    try:
        return parse(raw)
    except ValueError:
        raise ValueError(f"{field}: cannot parse {raw!r} as {parse.__name__}") from None


def _runtime(config: ServiceConfig) -> dict:
    """The resolved device, dtype, expert format and native ops (dgserve.model.runtime), for --dry-run."""
    from dgserve.model.default_model import default_model_path
    from dgserve.model.runtime import describe, plan_runtime

    try:
        return describe(
            plan_runtime(config.model or default_model_path(), config.device, config.dtype, config.native_ops)
        )
    except Exception as e:  # noqa: BLE001 - a dry run reports, it does not fail
        return {"problem": f"{type(e).__name__}: {e}"}


def main(argv: list[str] | None = None) -> int:
    try:
        config, dry_run = build_config(argv)
    except ValueError as e:
        print(f"dgserve serve: error: {e}", file=sys.stderr)
        return 2
    if dry_run:
        print(json.dumps({**config.to_dict(), "runtime": _runtime(config)}, indent=2, sort_keys=True))
        return 0
    from .logs import setup_logging
    from .server import Server, StartupError

    setup_logging(config.log_level, config.json_logs)
    try:
        asyncio.run(Server(config).run())
    except StartupError as e:
        if config.log_level.upper() == "DEBUG":
            traceback.print_exception(e.__cause__ or e)
        print(f"dgserve serve: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
