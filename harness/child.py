"""The child (SUBAGENT) loop: rounds of one execution in its child session, and its end.

A child's final round commits the final ASSISTANT, final_message_id, the execution's terminal
status, the result JSON (one factory, harness.results) and the counters in ONE transaction,
fenced by the execution's epoch. Taking the execution (normal start or recovery) is the
lifecycle's job (recovery.child); this module runs what was taken.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness.agents import AgentDef, get_agent
from harness.errors import BoundaryInvalid, Cancelled, DeadlineExceeded, infrastructure_boundary
from harness.events import publish_status
from harness.fence import ExecutionFence, Heartbeat
from harness.history import Compaction, append_message
from harness.journal import RoundInFlight, journal_reply, resume, resume_in
from harness.loop import LoopDeps, ask, inline_round, model_messages
from harness.model import ModelReply
from harness.presence import LOCAL_NEVER_CONNECTED, wait_for_client
from harness.results import describe_exception, failure_result, followup_fields, success_result
from harness.tools import tool_names
from logfmt import log_event
from models import (
    AgentSession,
    ExecutionMode,
    ExecutionStatus,
    InvocationType,
    LeaseLost,
    Message,
    Phase,
    Role,
    SubagentExecution,
    transaction,
)
from models.base import utcnow
from models.execution import finish_execution
from models.session import set_child_phase
from settings import get_settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChildInfo:
    execution_id: int
    parent_session_id: int
    child_session_id: int
    agent_type: str
    invocation_type: InvocationType | None
    started_at: datetime
    execution_start_message_id: int | None
    execution_mode: ExecutionMode
    user_id: str
    task_description: str
    #: The child session's compaction as the loading transaction read it (its first view).
    compaction: Compaction = field(default_factory=Compaction)
    #: As the loading transaction read them (recovery's take: legacy inference, R20).
    parent_tool_call_id: str | None = None
    final_message_id: int | None = None
    child_phase: Phase | None = None


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
    E = SubagentExecution
    S = AgentSession
    row = s.execute(
        select(
            E.id,
            E.parent_session_id,
            E.child_session_id,
            E.agent_type,
            E.invocation_type,
            E.started_at,
            E.execution_start_message_id,
            S.execution_mode,
            S.user_id,
            E.task_description,
            S.compaction_boundary_message_id,
            S.compaction_summary,
            E.parent_tool_call_id,
            E.final_message_id,
            S.phase,
        )
        .join(S, S.id == E.child_session_id)
        .where(E.id == execution_id)
    ).one()
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
    )


def _child_counters(s: Any, child_session_id: int, start_id: int | None) -> tuple[int, int]:
    """(rounds, tool calls) of the execution: live assistant and TOOL rows after its USER."""
    q = select(Message.role, func.count()).where(Message.session_id == child_session_id, Message.deleted.is_(False))
    if start_id is not None:
        q = q.where(Message.id > start_id)
    counts = dict(s.execute(q.group_by(Message.role)).all())
    return int(counts.get(Role.ASSISTANT, 0)), int(counts.get(Role.TOOL, 0))


def _followup_info(s: Any, info: ChildInfo) -> dict[str, Any] | None:
    if info.invocation_type != InvocationType.FOLLOWUP:
        return None
    E = SubagentExecution
    earlier = (
        s.execute(select(E.status).where(E.child_session_id == info.child_session_id, E.id <= info.execution_id))
        .scalars()
        .all()
    )
    completed = sum(1 for st in earlier if st == ExecutionStatus.COMPLETED) + 1
    return followup_fields(len(earlier), completed)


@dataclass(frozen=True)
class RoundState:
    """The execution's round as its end left it (read in the finishing transaction): what the
    lifecycle needs to decide whether to ask for the round's delivery, without another trip."""

    parent_id: int
    parent_epoch: int
    parent_owner: str | None
    pending: int  #: executions of the parent still PENDING delivery (this one included)
    active: int  #: of those, still running
    max_epoch: int  #: >= 2 when some went through recovery


