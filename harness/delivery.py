"""Delivery of child results into the parent's history, exactly once (why: docs/exactly-once.md).

``deliver_round(parent_id, epoch)`` runs in-process in the last execution of a round to end (in
both paths), and as ``agent.deliver_round`` when the scan asks for it (or a last child whose
in-process delivery raised):
1. lock the parent; a stale epoch does nothing; a cancelled/terminal parent gets nothing (its
   PENDING executions become SUPPRESSED, its children are cancelled) and is never resumed;
2. barrier (I3): while any PENDING execution of the parent is still active, nothing happens;
3. the parent's incomplete tail is cleaned BEFORE anything is delivered;
4. rows without a pending round (pre-upgrade, or a lost round) are delivered per execution in
   ascending id, one transaction each, repairing broken pairs, skipping complete ones;
5. the open pending round is written whole in ONE transaction (one assistant, every TOOL in
   tool-call order with source_session_id, every delivered marker, round closed), together
   with the hand-over of the parent to a new epoch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness.delegate import delegate_arguments, tool_name
from harness.errors import BoundaryInvalid
from harness.events import publish_status
from harness.history import cleanup_incomplete_tail, delete_rows, pair_state
from harness.journal import interrupted_result, not_started_result
from harness.model import ToolCall
from harness.results import failure_result
from harness.rounds import ToolResult, write_round
from harness.scheduler import Scheduler
from logfmt import log_event
from models import (
    ACTIVE_EXECUTION,
    STOPPED_PHASES,
    AgentSession,
    DeliveryStatus,
    PendingRound,
    Phase,
    SubagentExecution,
    lease,
    transaction,
)
from models.db import built_once
from models.execution import mark_all_delivered, mark_delivered, suppress_execution
from models.legacy import infer_and_store
from models.round import close_open_round, close_round, was_started
from models.session import INVALID_BOUNDARY, cancel_child, hand_over, stop_session

log = logging.getLogger(__name__)
E = SubagentExecution

INTERRUPTED = "error: the tool was interrupted by a restart and was not re-run"


class DeliveryKind(StrEnum):
    """How one ``deliver_round`` ended."""

    STALE = "stale"  #: the parent is gone or holds another epoch (a duplicate/late callback): nothing done
    PARENT_BUSY = "parent_busy"  #: a loop holds the parent's lease; the last child or the scan asks again
    WAITING = "waiting"  #: an execution of the parent is still active or PENDING: no hand-over yet (I3)
    SUPPRESSED = "suppressed"  #: the parent is stopped: its PENDING results became SUPPRESSED
    RESUME = "resume"  #: every result delivered; the parent was handed ``new_epoch`` to run
    NOTHING = "nothing"  #: nothing was pending: a settled parent is left as it is
    STOPPED = "stopped"  #: the parent's history can never be legal: stopped FAILED, results suppressed


@dataclass(frozen=True)
class DeliveryOutcome:
    kind: DeliveryKind
    new_epoch: int | None = None
    delivered: tuple[int, ...] = ()


def _lock_parent(s: Session, parent_id: int) -> Any:
    """The parent's epoch, lease owner, phase and compaction boundary, its row locked (first,
    in every path)."""
    return s.execute(_lock_parent_stmt(), {"b_parent": parent_id}).one_or_none()


@built_once
def _lock_parent_stmt() -> Any:
    S = AgentSession
    return (
        select(S.id, S.epoch, S.lease_owner, S.phase, S.compaction_boundary_message_id)
        .where(S.id == bindparam("b_parent"))
        .with_for_update()
    )


def _pending(s: Session, parent_id: int) -> list[SubagentExecution]:
    return list(s.execute(_pending_stmt(), {"b_parent": parent_id}).scalars())


@built_once
def _pending_stmt() -> Any:
    return (
        select(E)
        .where(E.parent_session_id == bindparam("b_parent"), E.delivery_status == DeliveryStatus.PENDING)
        .order_by(E.id)
        .with_for_update()
    )


def suppress_parent(s: Session, parent_id: int) -> list[int]:
    """The parent is cancelled/terminal: every PENDING execution -> SUPPRESSED (active ones are
    cancelled and fenced), their children cancelled, the open round closed. Never resumes."""
    suppressed = []
    for row in _pending(s, parent_id):
        was_active = row.status in ACTIVE_EXECUTION
        if suppress_execution(s, row.id):
            suppressed.append(row.id)
            if was_active:
                cancel_child(s, row.child_session_id)
    close_open_round(s, parent_id)
    for eid in suppressed:
        log_event(
            log, "subagent_result_delivery_skipped", execution_id=eid, parent_id=parent_id, reason="parent_stopped"
        )
    return suppressed


def result_content(row: SubagentExecution) -> str:
    """The TOOL content of an execution: its stored result JSON (one factory), or a failure."""
    result: dict[str, Any] | None = row.result
    if result is None:
        result = failure_result(
            agent_type=row.agent_type,
            child_session_id=row.child_session_id,
            reason=row.error or f"subagent ended {row.status} without a result",
            cancelled=row.status == "CANCELLED",
        )
    return json.dumps(result, ensure_ascii=False)


def _delivered_rows(s: Session, parent_id: int, execution_id: int) -> frozenset[int]:
    """Parent rows that hold other executions' delivered results: never repaired away."""
    rows = s.execute(
        select(E.parent_assistant_message_id, E.parent_tool_message_id).where(
            E.parent_session_id == parent_id, E.id != execution_id, E.delivery_status == DeliveryStatus.DELIVERED
        )
    ).all()
    return frozenset(i for r in rows for i in r if i is not None)


