"""Structured log lines of field recovery: the project's one helper (``logfmt``), re-exported
for the field modules. Only safe values go in (docs/invariants.md, I8): event names, idempotency keys,
request/run/session ids, profile versions, counts, durations and error codes; never a key, a
cookie, a CSRF token, a request or an answer text.
"""

from __future__ import annotations

from logfmt import fmt, line, log_event

__all__ = ["fmt", "line", "log_event"]
