"""A session whose tree's budget ran out asks a person for more (``on_budget_exhausted =
"ask"``, docs/usage.md): a top-level session or a child. The request is an approval request
(models.approval) for the pseudo-tool ``budget.raise``, call id ``budget-EPOCH`` (a child's:
``budget-EXECUTION-EPOCH``), whose arguments name the kinds the refused call did not fit and
what it lacks of each (``{"tokens": N}``, ``{"usd": X}``, ``{"model_calls": M}``, or several),
decided like any other (``approve``/``deny``, Celery, console).

1. A refused reservation (``BudgetExhausted``) of a session whose agent asks: ``ask_for_budget``
   writes the request and parks the session WAITING_APPROVAL in ONE transaction under its fence
   (a child: its execution parked, as for a tool's approval: harness.approval.park); crash
   point ``budget.after_ask``; no lease, no worker. A child's parent keeps waiting for it: the
   child's execution is not ended.
2. An approval raises the tree's budget by the request's amounts (the approver's edited
   arguments, else the request's) in the decision's transaction (``raise_for``), and hands the
   session back to a loop (a child: to recovery, which runs its execution on), which asks the
   model again.
3. A denial (or an expiry) hands it back too; its next refused reservation finds the latest
   budget request not approved and stops as ``stop`` would (``budget_exhausted``; a child's
   failed result, with what it had said, is delivered to its parent once, as any failure).
"""

from __future__ import annotations

import json
import logging
import math
from datetime import datetime
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
from models.budget import RaiseOutcome, raise_budget, usd
from settings import get_settings

log = logging.getLogger(__name__)

#: The tool name of a budget request: no tool runs; an approval raises the budget.
BUDGET_TOOL = "budget.raise"
#: The most one raise may add of each kind: far above any real need, and far below what the
#: columns hold (``tree_budget``: BIGINT tokens and calls, NUMERIC(20, 9) dollars).
MAX_TOKENS = 10**12
MAX_USD = 10**6
MAX_MODEL_CALLS = 10**9
#: The JSON schema an approver's edited arguments must match: positive amounts of known kinds
#: (models.budget.KINDS), at least one, nothing else; ``amounts_finite`` checks what a schema
#: cannot (a NaN passes every bound).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "tokens": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS},
        "usd": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_USD},
        "model_calls": {"type": "integer", "minimum": 1, "maximum": MAX_MODEL_CALLS},
    },
    "minProperties": 1,
    "additionalProperties": False,
}


def amounts_finite(value: dict[str, Any]) -> bool:
    """True when every amount of a budget request's arguments is a finite number (JSON text
    parsed by Python may hold NaN, which no schema bound refuses)."""
    return all(isinstance(v, int | float) and math.isfinite(v) for v in value.values())


class AskOutcome(StrEnum):
    """What ``ask_for_budget`` ended in."""

    PARKED = "parked"  #: the request is written and the session waits in WAITING_APPROVAL
    REFUSED = "refused"  #: the session's last budget request was denied or expired: stop
    #: nothing a raise of the tree gives would let the call run (a capped child's own cap ran
    #: out): nothing written, stop
    NOTHING_TO_RAISE = "nothing_to_raise"

    def stopped(self, refusal: str) -> str:
        """Why a session that did not park stopped, in its answer or its failed result
        (``refusal``: the ``BudgetExhausted`` message)."""
        said = {
            AskOutcome.REFUSED: "; a raise was not approved",
            AskOutcome.NOTHING_TO_RAISE: "; its own cap (child_budget) ran out: a raise of the tree does not change it",
        }
        return f"{refusal}{said.get(self, '')}"


def ask_for_budget(
    fence: Fence,
    *,
    session_id: int,
    agent_type: str,
    needs: dict[str, int | float],
    execution_id: int | None = None,
    not_after: datetime | None = None,
) -> AskOutcome:
    """Write a budget request for ``needs`` (per kind refused, what the refused call lacks: the
    amounts an approval raises by unless the approver edits them) and park the session (a
    child's: ``execution_id``, its request expiring at ``not_after``, its absolute deadline, at
    the latest), in one transaction under the fence. REFUSED, nothing written, when ``needs`` is
    empty (no raise of the tree lets the call run: a capped child's cap) or the session's latest
    budget request was not approved (a person said no: the session stops). Raises
    ``LeaseLost``/``Cancelled`` (the fence) when the session is no longer this loop's."""
    if not needs:
        return AskOutcome.NOTHING_TO_RAISE
    with transaction() as s:
        fence.check(s)
        # A child's earlier runs (a follow-up is a new execution) asked for themselves: only this
        # execution's requests say whether a person refused it.
        mine = [ApprovalRequest.session_id == session_id, ApprovalRequest.tool == BUDGET_TOOL]
        if execution_id is not None:
            mine.append(ApprovalRequest.execution_id == execution_id)
        last = s.execute(
            select(ApprovalRequest.status).where(*mine).order_by(ApprovalRequest.id.desc()).limit(1)
        ).scalar_one_or_none()
        if last is not None and last != ApprovalStatus.APPROVED:
            return AskOutcome.REFUSED
        # NOTE: one ask per epoch at most (the park ends the run; the hand-back moves the
        # epoch: the session's, or a child's execution's), so the epoch names the request
        # uniquely in its session, purged requests or not; a child's follow-up is a new
        # execution whose epochs start again, so a child's names its execution too.
        call_id = f"budget-{fence.epoch}" if execution_id is None else f"budget-{execution_id}-{fence.epoch}"
        written = store.record_requests(
            s,
            session_id=session_id,
            journal_id=None,
            agent_type=agent_type,
            execution_id=execution_id,
            calls=[NewRequest(call_id, BUDGET_TOOL, json.dumps(needs))],
            timeout_seconds=get_settings().APPROVAL_TIMEOUT_SECONDS,
            not_after=not_after,
        )
        if execution_id is None:
            parked = store.park_session(s, session_id, epoch=fence.epoch)
        else:
            until = min(r.expires_at for r in written)
            parked = store.park_execution(s, execution_id, session_id, epoch=fence.epoch, until=until)
        if not parked:
            fence.check(s)  # says why: cancelled or lost
            raise RuntimeError(f"session {session_id} could not be parked at epoch {fence.epoch}")
    crash_point("budget.after_ask")
    log_event(log, "budget_requested", session_id=session_id, call_id=call_id, execution_id=execution_id, needs=needs)
    announce(written)
    publish_status(session_id, Phase.WAITING_APPROVAL)
    return AskOutcome.PARKED


def raise_for(s: Session, row: ApprovalRequest) -> RaiseOutcome:
    """In the transaction of the approval that landed on budget request ``row``: raise its
    tree's budget by the approved amounts (the edited arguments, else the request's), each kind
    named (``{"tokens": N}``, the only shape of earlier requests, raises tokens alone)."""
    amounts = json.loads(row.approved_arguments or row.arguments)
    return raise_budget(
        s,
        row.session_id,
        int(amounts.get("tokens", 0)),
        usd=usd(float(amounts.get("usd", 0))),
        model_calls=int(amounts.get("model_calls", 0)),
    )