def _round_state(s: Any, parent: _Parent) -> RoundState:
    """The round as the finishing transaction sees it, after the execution's end.

    NOTE: the caller holds the parent row's lock (taken first in its transaction): siblings
    finishing at the same moment serialize on it, so the later one counts the earlier one's
    end (READ COMMITTED: a new snapshot per statement) and one of them sees the round complete."""
    E = SubagentExecution
    active, max_epoch, pending = s.execute(
        select(
            func.count().filter(E.status.in_((ExecutionStatus.RUNNING, ExecutionStatus.RECOVERING))),
            func.max(E.epoch),
            func.count(),
        ).where(E.parent_session_id == parent.id, E.delivery_status == "PENDING")
    ).one()
    return RoundState(parent.id, parent.epoch, parent.owner, int(pending), int(active), int(max_epoch or 0))


@dataclass(frozen=True)
class Usage:
    """Tokens of the model reply that ends the execution: the fence adds them to the
    execution's counters in the finishing transaction."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Completed:
    """The child answered: ``text`` is its result. ``final_message_id`` names its final
    ASSISTANT when that is committed already (recovery found it, R20); without it the end
    appends the final ASSISTANT with ``text`` as its content."""

    text: str
    final_message_id: int | None = None


@dataclass(frozen=True)
class Failed:
    """The child ended without an answer (a model or tool error, max_rounds, the deadline, an
    unrecoverable history): ``reason`` is the result's error text."""

    reason: str


@dataclass(frozen=True)
class Stopped:
    """The child session was cancelled."""

    reason: str = "subagent cancelled"


#: What an execution ends with: the one argument of ``finish_child``.
ChildResult = Completed | Failed | Stopped


@dataclass(frozen=True)
class _End:
    """The execution's end as its finishing transaction built it."""

    status: ExecutionStatus
    phase: Phase  #: the child session's phase that goes with the status
    result: dict[str, Any]  #: the result JSON (harness.results, the one factory)
    rounds: int
    tool_calls: int
    prompt_tokens: int  #: the execution's totals, this end's usage counted
    completion_tokens: int


def finish_child(info: ChildInfo, epoch: int, result: ChildResult, *, usage: Usage = Usage()) -> RoundState | None:
    """Commit the execution's end in ONE transaction, in three steps: lock the parent row (and
    read the execution's token counters), build the end (the final ASSISTANT when it is new,
    the result JSON with ``usage`` counted, the counters), then the execution's compare-and-set
    to its terminal status (the epoch is the fence), with the child's phase.

    Returns the round's state as that transaction saw it, or None when a newer owner holds
    the execution (nothing written)."""
    try:
        with transaction() as s:
            parent = _lock_parent(s, info)
            final_id = _final_message(s, info, result)
            end = _build_end(s, info, result, parent=parent, usage=usage)
            _finish_with_phase(s, info, epoch=epoch, end=end, final_message_id=final_id)
            state = _round_state(s, parent)
    except _Lost:
        return None
    crash_point("child.after_final")
    publish_status(info.child_session_id, end.phase)
    log_event(log, "child_finished", execution_id=info.execution_id, status=end.status, rounds=end.rounds)
    return state


class _Lost(Exception):
    """Raised inside ``finish_child``'s transaction when the execution's compare-and-set finds
    a newer owner, to roll everything it wrote back (the final ASSISTANT, the phase); caught
    there. Control flow, not an error."""


@dataclass(frozen=True)
class _Parent:
    """The parent row as the finishing transaction locked it, and the execution's counters."""

    id: int
    epoch: int
    owner: str | None
    prompt_tokens: int  #: the execution's, before this end's usage
    completion_tokens: int


def _lock_parent(s: Session, info: ChildInfo) -> _Parent:
    """Step 1. NOTE: the parent row first, as delivery and cancel lock it (parent, then its
    executions): the same order everywhere, so a finishing child never deadlocks with them,
    and siblings finishing at once serialize here (``_round_state`` counts the earlier end).
    The execution's token counters are read in the same statement (not locked: only the
    epoch's owner adds to them, and the end's compare-and-set checks the epoch)."""
    E, S = SubagentExecution, AgentSession
    row = s.execute(
        select(S.epoch, S.lease_owner, E.prompt_tokens, E.completion_tokens)
        .join(E, E.parent_session_id == S.id)
        .where(S.id == info.parent_session_id, E.id == info.execution_id)
        .with_for_update(of=S)
    ).one()
    return _Parent(info.parent_session_id, int(row.epoch), row.lease_owner, row.prompt_tokens, row.completion_tokens)


