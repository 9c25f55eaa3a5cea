"""Logging setup: plain text or JSON lines (NIM_JSONL_LOGGING), with the request id of the current call on
every line logged inside it (a context variable set per RPC by the call interceptor).

Log lines carry text that clients chose (ids, prompts in error messages, peer strings): both formats escape it,
so that no client can forge or split a line. JSON escapes control characters by itself; the text format writes
each non-printable character of the message and the request id as its Python escape (``\n``, ``\x00``).
Tracebacks are ours and keep their lines."""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import sys

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
_STD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", None):
            record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id, extra fields, exception."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", ""),
        }
        out.update({k: v for k, v in record.__dict__.items() if k not in _STD and k not in out})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def escape(text: str) -> str:
    """``text`` with every non-printable character (newline, NUL, ESC, U+2028, ...) written as its repr escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class TextFormatter(logging.Formatter):
    """``time level logger [request_id] message`` with the message and request id escaped (one line each)."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        safe = logging.makeLogRecord(record.__dict__)
        safe.message = escape(record.message)
        safe.request_id = escape(str(getattr(record, "request_id", "")))
        return super().formatMessage(safe)


def setup_logging(level: str = "INFO", json_lines: bool = False, stream=None) -> None:
    """Configure the root logger once (replacing its handlers)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
