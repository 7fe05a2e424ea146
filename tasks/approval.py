"""Approval decisions as Celery tasks (``agent.approve``, ``agent.deny``: for ``celery call``)
and as plain functions an application's own endpoint calls (``approve``, ``deny``): thin
adapters over harness.approval.decide.

    celery -A tasks call agent.approve --args='[SESSION_ID, "CALL_ID"]' --kwargs='{"by": "alice"}'
    celery -A tasks call agent.deny --args='[SESSION_ID, "CALL_ID"]' --kwargs='{"reason": "no", "by": "bob"}'
"""

from __future__ import annotations

from typing import Any

from harness.approval import DecisionRefused, DecisionResult, decide
from models.approval import Decision
from tasks import app
from tasks.scheduler import CeleryScheduler


def approve(
    session_id: int, call_id: str, *, by: str, note: str = "", arguments: str | dict[str, Any] | None = None
) -> DecisionResult:
    """Approve one request (``arguments``: edited JSON text or a dict the tool runs with
    instead, checked against its schema; DecisionRefused when it does not fit). The first decision wins:
    ``result.outcome`` says whether this one landed, repeated the one that stands, or
    conflicts with it (``result.describe()`` names it). Every attempt is recorded
    (``models.operator_action``)."""
    return _recorded(int(session_id), str(call_id), Decision(True, by, note, arguments))


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
    }


@app.task(name="agent.approve")
def approve_task(
    session_id: int, call_id: str, by: str = "celery", note: str = "", arguments: str | dict[str, Any] | None = None
) -> dict[str, Any]:
    try:
        return as_dict(approve(session_id, call_id, by=by, note=note, arguments=arguments))
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


__all__ = ["approve", "approve_task", "deny", "deny_task", "purge_decided_task"]
