"""What a loop does when the model is down longer than the client's retry window.

A provider outage (``ModelUnavailable.transient``: unreachable, overloaded, a server error,
after the client's own retries) is not the session's failure: the run ends without a result,
and the lease is set to lapse after a back-off, so the scan resumes the session (a parent) or
the execution (a child) then, through its ordinary step for dead work (models.outage). The
back-off grows with the outage (as long as it has lasted so far, between
OUTAGE_BACKOFF_MIN_SECONDS and OUTAGE_BACKOFF_CAP_SECONDS). The session is failed only when
the outage has lasted MODEL_OUTAGE_MAX_SECONDS, or a child's absolute deadline passes (the
recovery that resumes it then ends it timed out). A refusal of the request (a bad key, a bad
request) is not an outage: it fails the run at once, as before.
"""

from __future__ import annotations

import logging
from datetime import datetime

from harness.fence import Fence
from logfmt import log_event
from models import outage as store
from models import transaction
from models.base import utcnow
from settings import get_settings

log = logging.getLogger(__name__)

#: Shortest wait before a session waiting for the model is resumed.
OUTAGE_BACKOFF_MIN_SECONDS = 10.0
#: Longest wait between two attempts of a session waiting for the model.
OUTAGE_BACKOFF_CAP_SECONDS = 300.0


def backoff_seconds(since: datetime | None, now: datetime) -> float:
    """As long as the outage has lasted so far, within the bounds."""
    waited = 0.0 if since is None else (now - since).total_seconds()
    return min(OUTAGE_BACKOFF_CAP_SECONDS, max(OUTAGE_BACKOFF_MIN_SECONDS, waited))


def _exhausted(since: datetime | None, now: datetime) -> bool:
    return since is not None and (now - since).total_seconds() >= get_settings().MODEL_OUTAGE_MAX_SECONDS


def wait_for_model(
    fence: Fence,
    session_id: int,
    *,
    execution_id: int | None = None,
    deadline: datetime | None = None,
    retry_after_seconds: float | None = None,
) -> bool:
    """End this run waiting for the model: True when the wait is recorded (the lease lapses
    after the back-off and the scan resumes the work); False when the outage has lasted
    MODEL_OUTAGE_MAX_SECONDS (the caller fails the run) or this epoch no longer holds the work
    (nothing written). ``retry_after_seconds``: the provider asked for at least this long (a
    Retry-After longer than the client's retries): the back-off is not shorter, up to
    MODEL_OUTAGE_MAX_SECONDS."""
    with transaction() as s:
        now = utcnow()
        since = store.outage_since(s, session_id)
        if _exhausted(since, now):
            log_event(log, "model_outage_gave_up", logging.WARNING, session_id=session_id)
            return False
        backoff = backoff_seconds(since, now)
        if retry_after_seconds is not None:
            backoff = max(backoff, min(retry_after_seconds, get_settings().MODEL_OUTAGE_MAX_SECONDS))
        if deadline is not None:
            backoff = max(1.0, min(backoff, (deadline - now).total_seconds()))
        if execution_id is None:
            landed = store.wait_session(s, session_id, epoch=fence.epoch, backoff_seconds=backoff)
        else:
            landed = store.wait_execution(s, session_id, execution_id, epoch=fence.epoch, backoff_seconds=backoff)
    if landed:
        log_event(
            log,
            "model_outage_wait",
            logging.WARNING,
            session_id=session_id,
            execution_id=execution_id,
            backoff_ms=int(backoff * 1000),
        )
    return landed


def model_answered(session_id: int) -> None:
    """The model answered a session that was waiting for it: it waits no more."""
    with transaction() as s:
        if store.model_answered(s, session_id):
            log_event(log, "model_outage_over", session_id=session_id)
