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
    conflicts with it (``result.describe()`` names it)."""
    return decide(int(session_id), str(call_id), Decision(True, by, note, arguments), CeleryScheduler(app))


def deny(session_id: int, call_id: str, *, reason: str, by: str) -> DecisionResult:
    """Deny one request: the model gets ``denied by BY: REASON`` as the call's result."""
    return decide(int(session_id), str(call_id), Decision(False, by, reason), CeleryScheduler(app))


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


__all__ = ["approve", "approve_task", "deny", "deny_task"]
