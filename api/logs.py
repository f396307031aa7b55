"""JSON log lines for the API process: one object per line, with the record's structured extras.

Nothing in the API passes a prompt or an output to a logger; the access log carries the route,
status, time, model and task id only.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Final

import msgspec

_STANDARD: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "color_message",  # uvicorn's ANSI-coloured copy of msg
}
_enc: Final = msgspec.json.Encoder(enc_hook=str)


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "msg", ...extras}`; an exception adds its type and message only."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            out["error"] = f"{type(exc).__name__}: {exc}"
        return _enc.encode(out).decode()


def configure(level: str = "info") -> None:
    """Route every logger of the process to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
