"""Approval decisions as Celery tasks (``agent.approve``, ``agent.deny``: for ``celery call``)
and as plain functions an application's own endpoint calls (``approve``, ``deny``): thin
adapters over harness.approval.decide.

    celery -A tasks call agent.approve --args='[SESSION_ID, "CALL_ID"]' --kwargs='{"by": "alice"}'
    celery -A tasks call agent.approve --args='[SESSION_ID, "CALL_ID"]' --kwargs='{"by": "alice", "for_session": true}'
    celery -A tasks call agent.deny --args='[SESSION_ID, "CALL_ID"]' --kwargs='{"reason": "no", "by": "bob"}'

And the approval webhook (harness.approval_notify): ``approval.notify``, sent for each request
that waits for a person when APPROVAL_WEBHOOK_URL is set (connected to the
``approval_requested`` signal below).
"""

from __future__ import annotations

import logging
from typing import Any

from harness.approval import DecisionRefused, DecisionResult, decide
from harness.approval_notify import NotificationFailed, approval_requested, deliver, payload
from logfmt import log_event
from models.approval import Decision, Requested
from tasks import app
from tasks.scheduler import CeleryScheduler

log = logging.getLogger(__name__)

#: How many times a notification the webhook did not take is sent again (back-off doubling from
#: 2 s, capped at WEBHOOK_BACKOFF_MAX_SECONDS, with jitter): about 40 minutes in all.
WEBHOOK_MAX_RETRIES = 10
WEBHOOK_BACKOFF_MAX_SECONDS = 600


def approve(
    session_id: int,
    call_id: str,
    *,
    by: str,
    note: str = "",
    arguments: str | dict[str, Any] | None = None,
    for_session: bool = False,
) -> DecisionResult:
    """Approve one request (``arguments``: edited JSON text or a dict the tool runs with
    instead, checked against its schema; DecisionRefused when it does not fit). The first decision wins:
    ``result.outcome`` says whether this one landed, repeated the one that stands, or
    conflicts with it (``result.describe()`` names it). ``for_session``: every later call of
    the request's tool in its session is approved too (``result.granted``). Every attempt is
    recorded (``models.operator_action``)."""
    return _recorded(int(session_id), str(call_id), Decision(True, by, note, arguments, bool(for_session)))


def deny(session_id: int, call_id: str, *, reason: str, by: str) -> DecisionResult:
    """Deny one request: the model gets ``denied by BY: REASON`` as the call's result."""
    return _recorded(int(session_id), str(call_id), Decision(False, by, reason))


def _recorded(session_id: int, call_id: str, decision: Decision) -> DecisionResult:
    from models.operator_action import record_decision

    action = "approve" if decision.approve else "deny"
    try:
        result = decide(session_id, call_id, decision, CeleryScheduler(app))
    except DecisionRefused:
        record_decision(decision.by, action, session_id, call_id, "refused")
        raise
    request_id = None if result.request is None else result.request.id
    record_decision(decision.by, action, session_id, call_id, str(result.outcome), request_id=request_id)
    return result


def as_dict(result: DecisionResult) -> dict[str, Any]:
    r = result.request
    return {
        "outcome": str(result.outcome),
        "message": result.describe(),
        "status": None if r is None else str(r.status),
        "decided_by": None if r is None else r.decided_by,
        "reason": None if r is None else r.reason,
        "resumed": result.resumed,
        "granted": list(result.granted),
    }


@app.task(name="agent.approve")
def approve_task(
    session_id: int,
    call_id: str,
    by: str = "celery",
    note: str = "",
    arguments: str | dict[str, Any] | None = None,
    for_session: bool = False,
) -> dict[str, Any]:
    try:
        return as_dict(approve(session_id, call_id, by=by, note=note, arguments=arguments, for_session=for_session))
    except DecisionRefused as exc:
        return {"outcome": "refused", "message": str(exc)}


@app.task(name="agent.deny")
def deny_task(session_id: int, call_id: str, reason: str, by: str = "celery") -> dict[str, Any]:
    return as_dict(deny(session_id, call_id, reason=reason, by=by))


@app.task(name="approval.purge_decided", time_limit=600)
def purge_decided_task() -> dict[str, Any]:
    """Decided requests of closed rounds past APPROVAL_RETENTION_DAYS, in batches (beat, hourly)."""
    from models.approval import purge_decided_all
    from settings import get_settings

    return {"purged": purge_decided_all(get_settings().APPROVAL_RETENTION_DAYS)}


@app.task(
    name="approval.notify",
    bind=True,
    autoretry_for=(NotificationFailed,),
    retry_backoff=2,
    retry_backoff_max=WEBHOOK_BACKOFF_MAX_SECONDS,
    retry_jitter=True,
    max_retries=WEBHOOK_MAX_RETRIES,
    acks_late=True,
)
def notify_task(self: Any, data: dict[str, Any]) -> dict[str, Any]:
    """POST one request's notification to APPROVAL_WEBHOOK_URL (harness.approval_notify.deliver);
    a failure is retried with back-off, at most WEBHOOK_MAX_RETRIES times."""
    return {"notified": deliver(data)}


def _enqueue_notification(sender: Any = None, request: Requested | None = None, **_: Any) -> None:
    """The ``approval_requested`` handler of every process that imports the tasks: with a webhook
    configured, one ``approval.notify`` message per request (sent after its transaction
    committed). A broker that cannot take it loses that notification only: logged."""
    from settings import get_settings

    if request is None or not get_settings().APPROVAL_WEBHOOK_URL:
        return
    try:
        notify_task.delay(payload(request))
    except Exception as exc:
        log_event(log, "approval_notify_not_enqueued", logging.WARNING, request_id=request.id, error=type(exc).__name__)


approval_requested.connect(_enqueue_notification, weak=False)


__all__ = ["approve", "approve_task", "deny", "deny_task", "notify_task", "purge_decided_task"]