def _final_message(s: Session, info: ChildInfo, result: ChildResult) -> int | None:
    """The final ASSISTANT's id: the committed one, or a new one for a new answer."""
    if not isinstance(result, Completed):
        return None
    if result.final_message_id is not None:
        return result.final_message_id
    return append_message(s, info.child_session_id, Role.ASSISTANT, result.text)


def _build_end(s: Session, info: ChildInfo, result: ChildResult, *, parent: _Parent, usage: Usage) -> _End:
    """Step 2: the result JSON from what the transaction sees: the execution's token counters
    with this end's usage, the child's rounds and tool calls."""
    prompt = parent.prompt_tokens + usage.prompt_tokens
    completion = parent.completion_tokens + usage.completion_tokens
    rounds, tool_calls = _child_counters(s, info.child_session_id, info.execution_start_message_id)
    followup = _followup_info(s, info)
    if isinstance(result, Completed):
        success = success_result(
            agent_type=info.agent_type,
            child_session_id=info.child_session_id,
            text=result.text,
            rounds=rounds,
            tool_calls=tool_calls,
            prompt_tokens=prompt,
            completion_tokens=completion,
            followup=followup,
        )
        return _End(ExecutionStatus.COMPLETED, Phase.COMPLETED, success, rounds, tool_calls, prompt, completion)
    stopped = isinstance(result, Stopped)
    failure = failure_result(
        agent_type=info.agent_type,
        child_session_id=info.child_session_id,
        reason=result.reason,
        cancelled=stopped,
        followup=followup,
    )
    if stopped:
        return _End(ExecutionStatus.CANCELLED, Phase.CANCELLED, failure, rounds, tool_calls, prompt, completion)
    return _End(ExecutionStatus.FAILED, Phase.FAILED, failure, rounds, tool_calls, prompt, completion)


def _finish_with_phase(s: Session, info: ChildInfo, *, epoch: int, end: _End, final_message_id: int | None) -> None:
    """Step 3: the execution's compare-and-set to its terminal status (``_Lost`` when a newer
    owner holds it), with the child's phase."""
    landed = finish_execution(
        s,
        info.execution_id,
        epoch=epoch,
        status=end.status,
        result=end.result,
        error=None if end.status == ExecutionStatus.COMPLETED else end.result["error"],
        final_message_id=final_message_id,
        rounds=end.rounds,
        total_tool_calls=end.tool_calls,
        prompt_tokens=end.prompt_tokens,
        completion_tokens=end.completion_tokens,
    )
    if not landed:
        raise _Lost()
    set_child_phase(s, info.child_session_id, end.phase)


#: Phases of a child session that a taken execution may (re)start from.
CHILD_STARTABLE = (None, Phase.IDLE, Phase.RUNNING, Phase.RESUMING)


class ChildOutcome(StrEnum):
    """How one run of an execution (``start_child``, ``recover_child``) ended."""

    COMPLETED = "completed"  #: the final answer was committed with the execution COMPLETED
    COMPLETED_FROM_FINAL = "completed_from_final"  #: recovery found the final answer committed (R20)
    FAILED = "failed"  #: a FAILED result was committed (model/tool error, max_rounds, bad history)
    TIMED_OUT = "timed_out"  #: recovery found the absolute deadline passed: FAILED committed (R6)
    CANCELLED = "cancelled"  #: the child session was cancelled: CANCELLED committed
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


