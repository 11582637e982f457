"""Structured JSON logs, one object per line. Extras (``stream_id``, ...) become fields; no prompt or
answer text is ever passed to a logger by rsb's own code. A line logged while a span is current (OpenTelemetry on:
broker.telemetry) carries its ``trace_id`` and ``span_id``, so it leads to its trace."""

from __future__ import annotations

import logging
import sys
import time

import orjson

from broker import telemetry

_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STANDARD and not k.startswith("_"):
                out[k] = v
        ids = telemetry.log_ids()
        if ids is not None:
            out["trace_id"], out["span_id"] = ids
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # gguf's writer narrates every file it writes at INFO; the demo model build needs no narration.
    logging.getLogger("gguf").setLevel(logging.WARNING)
