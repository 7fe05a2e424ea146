"""A child execution's end: ONE transaction that commits the final ASSISTANT (when there is a
new answer), final_message_id, the execution's terminal status, the result JSON (the one
factory, harness.results), the counters and the child's phase, fenced by the execution's
epoch; it returns the round's state as that transaction saw it, so the lifecycle
(harness.child) knows whether this end completed the round.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness.events import publish_status
from harness.history import Compaction, append_message
from harness.model import ModelReply
from harness.results import failure_result, followup_fields, success_result
from harness.usage import append_reply, record_call
from logfmt import log_event
from models import (
    AgentSession,
    ExecutionMode,
    ExecutionStatus,
    InvocationType,
    Message,
    Phase,
    Role,
    SubagentExecution,
    transaction,
)
from models.budget import return_allocation
from models.db import built_once
from models.enums import FailureCode
from models.execution import finish_execution
from models.session import FailureReason, set_child_phase

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
    #: When the child session began waiting for the model (None: it is not waiting).
    model_outage_since: datetime | None = None
    #: Whether the child session had an open round journal entry as the loading transaction
    #: read it (None: not read); ``harness.child.first_round`` reads no entry when False.
    journal_open: bool | None = None
    #: The root of the child's budgeted tree (``agent_session.budget_root_id``; None: no budget).
    budget_root_id: int | None = None
    #: The child session's ``held_tokens`` as the loading transaction read it (> 0 at a take: its
    #: previous run died with a model call in flight; harness.child.charge_dead_call).
    held_tokens: int = 0
    #: The child's allocation (``child_budget``) and what its calls used, as read at the take;
    #: None: not capped (models.budget.allocate_child).
    cap_tokens: int | None = None
    cap_used_tokens: int = 0
    #: The child session's release (docs/releases.md; None: the worker's configuration).
    release_id: int | None = None
    #: Since when the child session waits for a worker of its release (None: it does not).
    release_wait_since: datetime | None = None


def _live_after_start(role: Role) -> Any:
    """SQL: how many live ``role`` rows the child session holds after the execution's USER
    (its rounds: ASSISTANT rows; its tool calls: TOOL rows)."""
    return (
        select(func.count())
        .where(
            Message.session_id == bindparam("b_sid"),
            Message.deleted.is_(False),
            Message.id > bindparam("b_after"),
            Message.role == role,
        )
        .scalar_subquery()
    )


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
    """The round as the finishing transaction sees it, after the execution's end, read under
    the parent row's lock: of siblings ending at once, the last sees the round complete
    (docs/exactly-once.md, "At least once")."""
    active, max_epoch, pending = s.execute(_round_state_stmt(), {"b_parent": parent.id}).one()
    return RoundState(parent.id, parent.epoch, parent.owner, int(pending), int(active), int(max_epoch or 0))


@built_once
def _round_state_stmt() -> Any:
    E = SubagentExecution
    return select(
        func.count().filter(E.status.in_((ExecutionStatus.RUNNING, ExecutionStatus.RECOVERING))),
        func.max(E.epoch),
        func.count(),
    ).where(E.parent_session_id == bindparam("b_parent"), E.delivery_status == "PENDING")


@dataclass(frozen=True)
class Usage:
    """Tokens of the model reply that ends the execution: the fence adds them to the
    execution's counters in the finishing transaction."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: The reply itself, fresh from the provider: its usage is recorded with the end
    #: (harness.usage). None when no model was asked (an end found committed already).
    reply: ModelReply | None = None


@dataclass(frozen=True)
class Completed:
    """The child answered: ``text`` is its result. ``final_message_id`` names its final
    ASSISTANT when that is committed already (recovery found it, R20); without it the end
    appends the final ASSISTANT with ``text`` as its content."""

    text: str
    final_message_id: int | None = None
    #: The answer's own provider fields (reasoning, typed parts), kept on the final ASSISTANT.
    provider_fields: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Failed:
    """The child ended without an answer (a model or tool error, max_rounds, the deadline, an
    unrecoverable history): ``reason`` is the result's error text; ``partial`` the text of an
    answer the model did not finish (cut off, filtered, refused), kept in the result."""

    reason: str
    partial: str | None = None
    #: Why, as the child session stores it (its ``failure_code``).
    code: FailureCode = FailureCode.INTERNAL_ERROR


