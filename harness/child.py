"""The child (SUBAGENT) loop: rounds of one execution in its child session.

The normal path's start (``start_child``, task ``agent.run_child``) takes the execution and
runs it; recovery's take is recovery.child's. Both run the same rounds (``run_rounds``), end
in the same transaction (harness.child_end), and then the last execution of a round to end
delivers the round in-process (``after_end``, with harness.delivery; docs/exactly-once.md).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness import arguments
from harness.agents import AgentDef
from harness.approval import AwaitingApproval, Gate, ParkOutcome, after_child_parked, park
from harness.budget_request import AskOutcome, ask_for_budget
from harness.child_end import ChildInfo, Completed, Failed, RoundState, Stopped, Usage, finish_child
from harness.delivery import deliver_and_resume
from harness.errors import (
    BoundaryInvalid,
    BudgetExhausted,
    Cancelled,
    DeadlineExceeded,
    HarnessError,
    MaxRoundsReached,
    ModelUnavailable,
    infrastructure_boundary,
)
from harness.events import publish_status
from harness.failure import INCOMPLETE_CODES, INCOMPLETE_REASONS, reason_for
from harness.fence import ExecutionFence, Heartbeat
from harness.history import Compaction
from harness.journal import RoundInFlight, journal_reply, resume, resume_in
from harness.loop import LoopDeps, ask, inline_round, model_messages
from harness.model import ModelReply
from harness.outage import model_answered, wait_for_model
from harness.presence import LOCAL_NEVER_CONNECTED, wait_for_client
from harness.release import ReleaseWait, offered_tools, release_needed, session_agent, wait_for_worker
from harness.results import describe_exception
from harness.scheduler import Scheduler
from logfmt import log_event
from models import (
    ExecutionMode,
    ExecutionStatus,
    IllegalTransition,
    LeaseLost,
    Message,
    Phase,
    Role,
    transaction,
)
from models.base import utcnow
from models.budget import charge_estimated
from models.child import child_facts_setting_phase_stmt, child_facts_starting_stmt, child_facts_stmt
from models.db import is_postgresql
from models.enums import FailureCode
from models.execution import take_execution
from models.release import release_found
from models.session import set_child_phase, set_phase
from settings import get_settings

log = logging.getLogger(__name__)


class Parked(Exception):
    """Raised inside a child's rounds when its execution was parked for an approval; the run
    ends without writing an end. Control flow, not an error."""


def timeout_reason() -> str:
    return f"subagent timed out after {get_settings().SUBAGENT_TIMEOUT_SECONDS:g} seconds"


def child_deadline(started_at: datetime) -> datetime:
    """started_at + SUBAGENT_TIMEOUT_SECONDS: absolute, never reset by a restart (I5)."""
    return started_at + timedelta(seconds=get_settings().SUBAGENT_TIMEOUT_SECONDS)


def load_child(execution_id: int, s: Session | None = None) -> ChildInfo:
    """The execution's child facts, in ``s`` when given (a taker's transaction), else in one of its own."""
    if s is None:
        with transaction() as own:
            return load_child(execution_id, own)
    return _child_info(s.execute(child_facts_stmt(), {"b_eid": execution_id}).one())


def load_child_setting_phase(s: Session, execution_id: int, to_phase: Phase) -> ChildInfo:
    """``load_child`` and ``models.session.set_child_phase`` (``to_phase``, a cancelled child
    stays cancelled) in ONE statement of the taker's transaction ``s``, which holds the
    execution's epoch: the facts are read as they were before the phase moved (the child's
    previous phase among them), as when the two ran one after the other. SQLite (the embedded
    default) has no data-modifying WITH: there they are two statements."""
    if not is_postgresql(s):
        info = load_child(execution_id, s)
        set_child_phase(s, info.child_session_id, to_phase)
        return info
    return _child_info(
        s.execute(child_facts_setting_phase_stmt(to_phase), {"b_eid": execution_id, "b_now": utcnow()}).one()
    )


def load_child_starting(s: Session, execution_id: int) -> tuple[ChildInfo, bool]:
    """``load_child`` and ``models.session.set_phase`` (RUNNING from ``CHILD_STARTABLE``, the
    normal path's start) in ONE statement of the taker's transaction ``s``, which holds the
    execution's epoch; the facts are read as they were before the phase moved. Returns the facts
    and whether the phase moved (False: the child was in another phase, kept: CANCELLED,
    WAITING_APPROVAL, an ended phase). SQLite: two statements, as ``load_child_setting_phase``."""
    if not is_postgresql(s):
        info = load_child(execution_id, s)
        return info, set_phase(s, info.child_session_id, to_phase=Phase.RUNNING, from_phases=CHILD_STARTABLE)
    row = s.execute(
        child_facts_starting_stmt(Phase.RUNNING, CHILD_STARTABLE), {"b_eid": execution_id, "b_now": utcnow()}
    ).one()
    return _child_info(row), row.phase_moved == 1


def _child_info(row: Any) -> ChildInfo:
    return ChildInfo(
        execution_id=row.id,
        parent_session_id=row.parent_session_id,
        child_session_id=row.child_session_id,
        agent_type=row.agent_type,
        invocation_type=row.invocation_type,
        started_at=row.started_at,
        execution_start_message_id=row.execution_start_message_id,
        execution_mode=row.execution_mode,
        user_id=row.user_id,
        task_description=row.task_description,
        compaction=Compaction(row.compaction_boundary_message_id, row.compaction_summary),
        parent_tool_call_id=row.parent_tool_call_id,
        final_message_id=row.final_message_id,
        child_phase=row.phase,
        model_outage_since=row.model_outage_since,
        journal_open=row.journal_open,
        budget_root_id=row.budget_root_id,
        held_tokens=int(row.held_tokens or 0),
        cap_tokens=row.cap_tokens,
        cap_used_tokens=int(row.cap_used_tokens or 0),
        release_id=row.release_id,
        release_wait_since=row.release_wait_since,
    )


def charge_dead_call(s: Session, info: ChildInfo) -> None:
    """In a taker's transaction: a reservation the child session still holds is a model call
    its previous run made and never stored (the worker died): charged as estimated
    (models.budget.charge_estimated). Nothing when it holds none, or its tree has no budget."""
    if info.held_tokens and info.budget_root_id is not None:
        charge_estimated(
            s,
            session_id=info.child_session_id,
            execution_id=info.execution_id,
            root_session_id=info.budget_root_id,
            held=info.held_tokens,
            cap_left=None if info.cap_tokens is None else info.cap_tokens - info.cap_used_tokens,
        )


#: Phases of a child session that a taken execution may (re)start from.
CHILD_STARTABLE = (None, Phase.IDLE, Phase.RUNNING, Phase.RESUMING)


class ChildOutcome(StrEnum):
    """How one run of an execution (``start_child``, ``recover_child``) ended."""

    COMPLETED = "completed"  #: the final answer was committed with the execution COMPLETED
    COMPLETED_FROM_FINAL = "completed_from_final"  #: recovery found the final answer committed (R20)
    FAILED = "failed"  #: a FAILED result was committed (model/tool error, max_rounds, bad history)
    WAITING_MODEL = "waiting_model"  #: the model is down: nothing written, recovered after a back-off
    #: the child's release is newer than this worker's, whose tools it lacks: nothing run, its
    #: execution's lease lapses after a back-off and the scan recovers it (docs/releases.md)
    WAITING_RELEASE = "waiting_release"
    TIMED_OUT = "timed_out"  #: recovery found the absolute deadline passed: FAILED committed (R6)
    CANCELLED = "cancelled"  #: the child session was cancelled: CANCELLED committed
    #: a tool call waits for a human decision: the execution's lease is released, its child session
    #: WAITING_APPROVAL; a decision (or the scan's backstop) hands it back to recovery
    WAITING_APPROVAL = "waiting_approval"
    STALE = "stale"  #: the take did not land (a newer owner, or nothing to take): nothing done
    LOST = "lost"  #: a newer owner took the execution mid-run: nothing written
    INFRA_ERROR = "infra_error"  #: a database/Redis fault: nothing written, the scan resumes it
    ERROR = "error"  #: an unexpected error, not even a failure result could be recorded

    @property
    def ended(self) -> bool:
        """True when this run wrote the execution's end: the round may now be complete."""
        return self in _ENDED


_ENDED = frozenset(
    {
        ChildOutcome.COMPLETED,
        ChildOutcome.COMPLETED_FROM_FINAL,
        ChildOutcome.FAILED,
        ChildOutcome.TIMED_OUT,
        ChildOutcome.CANCELLED,
    }
)


@dataclass(frozen=True)
class ChildEnd:
    """How a run of the execution ended, and (when it wrote the end) the round's state."""

    outcome: ChildOutcome
    state: RoundState | None = None


@dataclass(frozen=True)
class FirstRound:
    """What the execution's first round needs, read in the taker's transaction (one trip and
    one transaction fewer): the round its crashed run journaled, or else the model messages."""

    in_flight: RoundInFlight | None = None
    view: list[dict[str, Any]] | None = None


def first_round(s: Session, info: ChildInfo, epoch: int, rows: Sequence[Any] | None = None) -> FirstRound | None:
    """``FirstRound`` in the taker's transaction ``s``, which holds ``epoch``; None when the run
    must read it itself (a LOCAL child waits for its client first; an unknown agent or an
    invalid compaction boundary fails in the run, not in the take). A re-taken execution
    (epoch >= 2: the normal path takes epoch 1) continues the round its crashed run journaled.
    ``rows``: the child's live rows after its validated boundary, when the taker has read them
    (recovery's take: the model messages are then built from them, no second read)."""
    if info.execution_mode == ExecutionMode.LOCAL:
        return None
    try:
        agent = session_agent(s, info.agent_type, info.release_id)
    except HarnessError:
        return None
    if agent.execution_mode == ExecutionMode.LOCAL:
        return None
    # NOTE: ``info.journal_open`` was read after the take landed, in this transaction: an entry
    # a previous holder committed is in it (its commit renewed the execution's lease, so a take
    # that waited for it would not have landed); None (not read) reads the journal.
    if epoch >= 2 and info.journal_open is not False:
        in_flight = resume_in(s, info.child_session_id, epoch)
        if in_flight is not None:
            return FirstRound(in_flight=in_flight)
    try:
        return FirstRound(view=model_messages(info.child_session_id, agent, s=s, compaction=info.compaction, rows=rows))
    except BoundaryInvalid:
        return None  # the run reads it again and ends FAILED with the reason


def child_agent(info: ChildInfo) -> AgentDef:
    """The child's agent as its release defines it (docs/releases.md); a release already read by
    this process (the taker's ``first_round`` read it) is not read again."""
    return session_agent(None, info.agent_type, info.release_id)


def run_rounds(info: ChildInfo, epoch: int, deps: LoopDeps, *, first: FirstRound | None = None) -> ChildEnd:
    """Run a taken execution's rounds to its end (the taker set the child's phase). Ends
    COMPLETED, FAILED, CANCELLED, LOST (a newer owner: nothing written) or INFRA_ERROR (a
    database/Redis fault: nothing written, the lease lapses and the scan resumes it:
    docs/fault-model.md). Never raises: a failure becomes a FAILED execution."""
    execution_id = info.execution_id
    if info.child_phase == Phase.CANCELLED:
        # A cancelled child is never run, whichever message takes it (docs/approvals.md).
        return end_with_failure(info, epoch, ChildOutcome.CANCELLED, Stopped())
    deadline = child_deadline(info.started_at)
    fence = ExecutionFence(info.child_session_id, epoch, deps.lease_seconds, execution_id=execution_id)
    try:
        with infrastructure_boundary(log, "child_infra_error", execution_id=execution_id):
            publish_status(info.child_session_id, Phase.RUNNING)
            agent = child_agent(info)
            left = _left_for_release(info, fence, agent)
            if left is not None:
                return left
            allowed = offered_tools(agent, subagent=True)
            local = agent.execution_mode == ExecutionMode.LOCAL or info.execution_mode == ExecutionMode.LOCAL
            with Heartbeat(fence):
                final = _child_rounds(
                    info, fence, agent=agent, allowed=allowed, deadline=deadline, deps=deps, local=local, first=first
                )
            usage = Usage(final.prompt_tokens, final.completion_tokens, reply=final)
            result, outcome = _final_result(final)
            state = finish_child(info, epoch, result, usage=usage)
            return ChildEnd(outcome, state) if state else ChildEnd(ChildOutcome.LOST)
        return ChildEnd(ChildOutcome.INFRA_ERROR)
    except Parked:
        after_child_parked(execution_id, info.child_session_id, epoch)  # the heartbeat has stopped
        return ChildEnd(ChildOutcome.WAITING_APPROVAL)
    except LeaseLost:
        log_event(log, "child_lost", execution_id=execution_id, epoch=epoch)
        return ChildEnd(ChildOutcome.LOST)
    except Cancelled:
        return end_with_failure(info, epoch, ChildOutcome.CANCELLED, Stopped())
    except DeadlineExceeded as exc:
        reason = str(exc) if str(exc) == LOCAL_NEVER_CONNECTED else timeout_reason()
        return end_with_failure(info, epoch, ChildOutcome.FAILED, Failed(reason, code=FailureCode.DEADLINE))
    except BudgetExhausted as exc:
        return _out_of_budget(info, fence, exc)
    except Exception as exc:
        if isinstance(exc, ModelUnavailable) and exc.transient:
            with infrastructure_boundary(log, "child_infra_error", execution_id=execution_id) as fault:
                waiting = wait_for_model(
                    fence,
                    info.child_session_id,
                    execution_id=execution_id,
                    deadline=deadline,
                    retry_after_seconds=exc.retry_after_seconds,
                )
            if fault:
                return ChildEnd(ChildOutcome.INFRA_ERROR)
            if waiting:
                return ChildEnd(ChildOutcome.WAITING_MODEL)
        log_event(
            log, "child_failed", logging.WARNING, exc_info=True, execution_id=execution_id, error=type(exc).__name__
        )
        failed = Failed(f"subagent failed: {describe_exception(exc)}", code=reason_for(exc).code)
        return end_with_failure(info, epoch, ChildOutcome.FAILED, failed)


def _out_of_budget(info: ChildInfo, fence: ExecutionFence, exc: BudgetExhausted) -> ChildEnd:
    """A reservation of the child was refused, before the model was asked (its heartbeat has
    stopped). When its agent asks (``on_budget_exhausted = "ask"``) and the tree has something
    to raise: its execution parks on a budget request (harness.budget_request), not ended, so
    its parent's round keeps waiting for it. Else (or a raise was not approved) it ends FAILED
    ``budget_exhausted`` with what it had said so far, delivered to its parent once as any
    failure."""
    execution_id = info.execution_id
    asked: AskOutcome | None = None
    partial: str | None = None
    try:
        with infrastructure_boundary(log, "child_infra_error", execution_id=execution_id) as fault:
            if child_agent(info).on_budget_exhausted == "ask":
                asked = ask_for_budget(
                    fence,
                    session_id=info.child_session_id,
                    agent_type=info.agent_type,
                    needs=exc.needs,
                    execution_id=execution_id,
                    not_after=child_deadline(info.started_at),
                )
            if asked == AskOutcome.PARKED:
                after_child_parked(execution_id, info.child_session_id, fence.epoch)
                return ChildEnd(ChildOutcome.WAITING_APPROVAL)
            partial = _said_so_far(info.child_session_id)
    except LeaseLost:
        log_event(log, "child_lost", execution_id=execution_id, epoch=fence.epoch)
        return ChildEnd(ChildOutcome.LOST)
    except Cancelled:
        return end_with_failure(info, fence.epoch, ChildOutcome.CANCELLED, Stopped())
    if fault:
        return ChildEnd(ChildOutcome.INFRA_ERROR)
    said = describe_exception(exc) if asked is None else asked.stopped(describe_exception(exc))
    failed = Failed(f"subagent failed: {said}", partial=partial, code=reason_for(exc).code)
    return end_with_failure(info, fence.epoch, ChildOutcome.FAILED, failed)


def _said_so_far(child_session_id: int) -> str | None:
    """The text of the child's last ASSISTANT message that has any (a round's words beside its
    tool calls): its partial answer when its budget ran out. None when it said nothing. One
    read, on the failure path only."""
    with transaction() as s:
        said = s.execute(
            select(Message.content)
            .where(Message.session_id == child_session_id, Message.role == Role.ASSISTANT, Message.content != "")
            .order_by(Message.id.desc())
            .limit(1)
        ).scalar_one_or_none()
    return said or None


def _left_for_release(info: ChildInfo, fence: ExecutionFence, agent: AgentDef) -> ChildEnd | None:
    """None when this worker serves the child's release; else the run's end: the child is left
    for a worker of its release (its execution's lease lapses after a back-off), or FAILED
    ``release_unavailable`` once it waited RELEASE_WAIT_SECONDS (harness.release)."""
    if not agent.release_missing and info.release_wait_since is None:
        return None  # nothing to decide: no statement
    with transaction() as s:
        needed = release_needed(s, agent)
        if needed is None:
            release_found(s, info.child_session_id, epoch=None)
            return None
        waited = wait_for_worker(
            s,
            info.child_session_id,
            epoch=fence.epoch,
            release_id=needed,
            since=info.release_wait_since,
            execution_id=info.execution_id,
        )
    if waited == ReleaseWait.GAVE_UP:
        limit = get_settings().RELEASE_WAIT_SECONDS
        failed = Failed(
            f"subagent failed: no worker of release {needed} took it within {limit:g} s",
            code=FailureCode.RELEASE_UNAVAILABLE,
        )
        return end_with_failure(info, fence.epoch, ChildOutcome.FAILED, failed)
    return ChildEnd(ChildOutcome.WAITING_RELEASE if waited == ReleaseWait.WAITING else ChildOutcome.LOST)


def _final_result(final: ModelReply) -> tuple[Completed | Failed, ChildOutcome]:
    """The execution's end for the model's final answer: an answer cut off, filtered or refused
    is never a success; the execution fails with the reason, and the partial text is kept in
    its result."""
    incomplete = final.incomplete
    if incomplete is None:
        return Completed(final.content or "", provider_fields=final.provider_fields), ChildOutcome.COMPLETED
    partial = final.content or final.refusal or ""
    failed = Failed(INCOMPLETE_REASONS[incomplete], partial=partial, code=INCOMPLETE_CODES[incomplete])
    return failed, ChildOutcome.FAILED


def end_with_failure(info: ChildInfo, epoch: int, outcome: ChildOutcome, result: Failed | Stopped) -> ChildEnd:
    """Record a run's end without an answer; an infrastructure error while recording writes
    nothing (INFRA_ERROR: the lease lapses and the scan resumes the execution)."""
    try:
        with infrastructure_boundary(log, "child_infra_error", execution_id=info.execution_id) as fault:
            state = finish_child(info, epoch, result)
    except Exception:
        log_event(log, "child_fail_not_recorded", logging.ERROR, exc_info=True, execution_id=info.execution_id)
        return ChildEnd(ChildOutcome.ERROR)
    if fault:
        return ChildEnd(ChildOutcome.INFRA_ERROR)
    return ChildEnd(outcome, state) if state else ChildEnd(ChildOutcome.LOST)


def _child_rounds(
    info: ChildInfo,
    fence: ExecutionFence,
    *,
    agent: AgentDef,
    allowed: tuple[str, ...],
    deadline: datetime,
    deps: LoopDeps,
    local: bool,
    first: FirstRound | None = None,
) -> ModelReply:
    """Rounds until the model answers without tool calls; returns that final reply (uncommitted).
    A LOCAL child waits for its desktop client before every round: a client that disconnects
    mid-run is noticed at the next round, and the wait consumes the same deadline (docs/invariants.md, I5).

    A recovered execution (epoch >= 2: the normal path takes epoch 1) first continues the
    round its crashed run journaled, without asking the model again (harness.journal).
    ``first`` is what the taker read for the first round (then nothing is read again here)."""
    if first is not None:
        in_flight, first_view = first.in_flight, first.view
    else:
        in_flight = resume(fence, info.child_session_id) if fence.epoch >= 2 else None
        first_view = None
    gate = Gate(agent, execution_id=info.execution_id, not_after=deadline)
    model_waiting = info.model_outage_since is not None
    for _ in range(agent.max_rounds):
        fence.raise_if_stopped()
        if utcnow() >= deadline:
            raise DeadlineExceeded()
        if local:
            wait_for_client(info.user_id, deadline, fence.should_stop)
            if fence.should_stop():
                continue
        if in_flight is not None:
            rnd, in_flight = in_flight, None
        else:
            view, first_view = first_view or model_messages(info.child_session_id, agent), None
            arguments.check(view)  # the model is not asked again past a tool's max_retries
            reply = ask(
                deps,
                view,
                tools=allowed,
                deadline=deadline,
                options=agent.model_options,
                budget_root_id=info.budget_root_id,
                session_id=info.child_session_id,
                capped=info.cap_tokens is not None,
            )
            if model_waiting:
                model_answered(info.child_session_id)
                model_waiting = False
            if not reply.tool_calls:
                return reply
            rnd = journal_reply(fence, info.child_session_id, reply, approval=gate)
        try:
            inline_round(
                fence,
                session_id=info.child_session_id,
                rnd=rnd,
                allowed=allowed,
                deadline=deadline,
                kind="child",
                approval=gate,
            )
        except AwaitingApproval as waiting:
            outcome = park(
                fence, session_id=info.child_session_id, journal_id=waiting.journal_id, execution_id=info.execution_id
            )
            if outcome == ParkOutcome.PARKED:
                raise Parked() from None
            in_flight = resume(fence, info.child_session_id)  # answered meanwhile: the round goes on
            continue
        crash_point("child.after_round")
    raise MaxRoundsReached(f"reached max_rounds={agent.max_rounds} without a final answer")


def start_child(execution_id: int, epoch: int, deps: LoopDeps) -> ChildOutcome:
    """The normal path's agent.run_child: take the execution (RUNNING, epoch + 1) and run it. The take,
    the child's phase and the facts the run needs are ONE transaction."""
    try:
        with infrastructure_boundary(log, "child_infra_error", execution_id=execution_id) as fault, transaction() as s:
            new_epoch = take_execution(
                s,
                execution_id,
                expected_epoch=epoch,
                to_status=ExecutionStatus.RUNNING,
                owner=deps.owner,
                lease_seconds=deps.lease_seconds,
            )
            info: ChildInfo | None = None
            first: FirstRound | None = None
            if new_epoch is not None:
                info, moved = load_child_starting(s, execution_id)
                if not moved:  # the run decides by the phase it read (a cancelled child ends CANCELLED)
                    log_event(log, "child_phase_kept", execution_id=execution_id, phase=info.child_phase)
                charge_dead_call(s, info)
                first = first_round(s, info, new_epoch)  # in the take's transaction: one trip fewer
    except IllegalTransition:
        log_event(log, "child_run_skipped", execution_id=execution_id, epoch=epoch, reason="not_pending")
        return ChildOutcome.STALE
    if fault:
        return ChildOutcome.INFRA_ERROR
    if new_epoch is None or info is None:
        log_event(log, "child_run_skipped", execution_id=execution_id, epoch=epoch, reason="stale")
        return ChildOutcome.STALE
    crash_point("child.after_take")
    end = run_rounds(info, new_epoch, deps, first=first)
    after_end(execution_id, end, deps)
    return end.outcome


def after_end(execution_id: int, end: ChildEnd, deps: LoopDeps) -> None:
    """The last execution of a round to end delivers the round, in the normal path and in
    recovery alike; the round's state comes from the finishing transaction itself (no extra
    trip). Its backstops, and why a second delivery writes nothing: docs/exactly-once.md."""
    state = end.state
    if not end.outcome.ended or state is None:
        return
    if state.pending == 0 or state.active > 0 or state.parent_owner is not None:
        return  # delivered already, siblings still running, or the parent is not waiting
    log_event(log, "round_delivery_requested", parent_id=state.parent_id, execution_id=execution_id)
    try:
        # Delivered right here (one short transaction): no task hop between the last child and
        # its parent.
        deliver_and_resume(state.parent_id, state.parent_epoch, deps.scheduler)
    except Exception:
        log_event(log, "round_delivery_failed", logging.WARNING, exc_info=True, execution_id=execution_id)
        _ask_for_delivery(state, deps.scheduler)


def _ask_for_delivery(state: RoundState, scheduler: Scheduler) -> None:
    """The in-process delivery failed (a database blip): ask for it again as one message
    (``agent.deliver_round``), idempotent with the parent's epoch. Not sent either (the broker
    is down too): the scan delivers a round whose results wait longer than its grace."""
    try:
        scheduler.deliver_many([(state.parent_id, state.parent_epoch)])
    except Exception:
        log_event(log, "round_delivery_request_failed", logging.WARNING, parent_id=state.parent_id)