def deliver_one(s: Session, row: SubagentExecution, parent_id: int) -> bool:
    """Deliver one execution without a pending round as an assistant+TOOL pair (R11, R23).

    Caller holds the parent lock and has checked the parent. Returns True when it wrote or
    marked, False when already delivered/suppressed."""
    if row.delivery_status != DeliveryStatus.PENDING:
        log_event(log, "subagent_result_delivery_skipped", execution_id=row.id, reason="already_delivered")
        return False
    invocation, call_id = infer_and_store(s, row.id)
    state = pair_state(s, parent_id, call_id, protected=_delivered_rows(s, parent_id, row.id))
    if state.complete:
        mark_delivered(s, row.id, assistant_message_id=state.assistant_id, tool_message_id=state.tool_id)
        log_event(log, "subagent_result_delivery_skipped", execution_id=row.id, reason="messages_exist")
        return True
    delete_rows(s, parent_id, state.broken_ids)  # repair: malformed JSON, orphan TOOL, assistant only
    args = delegate_arguments(
        invocation, agent_type=row.agent_type, child_session_id=row.child_session_id, task=row.task_description
    )
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": tool_name(invocation), "arguments": json.dumps(args, ensure_ascii=False)},
    }
    assistant_id, tool_ids = write_round(
        s, parent_id, "", [call], [ToolResult(call_id, result_content(row), row.child_session_id)]
    )
    mark_delivered(s, row.id, assistant_message_id=assistant_id, tool_message_id=tool_ids[call_id])
    log_event(log, "subagent_result_delivered", execution_id=row.id, parent_id=parent_id, tool_call_id=call_id)
    return True


def _open_round(s: Session, parent_id: int) -> PendingRound | None:
    return s.execute(_open_round_stmt(), {"b_parent": parent_id}).scalar_one_or_none()


@built_once
def _open_round_stmt() -> Any:
    return (
        select(PendingRound)
        .where(PendingRound.session_id == bindparam("b_parent"), PendingRound.closed_at.is_(None))
        .with_for_update()
    )


