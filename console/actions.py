"""The console's actions, each a call of the one domain function the CLI and the Celery tasks
call too (``harness.cancel.cancel``, ``recovery.ops.redeliver`` and ``redeliver_parent``, the
approvals' decision), with ``actor`` naming the operator: the domain function's log line says
who did it. Here only the outcome becomes an HTTP status: 200 when something was done, 409
when nothing was (the compare-and-set did not land, or there was nothing to do), 404 when the
row does not exist. An action whose row another operation held through every attempt (a lock
timeout, tried again a few times: ``harness.errors.retry_while_busy``) is a 409 ``busy`` with a
plain message, never a 503: the database is fine, the row is busy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from console import approvals


@dataclass(frozen=True)
class ActionResult:
    status: int  #: the HTTP status
    outcome: str  #: the domain outcome's value
    detail: dict[str, Any] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"outcome": self.outcome, **self.detail}


#: Redelivery outcomes that did something (the rest: nothing was pending, or not yet).
_REDELIVERED = ("resume", "suppressed", "stopped")


def _scheduler() -> Any:
    from tasks import app
    from tasks.scheduler import CeleryScheduler

    return CeleryScheduler(app)


def _busy(exc: Exception) -> ActionResult:
    return ActionResult(409, "busy", {"message": str(exc)})


def cancel(session_id: int, actor: str) -> ActionResult:
    from harness.cancel import CancelOutcome
    from harness.cancel import cancel as cancel_session
    from harness.errors import RowBusy, retry_while_busy

    try:
        result = retry_while_busy(lambda: cancel_session(session_id, actor=actor), what=f"session {session_id}")
    except RowBusy as exc:
        return _busy(exc)
    status = {CancelOutcome.CANCELLED: 200, CancelOutcome.ALREADY_STOPPED: 409, CancelOutcome.NOT_FOUND: 404}
    return ActionResult(status[result.outcome], str(result.outcome), {"suppressed": result.suppressed})


def _redelivered(outcome: str) -> ActionResult:
    done = outcome.split(":", 1)[0] in _REDELIVERED
    return ActionResult(200 if done else 409, outcome)


def redeliver_execution(execution_id: int, actor: str) -> ActionResult:
    from recovery.errors import ExecutionNotFound
    from recovery.ops import redeliver

    try:
        return _redelivered(str(redeliver(execution_id, _scheduler(), actor=actor)))
    except ExecutionNotFound:
        return ActionResult(404, "not_found")


def redeliver_parent(session_id: int, actor: str) -> ActionResult:
    from recovery.errors import ExecutionNotFound
    from recovery.ops import redeliver_parent as redeliver_all

    try:
        return _redelivered(str(redeliver_all(session_id, _scheduler(), actor=actor)))
    except ExecutionNotFound:
        return ActionResult(404, "not_found")


def decide(
    request_id: int,
    *,
    approve: bool,
    reason: str,
    actor: str,
    for_session: bool = False,
    arguments: str | dict[str, Any] | None = None,
) -> ActionResult:
    """Approve or deny; a denial needs a reason (400 without one). ``for_session``: an approval
    of the request's tool for the rest of its session. ``arguments``: a budget request's
    amounts as the approver edited them (JSON text or an object). 400 ``refused`` (nothing
    decided) when the decision cannot be recorded as given: arguments for a request that is not
    a budget request, or not positive amounts of known kinds, or a budget request approved for
    the rest of its session."""
    from harness.errors import RowBusy, retry_while_busy

    if not approve and not reason.strip():
        return ActionResult(400, "reason_required")
    try:
        outcome = retry_while_busy(
            lambda: approvals.decide(
                request_id,
                approve=approve,
                reason=reason.strip(),
                actor=actor,
                for_session=for_session,
                arguments=arguments,
            ),
            what=f"approval request {request_id}",
        )
    except approvals.ApprovalsNotInstalled:
        return ActionResult(501, "approvals_not_installed")
    except approvals.Refused as exc:
        return ActionResult(400, "refused", {"message": str(exc)})
    except RowBusy as exc:
        return _busy(exc)
    if outcome == approvals.ConsoleDecision.NOT_FOUND:
        return ActionResult(404, outcome)
    landed = outcome in (approvals.ConsoleDecision.APPROVED, approvals.ConsoleDecision.DENIED)
    return ActionResult(200 if landed else 409, outcome)


#: Most requests one decision of the console's selection decides.
MAX_SELECTED = 500


def decide_selected(ids: list[int], *, approve: bool, reason: str, actor: str, for_session: bool) -> ActionResult:
    """One decision for several requests, each its own compare-and-set (``decide``): the answer
    lists each request's outcome. 200 when at least one landed, 409 when none did, 400 for no
    selection, too many, or a denial without a reason."""
    if not ids:
        return ActionResult(400, "nothing_selected")
    if len(ids) > MAX_SELECTED:
        return ActionResult(400, "too_many_selected", {"max": MAX_SELECTED})
    if not approve and not reason.strip():
        return ActionResult(400, "reason_required")
    results = []
    for request_id in dict.fromkeys(ids):  # each once, in the order given
        one = decide(request_id, approve=approve, reason=reason, actor=actor, for_session=for_session)
        results.append({"id": request_id, "outcome": one.outcome, "status": one.status})
    landed = sum(r["status"] == 200 for r in results)
    outcome = "decided" if landed == len(results) else "partly_decided" if landed else "nothing_decided"
    return ActionResult(200 if landed else 409, outcome, {"results": results})
