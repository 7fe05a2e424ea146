"""Resuming one child execution in its ORIGINAL session from its last safe point (spec §7.3).

Take (RUNNING/RECOVERING + PENDING only -> RECOVERING, epoch + 1); child phase RESUMING; legacy
fields inferred and written back; the child's incomplete tail cleaned on raw rows after its
validated boundary; when the execution already has its final ASSISTANT, it is finished WITHOUT
calling the model (R20); past the absolute deadline it fails with a timeout result (R6, R22);
otherwise the child loop runs from the kept history with the time left. Never raises: a chord
header that raised would stop the parent's delivery.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sqlalchemy import select, update

from crashpoints import crash_point
from harness.history import cleanup_incomplete_tail, load_raw, parse_tool_calls, validated_boundary
from harness.loop import ChildInfo, LoopDeps, child_deadline, execute_child, finish_child, load_child, timeout_reason
from models import (
    AgentSession,
    ExecutionStatus,
    IllegalTransition,
    Message,
    Phase,
    Role,
    SubagentExecution,
    transaction,
)
from models.base import utcnow
from models.execution import take_execution
from recovery.legacy import infer_and_store
from settings import get_settings

log = logging.getLogger("recovery.executions")


@dataclass(frozen=True)
class FinalFound:
    message_id: int
    content: str


def existing_final(s: object, info: ChildInfo) -> FinalFound | None:
    """The execution's final ASSISTANT if it was committed before the crash (spec §7.3.5):
    ``final_message_id``, or for old rows the last live row after the execution's USER
    instruction, when it is an ASSISTANT without tool calls."""
    from sqlalchemy.orm import Session

    assert isinstance(s, Session)
    E = SubagentExecution
    final_id = s.execute(select(E.final_message_id).where(E.id == info.execution_id)).scalar_one()
    if final_id is not None:
        row = s.execute(select(Message).where(Message.id == final_id, Message.deleted.is_(False))).scalar_one_or_none()
        if row is not None:
            return FinalFound(row.id, row.content or "")
    start = info.execution_start_message_id
    rows = load_raw(s, info.child_session_id, None, validate=False)
    if start is None:
        # Old row: the execution's instruction is the last USER message carrying its task.
        users = [m.id for m in rows if m.role == Role.USER and (m.content or "") == info.task_description]
        if not users:
            return None
        start = users[-1]
    after = [m for m in rows if m.id > start]
    if after and after[-1].role == Role.ASSISTANT and parse_tool_calls(after[-1].tool_calls) is None:
        return FinalFound(after[-1].id, after[-1].content or "")
    return None


def recover_child(execution_id: int, epoch: int, deps: LoopDeps, *, force: bool = False) -> str:
    """Resume one execution handed ``epoch`` by the scan. Returns what happened; never raises.

    ``force`` takes the execution even under a live lease: the scan sets it only when the
    absolute deadline plus the cancel grace has passed (a stuck worker must not hold it)."""
    started = time.monotonic()
    try:
        outcome = _recover(execution_id, epoch, deps, force)
    except Exception:
        log.error("event=subagent_recovery_error executionId=%s", execution_id, exc_info=True)
        outcome = "error"
    log.info(
        "event=subagent_recovery_complete executionId=%s outcome=%s durationMs=%d",
        execution_id,
        outcome,
        (time.monotonic() - started) * 1000,
    )
    return outcome


def _recover(execution_id: int, epoch: int, deps: LoopDeps, force: bool) -> str:
    with transaction() as s:
        started_at = s.execute(
            select(SubagentExecution.started_at).where(SubagentExecution.id == execution_id)
        ).scalar_one_or_none()
    if started_at is None:
        return "missing"
    force = force or deadline_passed_with_grace(started_at)
    try:
        with transaction() as s:
            new_epoch = take_execution(
                s,
                execution_id,
                expected_epoch=epoch,
                to_status=ExecutionStatus.RECOVERING,
                owner=deps.owner,
                lease_seconds=deps.lease_seconds,
                require_expired=not force,
            )
    except IllegalTransition:
        log.info("event=subagent_recovery_skipped executionId=%s reason=not_pending", execution_id)
        return "stale"
    if new_epoch is None:
        log.info("event=subagent_recovery_skipped executionId=%s reason=stale_epoch", execution_id)
        return "stale"
    crash_point("recover.after_take")
    info = load_child(execution_id)
    try:
        with transaction() as s:
            invocation, _ = infer_and_store(s, execution_id)  # written back in the first recovery transaction
            s.execute(
                update(AgentSession)
                .where(AgentSession.id == info.child_session_id, AgentSession.phase.is_distinct_from(Phase.CANCELLED))
                .values(phase=Phase.RESUMING, updated_at=utcnow())
                .execution_options(synchronize_session=False)
            )
            removed = cleanup_incomplete_tail(s, info.child_session_id, validated_boundary(s, info.child_session_id))
            final = existing_final(s, info)
        log.info(
            "event=subagent_recovery_start executionId=%s parent=%s child=%s invocation=%s tail_removed=%d",
            execution_id,
            _parent_of(execution_id),
            info.child_session_id,
            invocation,
            len(removed),
        )
        if final is not None:
            # R20: the final answer exists; finish without calling the model again.
            ok = finish_child(info, new_epoch, text=final.content, final_message_id=final.message_id)
            return "completed_from_final" if ok else "lost"
        if utcnow() >= child_deadline(info.started_at):
            ok = finish_child(info, new_epoch, text=None, failure=timeout_reason())
            return "timed_out" if ok else "lost"
        return execute_child(execution_id, new_epoch, deps)
    except Exception as exc:
        from harness.results import describe_exception

        log.warning(
            "event=subagent_recovery_failed executionId=%s error=%s", execution_id, type(exc).__name__, exc_info=True
        )
        ok = finish_child(info, new_epoch, text=None, failure=f"subagent recovery failed: {describe_exception(exc)}")
        return "failed" if ok else "lost"


def _parent_of(execution_id: int) -> int:
    with transaction() as s:
        return int(
            s.execute(
                select(SubagentExecution.parent_session_id).where(SubagentExecution.id == execution_id)
            ).scalar_one()
        )


def deadline_passed_with_grace(started_at: object) -> bool:
    from datetime import datetime, timedelta

    assert isinstance(started_at, datetime)
    grace = timedelta(seconds=get_settings().SUBAGENT_CANCEL_GRACE_SECONDS)
    return utcnow() >= child_deadline(started_at) + grace
