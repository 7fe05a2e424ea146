"""A top-level session whose tree's budget ran out asks a person for more
(``on_budget_exhausted = "ask"``, docs/usage.md): the request is an approval request
(models.approval) for the pseudo-tool ``budget.raise``, call id ``budget-EPOCH``, with the
arguments ``{"tokens": N}``,
decided like any other (``approve``/``deny``, Celery, console).

1. A refused reservation (``BudgetExhausted``) of a session whose agent asks: ``ask_for_budget``
   writes the request and parks the session WAITING_APPROVAL in ONE transaction under its fence
   (crash point ``budget.after_ask``); no lease, no worker.
2. An approval raises the tree's token budget by the request's tokens (the approver's edited
   arguments, else the refused call's reservation) in the decision's transaction
   (``raise_for``), and hands the session back to a loop, which asks the model again.
3. A denial (or an expiry) hands it back too; its next refused reservation finds the latest
   budget request not approved and stops as ``stop`` would (``budget_exhausted``).
"""

from __future__ import annotations

import json
import logging
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness.approval_notify import announce
from harness.events import publish_status
from harness.fence import Fence
from logfmt import log_event
from models import Phase, transaction
from models import approval as store
from models.approval import ApprovalRequest, ApprovalStatus, NewRequest
from models.budget import RaiseOutcome, raise_budget
from settings import get_settings

log = logging.getLogger(__name__)

#: The tool name of a budget request: no tool runs; an approval raises the budget.
BUDGET_TOOL = "budget.raise"
#: The JSON schema an approver's edited arguments must match.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"tokens": {"type": "integer", "minimum": 1}},
    "required": ["tokens"],
    "additionalProperties": False,
}


class AskOutcome(StrEnum):
    """What ``ask_for_budget`` ended in."""

    PARKED = "parked"  #: the request is written and the session waits in WAITING_APPROVAL
    REFUSED = "refused"  #: the session's last budget request was denied or expired: stop


def ask_for_budget(fence: Fence, *, session_id: int, agent_type: str, tokens: int) -> AskOutcome:
    """Write a budget request for ``tokens`` (the refused call's reservation, the amount an
    approval raises by unless the approver edits it) and park the session, in one transaction
    under the fence. REFUSED, nothing written, when the session's latest budget request was not
    approved (a person said no: the session stops). Raises ``LeaseLost``/``Cancelled`` (the
    fence) when the session is no longer this loop's."""
    with transaction() as s:
        fence.check(s)
        last = s.execute(
            select(ApprovalRequest.status)
            .where(ApprovalRequest.session_id == session_id, ApprovalRequest.tool == BUDGET_TOOL)
            .order_by(ApprovalRequest.id.desc())
            .limit(1)
        ).scalar_one_or_none()
        if last is not None and last != ApprovalStatus.APPROVED:
            return AskOutcome.REFUSED
        # NOTE: one ask per epoch at most (the park ends the run; the hand-back moves the
        # epoch), so the epoch names the request uniquely, purged requests or not.
        call_id = f"budget-{fence.epoch}"
        written = store.record_requests(
            s,
            session_id=session_id,
            journal_id=None,
            agent_type=agent_type,
            execution_id=None,
            calls=[NewRequest(call_id, BUDGET_TOOL, json.dumps({"tokens": tokens}))],
            timeout_seconds=get_settings().APPROVAL_TIMEOUT_SECONDS,
        )
        if not store.park_session(s, session_id, epoch=fence.epoch):
            fence.check(s)  # says why: cancelled or lost
            raise RuntimeError(f"session {session_id} could not be parked at epoch {fence.epoch}")
    crash_point("budget.after_ask")
    log_event(log, "budget_requested", session_id=session_id, call_id=call_id, tokens=tokens)
    announce(written)
    publish_status(session_id, Phase.WAITING_APPROVAL)
    return AskOutcome.PARKED


def raise_for(s: Session, row: ApprovalRequest) -> RaiseOutcome:
    """In the transaction of the approval that landed on budget request ``row``: raise its
    tree's token budget by the approved tokens (the edited arguments, else the request's)."""
    tokens = int(json.loads(row.approved_arguments or row.arguments)["tokens"])
    return raise_budget(s, row.session_id, tokens)