def round_results(
    rnd: PendingRound, pending: Sequence[SubagentExecution]
) -> tuple[list[SubagentExecution], list[ToolResult]]:
    """The open round's members (its PENDING executions, ascending id) and its TOOL results in
    tool-call order: every delegation's result, every inline call's recorded result (or the
    interrupted one)."""
    members = {r.parent_tool_call_id: r for r in pending if r.pending_round_id == rnd.id}
    # R23: delegation results in ascending execution id. They take the delegation slots
    # of the round in that order; inline results keep their own slots.
    by_id = iter(sorted(members.values(), key=lambda m: m.id))
    results = []
    for call in rnd.tool_calls:
        call_id = str(call["id"])
        if call_id in members:
            member = next(by_id)
            member_call = str(member.parent_tool_call_id)
            results.append(ToolResult(member_call, result_content(member), member.child_session_id))
        else:
            # An inline call without a recorded result is never run here (docs/state-machines.md,
            # "Tool call"): started, it was interrupted and may have taken effect; never started,
            # it did not run (its start is fenced: the parent that lost the round starts nothing).
            result = rnd.inline_results.get(call_id)
            if result is None:
                fn = call.get("function") or {}
                missing = ToolCall(call_id, str(fn.get("name")), str(fn.get("arguments") or ""))
                result = interrupted_result(missing) if was_started(rnd, call_id) else not_started_result(missing)
            results.append(ToolResult(call_id, result))
    return sorted(members.values(), key=lambda m: m.id), results


def _deliver_open_round(s: Session, parent_id: int, rnd: PendingRound, pending: list[SubagentExecution]) -> list[int]:
    """Write the whole open round (one assistant + every TOOL) and close it. Returns ids."""
    ordered, results = round_results(rnd, pending)
    assistant_id, tool_ids = write_round(
        s, parent_id, rnd.assistant_content, rnd.tool_calls, results, provider_fields=rnd.provider_fields
    )
    crash_point("deliver.mid_round")
    marked = {m.id: tool_ids[str(m.parent_tool_call_id)] for m in ordered}
    mark_all_delivered(s, marked, assistant_message_id=assistant_id)
    for member in ordered:
        log_event(
            log,
            "subagent_result_delivered",
            execution_id=member.id,
            parent_id=parent_id,
            tool_call_id=member.parent_tool_call_id,
        )
    close_round(s, rnd.id)
    return [m.id for m in ordered]


def _check_parent(s: Session, parent_id: int, epoch: int, delivered: Sequence[int]) -> DeliveryOutcome | Any:
    """Lock the parent; its row when this delivery may go on, else how it stopped: a stale
    epoch stops it; a stopped parent has its pending results suppressed (never resumed)."""
    parent = _lock_parent(s, parent_id)
    if parent is None or parent.epoch != epoch:
        log_event(log, "deliver_round_skipped", parent_id=parent_id, epoch=epoch, reason="stale")
        return DeliveryOutcome(DeliveryKind.STALE, delivered=tuple(delivered))
    if parent.lease_owner is not None:
        # NOTE: a loop holds the parent (it has not yielded yet, or it runs again): a parent
        # waiting for its children holds no lease. The last child or the scan asks again.
        log_event(log, "deliver_round_skipped", parent_id=parent_id, epoch=epoch, reason="parent_busy")
        return DeliveryOutcome(DeliveryKind.PARENT_BUSY, delivered=tuple(delivered))
    if parent.phase in STOPPED_PHASES:
        suppressed = suppress_parent(s, parent_id)
        return DeliveryOutcome(DeliveryKind.SUPPRESSED, delivered=tuple(delivered) or tuple(suppressed))
    return parent


def _close_round_and_hand_over(
    s: Session, parent_id: int, epoch: int, delivered: list[int], pending: list[SubagentExecution] | None = None
) -> DeliveryOutcome:
    """In the caller's transaction (parent locked and checked): write the open round, then hand
    the parent a new epoch — unless something is still PENDING. ``pending`` is the parent's
    PENDING executions when this transaction has read (and locked) them already."""
    if pending is None:
        pending = _pending(s, parent_id)
    rnd = _open_round(s, parent_id)
    if rnd is not None:
        delivered += _deliver_open_round(s, parent_id, rnd, pending)
    if not delivered and rnd is None:
        # Nothing was waiting: a settled parent is never handed over.
        log_event(log, "deliver_round_skipped", parent_id=parent_id, reason="nothing_pending")
        return DeliveryOutcome(DeliveryKind.NOTHING)
    # NOTE: what is left PENDING is known without another read: the PENDING rows are locked
    # (FOR UPDATE) and no execution of this parent can be created while its row is locked
    # (creation runs under the parent's fence, which updates that row).
    done = set(delivered)
    left = [r.id for r in pending if r.id not in done]
    if left:
        log_event(log, "parent_recovery_wait", parent_id=parent_id, execution_ids=left)
        return DeliveryOutcome(DeliveryKind.WAITING, delivered=tuple(delivered))
    new_epoch = hand_over(
        s, parent_id, epoch=epoch, to_phase=Phase.RUNNING, reserve_seconds=lease.reservation_seconds()
    )
    return DeliveryOutcome(DeliveryKind.RESUME, new_epoch=new_epoch, delivered=tuple(delivered))


