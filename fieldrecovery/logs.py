"""Structured ``key=value`` log lines for field recovery (DESIGN §9).

Only safe values go in: event names, idempotency keys, request/run/session ids, profile
versions, counts, durations and error codes. Never a key, a cookie, a CSRF token, a request or
an answer text (DESIGN I8); callers pass fields explicitly, nothing is logged by reflection.
"""

from __future__ import annotations

import json
import logging
from typing import Any

ROOT = "fieldrecovery"


def get_logger(name: str) -> logging.Logger:
    """A logger under ``fieldrecovery`` (``get_logger("client")`` -> fieldrecovery.client)."""
    return logging.getLogger(f"{ROOT}.{name}")


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value)
    if not text or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text, ensure_ascii=False)
    return text


def line(event: str, **fields: Any) -> str:
    return " ".join([f"event={event}", *(f"{k}={_fmt(v)}" for k, v in fields.items())])


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    logger.log(level, "%s", line(event, **fields))
