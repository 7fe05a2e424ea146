"""The one seam between the console and human approvals of tool calls.

Every view and action of the console that concerns approvals goes through these functions,
and they go through the same functions as the CLI and the Celery tasks: the listing is
``models.approval.listing`` (the shape of ``agent-recovery approvals --json``), a decision is
``tasks.approval.approve`` / ``deny`` (``harness.approval.decide``: a compare-and-set on the
request, the first decision wins). The console addresses a request by its row id; the CLI by
session and call id: both name the same row.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from sqlalchemy.orm import Session

#: The pseudo-tool of a request to raise a tree's budget (harness.budget_request.BUDGET_TOOL).
BUDGET_TOOL = "budget.raise"


class ApprovalsNotInstalled(RuntimeError):
    """Raised when a decision is asked for and approvals are not installed."""

    def __init__(self, message: str = "approvals are not installed") -> None:
        super().__init__(message)


class ConsoleDecision(StrEnum):
    """What a decision asked for in the console ended in."""

    APPROVED = "approved"  #: this approval landed: it is the decision that stands
    DENIED = "denied"  #: this denial landed: it is the decision that stands
    REPEATED = "repeated"  #: nothing done: the same decision stood already
    CONFLICT = "conflict"  #: nothing done: another decision (or an expiry, a cancel) stands
    NOT_FOUND = "not_found"  #: nothing done: there is no such request


def installed() -> bool:
    """True: approval requests are part of the schema (migration 0013)."""
    return True


#: A page of the approvals list holds at most this many requests.
MAX_PAGE = 500
DEFAULT_PAGE = 50


def pending(s: Session, f: Any = None, *, show_content: bool = False) -> dict[str, Any]:
    """A page of open approval requests, oldest first, each in the shape of ``agent-recovery
    approvals --json`` (the arguments only when the console may show users' data); with
    ``total`` (every request the filter names) and ``next_after`` (the ``after`` of the next
    page, None on the last). A budget request (``budget.raise``) has its arguments whatever
    ``show_content`` says, and ``amounts``: the same object, the kinds and amounts an approval
    raises the tree's budget by. ``f`` is a ``models.approval.PendingFilter``."""
    from dataclasses import replace

    from models.approval import PendingFilter, listing, pending_count

    f = f or PendingFilter()
    limit = max(1, min(f.limit or DEFAULT_PAGE, MAX_PAGE))
    rows = listing(s, with_arguments=True, f=replace(f, limit=limit + 1))
    more = len(rows) > limit
    rows = rows[:limit]
    for row in rows:
        if row["tool"] == BUDGET_TOOL:
            # A budget request's arguments are amounts, not users' data: always shown, and the
            # Approve form's inputs start from them.
            row["amounts"] = row["arguments"] if isinstance(row["arguments"], dict) else {}
        elif not show_content:
            del row["arguments"], row["summary"]
    return {
        "approvals": rows,
        "total": pending_count(s, f),
        "next_after": rows[-1]["id"] if more else None,
    }


def waiting_clause() -> Any:
    """SQL over ``agent_session``: the session waits for an approval."""
    from models.approval import waiting_for_approval
    from models.session import AgentSession

    return waiting_for_approval(AgentSession)


class Refused(ValueError):
    """Raised when a decision cannot be recorded as given (the message says why): edited
    arguments for a request that is not a budget request (the console edits amounts only), or
    not valid for it, or a budget request approved for the rest of its session."""


def decide(
    request_id: int,
    *,
    approve: bool,
    reason: str,
    actor: str,
    for_session: bool = False,
    arguments: str | dict[str, Any] | None = None,
) -> ConsoleDecision:
    """Approve or deny one request through the same function as the CLI and ``agent.approve`` /
    ``agent.deny``; ``actor`` is recorded as who decided; ``for_session`` (an approval): its tool
    is approved for the rest of its session; ``arguments`` (an approval of a budget request
    only): the amounts to raise by instead of the request's, checked as the CLI's
    ``--arguments`` are. A decision that lost its compare-and-set is an outcome, not an error.
    Raises ``Refused``."""
    from harness.approval import DecisionRefused
    from models import transaction
    from models.approval import ApprovalRequest, DecisionOutcome
    from tasks.approval import approve as approve_call
    from tasks.approval import deny as deny_call

    with transaction() as s:
        row = s.get(ApprovalRequest, request_id)
        where = None if row is None else (row.session_id, row.call_id, row.tool)
    if where is None:
        return ConsoleDecision.NOT_FOUND
    session_id, call_id, tool = where
    if arguments is not None and (tool != BUDGET_TOOL or not approve):
        raise Refused("edited arguments go with the approval of a budget request only")
    if approve:
        try:
            result = approve_call(
                session_id, call_id, by=actor, note=reason, arguments=arguments, for_session=for_session
            )
        except DecisionRefused as exc:
            raise Refused(str(exc)) from None
    else:
        result = deny_call(session_id, call_id, reason=reason, by=actor)
    if result.outcome == DecisionOutcome.DECIDED:
        return ConsoleDecision.APPROVED if approve else ConsoleDecision.DENIED
    return {
        DecisionOutcome.REPEATED: ConsoleDecision.REPEATED,
        DecisionOutcome.CONFLICT: ConsoleDecision.CONFLICT,
    }.get(result.outcome, ConsoleDecision.NOT_FOUND)
