"""Structured ``key=value`` log lines (docs/invariants.md, I8): the one helper every package logs through.

``log_event(log, "subagent_recovery_start", execution_id=7, parent_id=3)`` writes
``event=subagent_recovery_start execution_id=7 parent_id=3``. Only safe values go in: event
names, ids, counts, durations, reasons, error types and codes. Never an API key, a cookie, a token,
a task text, a prompt or a model answer (invariant I8): callers pass every field explicitly,
nothing is logged by reflection.

One spelling per field everywhere, snake_case (the recovery specification's camelCase names are mapped in
docs/operations.md, "Metrics and alerts"); a field that means the same thing has the same name in every package:

- ids: ``execution_id``, ``session_id`` (the session the line is about), ``parent_id`` (a
  parent session), ``child_session_id``, ``tool_call_id``, ``round_id``, ``journal_id``,
  ``run_id``, ``request_id``, ``key`` (a field recovery's idempotency key);
- lists of ids: ``execution_ids`` (``fmt`` joins a list with commas);
- ownership: ``epoch``, ``worker``, ``generation``;
- what happened: ``outcome`` (an outcome enum's value), ``status``, ``reason`` (why nothing
  was done), ``error`` (an exception's type name only, never its message), ``error_code`` (a
  classified, safe code such as ``http_5xx``);
- time: ``duration_ms``, ``wait_ms`` (whole milliseconds, the unit in the name);
- counts are plain nouns: ``executions``, ``parents``, ``delivered``, ``rounds``; ``attempt`` counts from 1.
"""

from __future__ import annotations

import json
import logging
from typing import Any


def fmt(value: Any) -> str:
    """One value as it appears after ``key=``: ``-`` for None, quoted when it has blanks."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list | tuple | set | frozenset):
        return ",".join(fmt(v) for v in value) or "-"
    text = str(value)
    if not text or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text, ensure_ascii=False)
    return text


def line(event: str, **fields: Any) -> str:
    """``event=NAME k=v ...`` in the order the fields were given."""
    return " ".join([f"event={event}", *(f"{k}={fmt(v)}" for k, v in fields.items())])


def log_event(
    logger: logging.Logger, event: str, level: int = logging.INFO, *, exc_info: bool = False, **fields: Any
) -> None:
    """Log one structured event line at ``level`` (with the traceback when ``exc_info``); the
    record names the caller's file and line, not this helper's."""
    if logger.isEnabledFor(level):
        logger.log(level, "%s", line(event, **fields), exc_info=exc_info, stacklevel=2)