def first_round(s: Session, info: ChildInfo, epoch: int) -> FirstRound | None:
    """``FirstRound`` in the taker's transaction ``s``, which holds ``epoch``; None when the run
    must read it itself (a LOCAL child waits for its client first; an unknown agent or an
    invalid compaction boundary fails in the run, not in the take). A re-taken execution
    (epoch >= 2: the normal path takes epoch 1) continues the round its crashed run journaled."""
    if info.execution_mode == ExecutionMode.LOCAL:
        return None
    try:
        agent = get_agent(info.agent_type)
    except Exception:
        return None
    if agent.execution_mode == ExecutionMode.LOCAL:
        return None
    if epoch >= 2:
        in_flight = resume_in(s, info.child_session_id, epoch)
        if in_flight is not None:
            return FirstRound(in_flight=in_flight)
    try:
        return FirstRound(view=model_messages(info.child_session_id, agent, s, info.compaction))
    except BoundaryInvalid:
        return None  # the run reads it again and ends FAILED with the reason


def run_rounds(info: ChildInfo, epoch: int, deps: LoopDeps, *, first: FirstRound | None = None) -> ChildEnd:
    """Run a taken execution's rounds to its end (the taker set the child's phase). Ends
    COMPLETED, FAILED, CANCELLED, LOST (a newer owner: nothing written) or INFRA_ERROR (a
    database/Redis fault: nothing written, the lease lapses and the scan resumes it — DESIGN
    §6). Never raises: a chord header never breaks its callback."""
    execution_id = info.execution_id
    deadline = child_deadline(info.started_at)
    fence = ExecutionFence(info.child_session_id, epoch, deps.lease_seconds, execution_id=execution_id)
    try:
        with infrastructure_boundary(log, "child_infra_error", execution_id=execution_id):
            publish_status(info.child_session_id, Phase.RUNNING)
            agent = get_agent(info.agent_type)
            allowed = agent.tool_names(tool_names(), subagent=True)
            local = agent.execution_mode == ExecutionMode.LOCAL or info.execution_mode == ExecutionMode.LOCAL
            with Heartbeat(fence):
                final = _child_rounds(info, fence, agent, allowed, deadline, deps, local, first)
            usage = Usage(final.prompt_tokens, final.completion_tokens)
            state = finish_child(info, epoch, Completed(final.content or ""), usage=usage)
            return ChildEnd(ChildOutcome.COMPLETED, state) if state else ChildEnd(ChildOutcome.LOST)
        return ChildEnd(ChildOutcome.INFRA_ERROR)
    except LeaseLost:
        log_event(log, "child_lost", execution_id=execution_id, epoch=epoch)
        return ChildEnd(ChildOutcome.LOST)
    except Cancelled:
        return end_with_failure(info, epoch, ChildOutcome.CANCELLED, Stopped())
    except DeadlineExceeded as exc:
        reason = str(exc) if str(exc) == LOCAL_NEVER_CONNECTED else timeout_reason()
        return end_with_failure(info, epoch, ChildOutcome.FAILED, Failed(reason))
    except Exception as exc:
        log_event(
            log, "child_failed", logging.WARNING, exc_info=True, execution_id=execution_id, error=type(exc).__name__
        )
        return end_with_failure(info, epoch, ChildOutcome.FAILED, Failed(f"subagent failed: {describe_exception(exc)}"))


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
    agent: AgentDef,
    allowed: tuple[str, ...],
    deadline: datetime,
    deps: LoopDeps,
    local: bool,
    first: FirstRound | None = None,
) -> ModelReply:
    """Rounds until the model answers without tool calls; returns that final reply (uncommitted).
    A LOCAL child waits for its desktop client before every round: a client that disconnects
    mid-run is noticed at the next round, and the wait consumes the same deadline (spec §7.4).

    A recovered execution (epoch >= 2: the normal path takes epoch 1) first continues the
    round its crashed run journaled, without asking the model again (harness.journal).
    ``first`` is what the taker read for the first round (then nothing is read again here)."""
    if first is not None:
        in_flight, first_view = first.in_flight, first.view
    else:
        in_flight = resume(fence, info.child_session_id) if fence.epoch >= 2 else None
        first_view = None
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
            reply = ask(deps, view, allowed, deadline, agent.model_options)
            if not reply.tool_calls:
                return reply
            rnd = journal_reply(fence, info.child_session_id, reply)
        inline_round(fence, session_id=info.child_session_id, rnd=rnd, allowed=allowed, deadline=deadline, kind="child")
        crash_point("child.after_round")
    raise RuntimeError(f"reached max_rounds={agent.max_rounds} without a final answer")
