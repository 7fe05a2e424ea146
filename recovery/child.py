"""A child execution's recovery (docs/tasks.md): ``recover_child`` (task ``recovery.recover_child``).

It differs from the normal path's start (harness.child ``start_child``, task
``agent.run_child``: RUNNING -> RUNNING, epoch + 1, child phase RUNNING) only in how it takes
the execution: RUNNING/RECOVERING + PENDING -> RECOVERING (epoch + 1), legacy fields inferred
and written back, child phase RESUMING, the child's incomplete tail cleaned on raw rows after
its validated boundary, its final ASSISTANT looked for (R20), and its first round (the one its
crashed run journaled) read — all in ONE transaction, so a stalled recoverer that lost the
epoch cannot touch the child's phase.

Then the same steps: finish from an existing final without calling the model, or fail past the
absolute deadline (R6, R22), or run the rounds (harness.child) with the time left. Finally, the
last execution of a round to end delivers the round itself (harness.child ``after_end``, with
harness.delivery), in one short transaction, and the parent runs right after (docs/exactly-once.md).
Never raises.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from sqlalchemy import select
from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness.child import (
    ChildEnd,
    ChildOutcome,
    FirstRound,
    after_end,
    charge_dead_call,
    child_deadline,
    end_with_failure,
    first_round,
    load_child_setting_phase,
    run_rounds,
    timeout_reason,
)
from harness.child_end import ChildInfo, Completed, Failed, Stopped, finish_child
from harness.errors import BoundaryInvalid, infrastructure_boundary
from harness.history import cleanup_incomplete_tail, load_raw, parse_tool_calls
from harness.loop import LoopDeps
from harness.results import describe_exception
from harness.scheduler import SerialBatch
from logfmt import log_event
from models import (
    ExecutionStatus,
    FailureCode,
    IllegalTransition,
    Message,
    Phase,
    Role,
    SubagentExecution,
    transaction,
)
from models.base import utcnow
from models.execution import take_execution
from models.legacy import infer_and_store
from settings import get_settings

log = logging.getLogger(__name__)
E = SubagentExecution

#: Child phases that say its last answer was NOT a final result (old rows).
_NOT_FINAL_PHASES = (Phase.FAILED, Phase.CANCELLED)


@dataclass(frozen=True)
class FinalFound:
    message_id: int
    content: str


def existing_final(s: Session, info: ChildInfo, rows: Sequence[Message] | None = None) -> FinalFound | None:
    """The execution's final ASSISTANT if it was committed before the crash (R20):
    ``final_message_id``, or for old rows the last live row after the execution's USER
    instruction when it is an ASSISTANT without tool calls and the child's phase does not say
    otherwise (a FAILED/CANCELLED child's last words are not its result). ``rows``: every
    live row of the child, when the caller's transaction has them already."""
    if info.final_message_id is not None:
        row = s.execute(
            select(Message).where(Message.id == info.final_message_id, Message.deleted.is_(False))
        ).scalar_one_or_none()
        if row is not None:
            return FinalFound(row.id, row.content or "")
    if info.child_phase in _NOT_FINAL_PHASES:
        return None
    start = info.execution_start_message_id
    rows = rows if rows is not None else load_raw(s, info.child_session_id, None, validate=False)
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


def recover_child(execution_id: int, epoch: int, deps: LoopDeps) -> ChildOutcome:
    """Resume one execution handed ``epoch`` by the scan. Returns what happened; never raises."""
    started = time.monotonic()
    try:
        with infrastructure_boundary(
            log, "subagent_recovery_error", level=logging.ERROR, execution_id=execution_id
        ) as fault:
            end = _recover(execution_id, epoch, deps)
    except Exception as exc:
        log_event(log, "subagent_recovery_error", logging.ERROR, execution_id=execution_id, error=type(exc).__name__)
        end = ChildEnd(ChildOutcome.ERROR)
    if fault:
        end = ChildEnd(ChildOutcome.INFRA_ERROR)
    log_event(
        log,
        "subagent_recovery_complete",
        execution_id=execution_id,
        outcome=end.outcome,
        duration_ms=int((time.monotonic() - started) * 1000),
    )
    after_end(execution_id, end, deps)
    return end.outcome


class RecoveryBatch(SerialBatch[ChildOutcome]):
    """The executions of one ``recovery.recover_children`` message (a round's children), run
    one after another by one process: a third of the task hops of a message per execution.

    Each is taken by its own compare-and-set on its epoch when its turn comes (``recover_child``),
    so one not yet started is still the scan's reservation: when the process dies mid-batch, the
    leases of those taken and the reservations of the others lapse, and the next scan recovers
    both (the crash point ``recover.between_children``). A batch still running
    ``pass_on_after`` seconds (RECOVERY_BATCH_PASS_ON_SECONDS) after its first step began
    passes the executions not yet started on (harness.scheduler.SerialBatch), a message each; a
    duplicate would find its epoch gone anyway (STALE)."""

    def __init__(
        self,
        children: Sequence[tuple[int, int]],
        pass_on: Callable[[list[tuple[int, int]]], object],
        pass_on_after: float | None = None,
    ) -> None:
        if pass_on_after is None:  # a fast step, whose model answers at once, takes tens of ms
            pass_on_after = get_settings().RECOVERY_BATCH_PASS_ON_SECONDS
        super().__init__(children, pass_on, pass_on_after, between=_between_children)


def _between_children() -> None:
    crash_point("recover.between_children")


@dataclass(frozen=True)
class _Taken:
    epoch: int
    info: ChildInfo
    invocation: str
    tail_removed: int
    final: FinalFound | None
    #: Why the child's history can never be made legal again (an invalid compaction boundary):
    #: the execution ends FAILED with this reason instead of a take that rolls back forever.
    unrecoverable: str | None = None
    #: The first round, read in the take's transaction (None: the run reads it).
    first: FirstRound | None = None


def _take_for_recovery(execution_id: int, epoch: int, deps: LoopDeps) -> _Taken | ChildOutcome:
    """ONE transaction: take, legacy inference, child phase RESUMING, tail cleanup, final, and
    the first round (the journaled one, or the model messages)."""
    with transaction() as s:
        try:
            new_epoch = take_execution(
                s,
                execution_id,
                expected_epoch=epoch,
                to_status=ExecutionStatus.RECOVERING,
                owner=deps.owner,
                lease_seconds=deps.lease_seconds,
            )
        except IllegalTransition:
            log_event(log, "subagent_recovery_skipped", execution_id=execution_id, reason="not_pending")
            return ChildOutcome.STALE
        if new_epoch is None:
            log_event(log, "subagent_recovery_skipped", execution_id=execution_id, reason="stale_epoch")
            return ChildOutcome.STALE
        # The facts, and the child's phase RESUMING: one statement, fenced by the take above
        # (same transaction): only the epoch's new owner moves the phase.
        info = load_child_setting_phase(s, execution_id, Phase.RESUMING)
        charge_dead_call(s, info)  # a model call its dead run never stored: charged as estimated
        if info.invocation_type is None or info.parent_tool_call_id is None:
            # A pre-upgrade row: inferred and written back in the first recovery transaction,
            # before anything reads its invocation (its followup fields, R13).
            invocation, call_id = infer_and_store(s, execution_id)
            info = replace(info, invocation_type=invocation, parent_tool_call_id=call_id)
        boundary = info.compaction.boundary
        try:
            rows = load_raw(s, info.child_session_id, boundary)  # validates the boundary
        except BoundaryInvalid as exc:
            # NOTE: the take itself must land (it is what stops the scan from re-sending this
            # reservation every two leases); the child then ends FAILED with the reason.
            log_event(
                log,
                "subagent_recovery_unrecoverable",
                logging.ERROR,
                execution_id=execution_id,
                reason="invalid_compaction_boundary",
            )
            reason = f"subagent history cannot be recovered: {exc}"
            return _Taken(new_epoch, info, str(info.invocation_type), 0, None, reason)
        removed = set(cleanup_incomplete_tail(s, info.child_session_id, boundary, rows=rows))
        live = [m for m in rows if m.id not in removed]  # the live rows after the boundary
        final = existing_final(s, info, live if boundary is None else None)
        first = first_round(s, info, new_epoch, live) if final is None else None
    return _Taken(new_epoch, info, str(info.invocation_type), len(removed), final, first=first)


def _recover(execution_id: int, epoch: int, deps: LoopDeps) -> ChildEnd:
    taken = _take_for_recovery(execution_id, epoch, deps)
    if isinstance(taken, ChildOutcome):
        return ChildEnd(taken)
    crash_point("recover.after_take")
    info, new_epoch = taken.info, taken.epoch
    log_event(
        log,
        "subagent_recovery_start",
        execution_id=execution_id,
        parent_id=info.parent_session_id,
        child_session_id=info.child_session_id,
        invocation=taken.invocation,
        tail_removed=taken.tail_removed,
    )
    if taken.unrecoverable is not None:
        unrecoverable = Failed(taken.unrecoverable, code=FailureCode.INVALID_HISTORY)
        return end_with_failure(info, new_epoch, ChildOutcome.FAILED, unrecoverable)
    try:
        with infrastructure_boundary(log, "subagent_recovery_infra_error", execution_id=execution_id) as fault:
            if taken.final is not None:
                # R20: the final answer exists; finish without calling the model again.
                found = Completed(taken.final.content, final_message_id=taken.final.message_id)
                state = finish_child(info, new_epoch, found)
                return ChildEnd(ChildOutcome.COMPLETED_FROM_FINAL, state) if state else ChildEnd(ChildOutcome.LOST)
            if info.child_phase == Phase.CANCELLED:
                # A cancelled child is never run again: a child parked for an approval has no
                # loop to notice its cancel, so its recovery ends it (docs/approvals.md).
                return end_with_failure(info, new_epoch, ChildOutcome.CANCELLED, Stopped())
            if utcnow() >= child_deadline(info.started_at):
                timed_out = Failed(timeout_reason(), code=FailureCode.DEADLINE)
                return end_with_failure(info, new_epoch, ChildOutcome.TIMED_OUT, timed_out)
        if fault:
            return ChildEnd(ChildOutcome.INFRA_ERROR)
    except Exception as exc:
        log_event(log, "subagent_recovery_failed", logging.WARNING, execution_id=execution_id, error=type(exc).__name__)
        reason = f"subagent recovery failed: {describe_exception(exc)}"
        return end_with_failure(info, new_epoch, ChildOutcome.FAILED, Failed(reason))
    return run_rounds(info, new_epoch, deps, first=taken.first)
