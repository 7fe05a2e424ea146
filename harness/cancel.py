"""Cancelling a session: a phase change any process can request (R15, R21).

:func:`cancel` is the operator's action (the CLI's ``cancel`` and the console's cancel button
both call it): it names what happened as a :class:`CancelOutcome` and logs who asked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import StrEnum

from harness.delivery import suppress_parent
from harness.events import publish_status
from logfmt import log_event
from models import AgentSession, Phase, transaction
from models.approval import cancel_for_tree, free_cancelled_child, lock_for_cancel
from models.session import request_cancel

log = logging.getLogger(__name__)


class CancelOutcome(StrEnum):
    """How an operator's cancel ended."""

    CANCELLED = "cancelled"  #: the session moved to CANCELLED; its PENDING results were suppressed
    #: nothing done: the session was already COMPLETED, FAILED or CANCELLED (the compare-and-set on
    #: its phase did not land)
    ALREADY_STOPPED = "already_stopped"
    NOT_FOUND = "not_found"  #: nothing done: there is no such session


@dataclass(frozen=True)
class CancelResult:
    outcome: CancelOutcome
    #: Executions whose results were suppressed by this cancel (empty unless CANCELLED).
    suppressed: list[int] = field(default_factory=list)


def cancel_session(session_id: int, *, actor: str = "system") -> tuple[bool, list[int]]:
    """Phase -> CANCELLED (unless already stopped; the reason names ``actor``) and, in the same
    transaction, its PENDING executions SUPPRESSED with their children cancelled, and their
    pending approval requests CANCELLED. Running loops notice and stop. A child parked for an
    approval has no loop to notice: its execution is freed for the next scan, whose recovery
    ends it CANCELLED and delivers it (docs/approvals.md, "Cancelling a session that waits")."""
    with transaction() as s:
        lock_for_cancel(s, session_id)
        changed = request_cancel(s, session_id, actor=actor)
        suppressed = suppress_parent(s, session_id) if changed else []
        if changed:
            cancel_for_tree(s, session_id)  # its and its children's pending approvals
            free_cancelled_child(s, session_id)
    if changed:
        publish_status(session_id, Phase.CANCELLED)
    return changed, suppressed


def cancel(session_id: int, *, actor: str) -> CancelResult:
    """The operator's cancel: :func:`cancel_session` on an existing session, logged with
    ``actor`` (who asked: ``cli:<user>``, ``console:<operator>``). Never raises for a session
    that is missing or already stopped: those are outcomes."""
    with transaction() as s:
        exists = s.get(AgentSession, session_id) is not None
    if not exists:
        result = CancelResult(CancelOutcome.NOT_FOUND)
    else:
        changed, suppressed = cancel_session(session_id, actor=actor)
        result = CancelResult(CancelOutcome.CANCELLED if changed else CancelOutcome.ALREADY_STOPPED, suppressed)
    log_event(
        log,
        "session_cancel",
        session_id=session_id,
        actor=actor,
        outcome=result.outcome,
        execution_ids=result.suppressed,
    )
    return result
