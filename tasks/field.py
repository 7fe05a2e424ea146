"""Celery adapters for field recovery: `field.recover_eml` and the beat task `field.purge_expired`.

The deadline (max_wait) is computed inside the domain call; the hard time limit is only a
backstop just above it (Celery enforces time limits on the prefork pool only).

``field.recover_eml`` returns the run's summary only (status, needs_review, error code,
idempotency key): Celery logs a task's return value at INFO and keeps it in the result backend,
so the effective view (guest names, confirmation numbers) must never be one.

``fieldrecovery`` is imported by the tasks when they run, not with this module: every worker
imports this module at boot, and most never run a field task.
"""

from __future__ import annotations

import logging
from typing import Any

from logfmt import log_event
from settings import get_settings
from tasks import app

#: Seconds above max_wait before the backstop limits fire (the run cancel and the DB writes).
SOFT_LIMIT_MARGIN_SECONDS = 15
HARD_LIMIT_MARGIN_SECONDS = 30

log = logging.getLogger(__name__)

_MAX_WAIT = get_settings().booking_field_recovery.max_wait


@app.task(
    name="field.recover_eml",
    soft_time_limit=_MAX_WAIT + SOFT_LIMIT_MARGIN_SECONDS,
    time_limit=_MAX_WAIT + HARD_LIMIT_MARGIN_SECONDS,
)
def recover_eml_task(eml: str, source: str = "MANUAL_EML", attempt: int = 1) -> dict[str, Any]:
    """Recover one EML given as text; returns {status, needs_review, error_code, idempotency_key}.

    Bad input (an EML the parser refuses, an attempt or source out of range) is a FAILED
    summary with its code, like the CLI's exit 1/2, never a task failure with a traceback."""
    from fieldrecovery.errors import AttemptInvalid, EmlInvalid
    from fieldrecovery.orchestrator import recover_eml
    from fieldrecovery.schemas import SourceKind

    try:
        # Parsed here, apart from the pipeline: a ValueError from inside it is not bad input.
        kind, number = SourceKind(source), int(attempt)
    except (ValueError, TypeError):
        return _input_invalid("input_invalid")  # an unknown source kind, an attempt that is not a number
    try:
        return recover_eml(eml.encode("utf-8", "surrogateescape"), source=kind, attempt=number).summary()
    except (EmlInvalid, AttemptInvalid) as exc:
        return _input_invalid(exc.code)


def _input_invalid(code: str) -> dict[str, Any]:
    """The summary of bad input: FAILED like any failed run's summary, with the input's code."""
    from fieldrecovery.orchestrator import RecoveryStatus

    log_event(log, "field_input_invalid", logging.WARNING, error_code=code)
    return {"status": RecoveryStatus.FAILED.value, "needs_review": False, "error_code": code, "idempotency_key": None}


@app.task(name="field.purge_expired", time_limit=600)
def purge_expired_task() -> dict[str, Any]:
    """Delete invocations and artifacts past retention_until, in batches (beat, e.g. hourly)."""
    from fieldrecovery.retention import purge_expired
    from fieldrecovery.store import store_from_settings

    return purge_expired(store_from_settings()).to_json()