@dataclass(frozen=True)
class Stopped:
    """The child session was cancelled."""

    reason: str = "subagent cancelled"
    code: FailureCode = FailureCode.CANCELLED_BY


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
    #: Why the child session stops (FAILED, CANCELLED); None when it completed.
    failure: FailureReason | None = None


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
            final_id, recorded = _final_message(s, info, result, usage.reply)
            appended = isinstance(result, Completed) and result.final_message_id is None
            end = _build_end(s, info, result, parent=parent, usage=usage, appended=appended)
            _finish_with_phase(s, info, epoch=epoch, end=end, final_message_id=final_id)
            if usage.reply is not None and not recorded:
                record_call(s, info.child_session_id, usage.reply, execution_id=info.execution_id)
            if info.cap_tokens is not None and info.budget_root_id is not None:
                # The unused part of the child's allocation returns to the tree, with its end.
                return_allocation(s, child_session_id=info.child_session_id, root_session_id=info.budget_root_id)
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
    rounds: int  #: the child's live ASSISTANT rows after the execution's USER, before this end
    tool_calls: int  #: its live TOOL rows after that USER


def _lock_parent(s: Session, info: ChildInfo) -> _Parent:
    """Step 1. The parent row first, as delivery and cancel lock it (parent, then its
    executions; docs/exactly-once.md, "At most once"): a finishing child never deadlocks with
    them, and siblings finishing at once serialize here (``_round_state`` counts the earlier end).
    The execution's token counters and the child's rounds and tool calls are read in the same
    statement (not locked: only the epoch's owner adds to them, and the end's compare-and-set
    checks the epoch)."""
    params = {
        "b_parent": info.parent_session_id,
        "b_eid": info.execution_id,
        "b_sid": info.child_session_id,
        "b_after": info.execution_start_message_id or 0,
    }
    row = s.execute(_lock_parent_stmt(), params).one()
    return _Parent(
        info.parent_session_id,
        int(row.epoch),
        row.lease_owner,
        row.prompt_tokens,
        row.completion_tokens,
        int(row.rounds),
        int(row.tool_calls),
    )


@built_once
def _lock_parent_stmt() -> Any:
    E, S = SubagentExecution, AgentSession
    return (
        select(
            S.epoch,
            S.lease_owner,
            E.prompt_tokens,
            E.completion_tokens,
            _live_after_start(Role.ASSISTANT).label("rounds"),
            _live_after_start(Role.TOOL).label("tool_calls"),
        )
        .join(E, E.parent_session_id == S.id)
        .where(S.id == bindparam("b_parent"), E.id == bindparam("b_eid"))
        .with_for_update(of=S)
    )


def _final_message(
    s: Session, info: ChildInfo, result: ChildResult, reply: ModelReply | None
) -> tuple[int | None, bool]:
    """The final ASSISTANT's id (the committed one, or a new one for a new answer), and whether
    the fresh ``reply``'s usage was recorded with it (one statement: harness.usage.append_reply)."""
    if not isinstance(result, Completed):
        return None, False
    if result.final_message_id is not None:
        return result.final_message_id, False
    fields = result.provider_fields
    if reply is None:
        return append_message(s, info.child_session_id, Role.ASSISTANT, result.text, provider_fields=fields), False
    row = append_reply(
        s, info.child_session_id, reply, result.text, provider_fields=fields, execution_id=info.execution_id
    )
    return row, True


def _build_end(
    s: Session, info: ChildInfo, result: ChildResult, *, parent: _Parent, usage: Usage, appended: bool
) -> _End:
    """Step 2: the result JSON from what the transaction sees: the execution's token counters
    with this end's usage, the child's rounds (the final ASSISTANT this end ``appended``
    counted) and tool calls."""
    prompt = parent.prompt_tokens + usage.prompt_tokens
    completion = parent.completion_tokens + usage.completion_tokens
    rounds, tool_calls = parent.rounds + (1 if appended else 0), parent.tool_calls
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
        partial=result.partial if isinstance(result, Failed) else None,
    )
    why = FailureReason(result.code, failure["error"])
    if stopped:
        return _End(ExecutionStatus.CANCELLED, Phase.CANCELLED, failure, rounds, tool_calls, prompt, completion, why)
    return _End(ExecutionStatus.FAILED, Phase.FAILED, failure, rounds, tool_calls, prompt, completion, why)


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
    set_child_phase(s, info.child_session_id, end.phase, reason=end.failure)