def deliver_round(parent_id: int, epoch: int) -> DeliveryOutcome:
    """See ``_deliver_round``. A parent whose compaction boundary is invalid can never get a
    legal history: it is stopped (FAILED) with a logged reason and its pending results are
    suppressed, instead of a delivery that raises on every retry."""
    try:
        return _deliver_round(parent_id, epoch)
    except BoundaryInvalid:
        log_event(log, "parent_stopped", logging.ERROR, parent_id=parent_id, reason="invalid_compaction_boundary")
        with transaction() as s:
            parent = _lock_parent(s, parent_id)
            if parent is None or not stop_session(s, parent_id, epoch=epoch, reason=INVALID_BOUNDARY):
                return DeliveryOutcome(DeliveryKind.STALE)
            suppressed = suppress_parent(s, parent_id)
        publish_status(parent_id, Phase.FAILED)
        return DeliveryOutcome(DeliveryKind.STOPPED, delivered=tuple(suppressed))


def _deliver_round(parent_id: int, epoch: int) -> DeliveryOutcome:
    """Deliver every finished child result of the parent exactly once,
    then hand the parent a new epoch (the caller enqueues its run). See the module doc.

    The common case (every result belongs to the open round) is ONE transaction: checks,
    tail cleanup, the whole round, the markers and the hand-over."""
    delivered: list[int] = []
    with transaction() as s:
        parent = _check_parent(s, parent_id, epoch, ())
        if isinstance(parent, DeliveryOutcome):
            return parent
        pending = _pending(s, parent_id)
        active = [r.id for r in pending if r.status in ACTIVE_EXECUTION]
        if active:
            log_event(log, "parent_recovery_wait", parent_id=parent_id, execution_ids=active)
            return DeliveryOutcome(DeliveryKind.WAITING)
        boundary = parent.compaction_boundary_message_id  # validated by the tail's own read
        cleanup_incomplete_tail(s, parent_id, boundary, protected=lambda: _delivered_rows(s, parent_id, -1))
        legacy = [r.id for r in pending if r.pending_round_id is None]
        outcome = None if legacy else _close_round_and_hand_over(s, parent_id, epoch, delivered, pending)
    for eid in legacy:  # rows without a round: one transaction each, ascending id (R23)
        with transaction() as s:
            stop = _check_parent(s, parent_id, epoch, delivered)
            if isinstance(stop, DeliveryOutcome):
                return stop
            row = s.execute(select(E).where(E.id == eid).with_for_update()).scalar_one()
            if deliver_one(s, row, parent_id):
                delivered.append(eid)
    if outcome is None:
        with transaction() as s:
            stop = _check_parent(s, parent_id, epoch, delivered)
            if isinstance(stop, DeliveryOutcome):
                return stop
            outcome = _close_round_and_hand_over(s, parent_id, epoch, delivered)
    if outcome.kind == DeliveryKind.RESUME:
        crash_point("deliver.before_resume")
        log_event(log, "parent_recovery_start", parent_id=parent_id, epoch=outcome.new_epoch, delivered=len(delivered))
    return outcome


def deliver_and_resume(parent_id: int, epoch: int, scheduler: Scheduler) -> DeliveryOutcome:
    """deliver_round, then enqueue the parent's run with the epoch it was handed. A broker
    error there loses nothing: the parent waits RUNNING under a reservation and the scan
    resumes it once that lapses (R18)."""
    outcome = deliver_round(parent_id, epoch)
    if outcome.kind == DeliveryKind.RESUME and outcome.new_epoch is not None:
        try:
            scheduler.resume_parent(parent_id, outcome.new_epoch)
        except Exception as exc:
            log_event(log, "parent_resume_not_enqueued", logging.WARNING, parent_id=parent_id, error=type(exc).__name__)
    return outcome
