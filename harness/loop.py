"""The agent loop (DESIGN §6, normal path).

- A round without delegates commits one ASSISTANT + every TOOL in one transaction.
- A round with delegates commits pending_round + child sessions + executions + child USER
  messages in one transaction, runs the inline tools (recording each result in the round),
  then YIELDS: the scheduler enqueues chord(children..., deliver_round), the lease is released
  and the loop exits. No worker slot waits for a child.
- A child's final round commits the final ASSISTANT, final_message_id, the terminal status,
  the result JSON and the counters in one transaction.
Every write carries the epoch the loop was handed (harness.fence); cancellation is a phase
change any process can request, honoured between rounds and inside ``wait``.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import func, select, update

from crashpoints import crash_point
from harness.agents import DELEGATION_TOOLS, AgentDef, get_agent
from harness.delegate import CreatedExecution, create_execution
from harness.errors import Cancelled, DeadlineExceeded, ModelUnavailable
from harness.events import publish_status
from harness.fence import ExecutionFence, Fence, Heartbeat, SessionFence
from harness.history import append_message, model_view
from harness.model import ModelClient, ModelReply
from harness.presence import LOCAL_NEVER_CONNECTED, wait_for_client
from harness.results import describe_exception, failure_result, followup_fields, success_result
from harness.rounds import ToolResult, write_round
from harness.tools import REGISTRY, TOOL_NAMES, ToolContext, run_inline
from models import (
    AgentSession,
    ExecutionMode,
    ExecutionStatus,
    InvocationType,
    LeaseLost,
    Message,
    PendingRound,
    Phase,
    Role,
    SubagentExecution,
    transaction,
)
from models.base import utcnow
from models.execution import finish_execution, take_execution
from models.session import release_session, set_phase, take_session
from settings import get_settings

log = logging.getLogger("harness.loop")


class Scheduler(Protocol):
    """What the loop asks of the task layer (Celery in production, anything in tests)."""

    def start_children(self, parent_id: int, parent_epoch: int, children: Sequence[tuple[int, int]]) -> None:
        """Run each (execution_id, epoch) in parallel, then deliver_round(parent_id, parent_epoch)."""

    def resume_parent(self, parent_id: int, epoch: int) -> None:
        """Run the parent's loop with the epoch it was handed."""


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass
class LoopDeps:
    scheduler: Scheduler
    model: ModelClient | None = None
    owner: str = ""
    lease_seconds: float = 0.0

    def __post_init__(self) -> None:
        settings = get_settings()
        self.model = self.model or ModelClient.from_settings()
        self.owner = self.owner or worker_id()
        self.lease_seconds = self.lease_seconds or settings.LEASE_SECONDS


def _tool_specs(names: tuple[str, ...]) -> list[dict[str, Any]]:
    return [REGISTRY[n].spec() for n in names]


def _messages(session_id: int, agent: AgentDef) -> list[dict[str, Any]]:
    with transaction() as s:
        return [{"role": "system", "content": agent.system_prompt}, *model_view(s, session_id)]


def _ask(
    deps: LoopDeps, messages: list[dict[str, Any]], tools: tuple[str, ...], deadline: datetime | None
) -> ModelReply:
    timeout = None
    if deadline is not None:
        timeout = (deadline - utcnow()).total_seconds()
        if timeout <= 0:
            raise DeadlineExceeded()
    assert deps.model is not None
    try:
        return deps.model.complete(messages, _tool_specs(tools) or None, timeout=timeout)
    except ModelUnavailable:
        if deadline is not None and utcnow() >= deadline:
            raise DeadlineExceeded() from None
        raise


def _inline_round(
    fence: Fence, session_id: int, reply: ModelReply, allowed: tuple[str, ...], deadline: datetime | None, kind: str
) -> None:
    """Run every tool of a round, then commit assistant + every TOOL in one transaction."""
    results = []
    for call in reply.tool_calls:
        ctx = ToolContext(session_id, call.id, deadline, fence.cancelled, kind)
        results.append(ToolResult(call.id, run_inline(call.name, call.arguments, ctx, allowed)))
    with transaction() as s:
        fence.check(s, prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens)
        write_round(s, session_id, reply.content, [c.to_openai() for c in reply.tool_calls], results)


# --- parent (NORMAL / SIDE_TASK) loop --------------------------------------------------------


def run_agent(session_id: int, epoch: int, deps: LoopDeps) -> str:
    """Run the session's rounds as the holder of ``epoch``. Returns what happened:
    "stale" (a newer owner exists), "yielded", "waiting_user", "failed", "cancelled", "lost"."""
    with transaction() as s:
        new_epoch = take_session(
            s,
            session_id,
            expected_epoch=epoch,
            owner=deps.owner,
            lease_seconds=deps.lease_seconds,
            to_phase=Phase.RUNNING,
            require_expired=True,
            free_when_unowned=True,
        )
        agent_type = s.execute(select(AgentSession.agent_type).where(AgentSession.id == session_id)).scalar_one()
    if new_epoch is None:
        log.info("event=agent_run_skipped session=%s epoch=%s reason=stale", session_id, epoch)
        return "stale"
    crash_point("parent.after_resume")
    publish_status(session_id, Phase.RUNNING)
    fence = SessionFence(session_id, new_epoch, deps.lease_seconds)
    agent = get_agent(agent_type)
    allowed = agent.tool_names(TOOL_NAMES, subagent=False)
    try:
        with Heartbeat(fence):
            return _parent_rounds(session_id, fence, agent, allowed, deps)
    except LeaseLost:
        log.info("event=agent_run_lost session=%s epoch=%s", session_id, new_epoch)
        return "lost"
    except Cancelled:
        _release(fence, None)
        return "cancelled"
    except Exception as exc:
        log.warning("event=agent_run_failed session=%s error=%s", session_id, type(exc).__name__, exc_info=True)
        _release(fence, Phase.FAILED)
        return "failed"


def _release(fence: Fence, phase: Phase | None) -> None:
    with transaction() as s:
        release_session(s, fence.session_id, epoch=fence.epoch, to_phase=phase)
    if phase is not None:
        publish_status(fence.session_id, phase)


def _parent_rounds(
    session_id: int, fence: SessionFence, agent: AgentDef, allowed: tuple[str, ...], deps: LoopDeps
) -> str:
    for _ in range(agent.max_rounds):
        if fence.cancelled():
            if fence.lost:
                raise LeaseLost()
            raise Cancelled()
        reply = _ask(deps, _messages(session_id, agent), allowed, None)
        if not reply.tool_calls:
            with transaction() as s:
                fence.check(s, prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens)
                append_message(s, session_id, Role.ASSISTANT, reply.content or "")
                release_session(s, session_id, epoch=fence.epoch, to_phase=Phase.WAITING_USER)
            publish_status(session_id, Phase.WAITING_USER)
            return "waiting_user"
        if any(c.name in DELEGATION_TOOLS and c.name in allowed for c in reply.tool_calls):
            if _delegating_round(session_id, fence, reply, allowed, deps):
                return "yielded"
            continue
        _inline_round(fence, session_id, reply, allowed, None, "parent")
    with transaction() as s:
        fence.check(s)
        append_message(s, session_id, Role.ASSISTANT, f"stopped: reached max_rounds={agent.max_rounds}")
        release_session(s, session_id, epoch=fence.epoch, to_phase=Phase.FAILED)
    publish_status(session_id, Phase.FAILED)
    return "failed"


class _NothingCreated(Exception):
    def __init__(self, errors: dict[str, str]) -> None:
        self.errors = errors


def _delegating_round(
    session_id: int, fence: SessionFence, reply: ModelReply, allowed: tuple[str, ...], deps: LoopDeps
) -> bool:
    """Returns True when the loop yielded to its children, False when no child was created
    (every delegation was refused: the round was committed whole with the errors)."""
    calls = [c.to_openai() for c in reply.tool_calls]
    delegations = [c for c in reply.tool_calls if c.name in DELEGATION_TOOLS and c.name in allowed]
    created: list[CreatedExecution] = []
    try:
        with transaction() as s:
            fence.check(s, prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens)
            parent = s.execute(select(AgentSession).where(AgentSession.id == session_id)).scalar_one()
            round_row = PendingRound(
                session_id=session_id,
                assistant_content=reply.content,
                tool_calls=calls,
                inline_results={},
                prompt_tokens=reply.prompt_tokens,
                completion_tokens=reply.completion_tokens,
            )
            s.add(round_row)
            s.flush()
            errors: dict[str, str] = {}
            for call in delegations:
                out = create_execution(
                    s,
                    parent,
                    name=call.name,
                    raw_arguments=call.arguments,
                    tool_call_id=call.id,
                    pending_round_id=round_row.id,
                    lease_seconds=deps.lease_seconds,
                )
                if isinstance(out, str):
                    errors[call.id] = out
                else:
                    created.append(out)
            if not created:
                raise _NothingCreated(errors)
            round_row.inline_results = errors
            round_id = round_row.id
    except _NothingCreated as nothing:
        # No child: an ordinary round whose delegation results are the refusals.
        results = []
        for call in reply.tool_calls:
            if call.id in nothing.errors:
                results.append(ToolResult(call.id, nothing.errors[call.id]))
            else:
                ctx = ToolContext(session_id, call.id, None, fence.cancelled, "parent")
                results.append(ToolResult(call.id, run_inline(call.name, call.arguments, ctx, allowed)))
        with transaction() as s:
            fence.check(s)
            write_round(s, session_id, reply.content, calls, results)
        return False
    crash_point("delegate.after_create")
    log.info(
        "event=delegation_round session=%s round=%s executions=%s",
        session_id,
        round_id,
        ",".join(str(c.execution_id) for c in created),
    )
    delegated = {c.tool_call_id for c in created}
    for call in reply.tool_calls:
        if call.id in delegated or call.name in DELEGATION_TOOLS:
            continue
        ctx = ToolContext(session_id, call.id, None, fence.cancelled, "parent")
        result = run_inline(call.name, call.arguments, ctx, allowed)
        _record_inline(fence, round_id, call.id, result)
        crash_point("parent.mid_inline")
    crash_point("parent.before_yield")
    with transaction() as s:
        # Release as the epoch's owner; the epoch itself stays: deliver_round is handed it.
        fence.check(s)
        release_session(s, session_id, epoch=fence.epoch)
    deps.scheduler.start_children(session_id, fence.epoch, [(c.execution_id, 0) for c in created])
    return True


def _record_inline(fence: SessionFence, round_id: int, call_id: str, result: str) -> None:
    with transaction() as s:
        fence.check(s)
        row = s.execute(select(PendingRound).where(PendingRound.id == round_id).with_for_update()).scalar_one()
        row.inline_results = {**row.inline_results, call_id: result}


# --- child loop ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChildInfo:
    execution_id: int
    child_session_id: int
    agent_type: str
    invocation_type: InvocationType | None
    started_at: datetime
    execution_start_message_id: int | None
    execution_mode: ExecutionMode
    user_id: str
    task_description: str


def timeout_reason() -> str:
    return f"subagent timed out after {get_settings().SUBAGENT_TIMEOUT_SECONDS:g} seconds"


def child_deadline(started_at: datetime) -> datetime:
    """started_at + SUBAGENT_TIMEOUT_SECONDS: absolute, never reset by a restart (I5)."""
    return started_at + timedelta(seconds=get_settings().SUBAGENT_TIMEOUT_SECONDS)


def load_child(execution_id: int) -> ChildInfo:
    E = SubagentExecution
    S = AgentSession
    with transaction() as s:
        row = s.execute(
            select(
                E.id,
                E.child_session_id,
                E.agent_type,
                E.invocation_type,
                E.started_at,
                E.execution_start_message_id,
                S.execution_mode,
                S.user_id,
                E.task_description,
            )
            .join(S, S.id == E.child_session_id)
            .where(E.id == execution_id)
        ).one()
    return ChildInfo(*row)


def run_child(execution_id: int, epoch: int, deps: LoopDeps) -> str:
    """Normal path header task: take the execution (RUNNING, epoch + 1) and run it."""
    with transaction() as s:
        new_epoch = take_execution(
            s,
            execution_id,
            expected_epoch=epoch,
            to_status=ExecutionStatus.RUNNING,
            owner=deps.owner,
            lease_seconds=deps.lease_seconds,
            require_expired=True,
            free_when_unowned=True,
        )
        if new_epoch is not None:
            child = s.execute(
                select(SubagentExecution.child_session_id).where(SubagentExecution.id == execution_id)
            ).scalar_one()
            set_phase(s, child, to_phase=Phase.RUNNING, from_phases=CHILD_STARTABLE)
    if new_epoch is None:
        log.info("event=child_run_skipped execution=%s epoch=%s reason=stale", execution_id, epoch)
        return "stale"
    crash_point("child.after_take")
    return execute_child(execution_id, new_epoch, deps)


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


def finish_child(
    info: ChildInfo,
    epoch: int,
    *,
    text: str | None,
    failure: str | None = None,
    cancelled: bool = False,
    final_content: str | None = None,
    fence: Fence | None = None,
    tokens: tuple[int, int] = (0, 0),
    final_message_id: int | None = None,
) -> bool:
    """Commit the execution's end in ONE transaction: (final ASSISTANT when there is new text),
    final_message_id, terminal status, result JSON (the one factory), counters, child phase.
    Returns False when a newer owner holds the execution (nothing written)."""
    try:
        status, phase, rounds = _finish_child_tx(
            info, epoch, text, failure, cancelled, final_content, fence, tokens, final_message_id
        )
    except _Lost:
        return False
    crash_point("child.after_final")
    publish_status(info.child_session_id, phase)
    log.info("event=child_finished execution=%s status=%s rounds=%s", info.execution_id, status, rounds)
    return True


class _Lost(Exception):
    pass


def _finish_child_tx(
    info: ChildInfo,
    epoch: int,
    text: str | None,
    failure: str | None,
    cancelled: bool,
    final_content: str | None,
    fence: Fence | None,
    tokens: tuple[int, int],
    final_message_id: int | None = None,
) -> tuple[ExecutionStatus, Phase, int]:
    with transaction() as s:
        if fence is not None:
            fence.check(s, prompt_tokens=tokens[0], completion_tokens=tokens[1])
        final_id = final_message_id
        if final_content is not None:
            final_id = append_message(s, info.child_session_id, Role.ASSISTANT, final_content).id
        E = SubagentExecution
        tokens = s.execute(select(E.prompt_tokens, E.completion_tokens).where(E.id == info.execution_id)).one()
        rounds, tool_calls = _child_counters(s, info.child_session_id, info.execution_start_message_id)
        followup = _followup_info(s, info)
        if failure is None and text is not None:
            status = ExecutionStatus.COMPLETED
            result = success_result(
                agent_type=info.agent_type,
                child_session_id=info.child_session_id,
                text=text,
                rounds=rounds,
                tool_calls=tool_calls,
                prompt_tokens=tokens.prompt_tokens,
                completion_tokens=tokens.completion_tokens,
                followup=followup,
            )
        else:
            status = ExecutionStatus.CANCELLED if cancelled else ExecutionStatus.FAILED
            result = failure_result(
                agent_type=info.agent_type,
                child_session_id=info.child_session_id,
                reason=failure or "no result",
                cancelled=cancelled,
                followup=followup,
            )
        landed = finish_execution(
            s,
            info.execution_id,
            epoch=epoch,
            status=status,
            result=result,
            error=None if status == ExecutionStatus.COMPLETED else result["error"],
            final_message_id=final_id,
            rounds=rounds,
            total_tool_calls=tool_calls,
        )
        if not landed:
            raise _Lost()
        phase = {ExecutionStatus.COMPLETED: Phase.COMPLETED, ExecutionStatus.FAILED: Phase.FAILED}.get(
            status, Phase.CANCELLED
        )
        s.execute(
            update(AgentSession)
            .where(AgentSession.id == info.child_session_id, AgentSession.phase.is_distinct_from(Phase.CANCELLED))
            .values(phase=phase, updated_at=utcnow())
            .execution_options(synchronize_session=False)
        )
    return status, phase, rounds


#: Phases of a child session that a taken execution may (re)start from.
CHILD_STARTABLE = (None, Phase.IDLE, Phase.RUNNING, Phase.RESUMING)


def execute_child(execution_id: int, epoch: int, deps: LoopDeps) -> str:
    """Run a taken execution's rounds to its end (the taker set the child's phase). Never
    raises: every failure becomes a FAILED (or CANCELLED) execution, so a chord header never
    breaks its callback."""
    info = load_child(execution_id)
    deadline = child_deadline(info.started_at)
    fence = ExecutionFence(info.child_session_id, epoch, deps.lease_seconds, execution_id=execution_id)
    try:
        publish_status(info.child_session_id, Phase.RUNNING)
        agent = get_agent(info.agent_type)
        allowed = agent.tool_names(TOOL_NAMES, subagent=True)
        with Heartbeat(fence):
            if agent.execution_mode == ExecutionMode.LOCAL or info.execution_mode == ExecutionMode.LOCAL:
                wait_for_client(info.user_id, deadline, fence.cancelled)
            final = _child_rounds(info, fence, agent, allowed, deadline, deps)
        text = final.content or ""
        tokens = (final.prompt_tokens, final.completion_tokens)
        if not finish_child(info, epoch, text=text, final_content=text, fence=fence, tokens=tokens):
            return "lost"
        return "completed"
    except LeaseLost:
        log.info("event=child_lost execution=%s epoch=%s", execution_id, epoch)
        return "lost"
    except Cancelled:
        return (
            "cancelled"
            if finish_child(info, epoch, text=None, failure="subagent cancelled", cancelled=True)
            else "lost"
        )
    except DeadlineExceeded as exc:
        reason = str(exc) if str(exc) == LOCAL_NEVER_CONNECTED else timeout_reason()
        return "failed" if finish_child(info, epoch, text=None, failure=reason) else "lost"
    except Exception as exc:
        log.warning("event=child_failed execution=%s error=%s", execution_id, type(exc).__name__, exc_info=True)
        try:
            ok = finish_child(info, epoch, text=None, failure=f"subagent failed: {describe_exception(exc)}")
        except Exception:
            log.error("event=child_fail_not_recorded execution=%s", execution_id, exc_info=True)
            return "error"
        return "failed" if ok else "lost"


def _child_rounds(
    info: ChildInfo,
    fence: ExecutionFence,
    agent: AgentDef,
    allowed: tuple[str, ...],
    deadline: datetime,
    deps: LoopDeps,
) -> ModelReply:
    """Rounds until the model answers without tool calls; returns that final reply (uncommitted)."""
    for _ in range(agent.max_rounds):
        if fence.cancelled():
            if fence.lost:
                raise LeaseLost()
            raise Cancelled()
        if utcnow() >= deadline:
            raise DeadlineExceeded()
        reply = _ask(deps, _messages(info.child_session_id, agent), allowed, deadline)
        if not reply.tool_calls:
            return reply
        _inline_round(fence, info.child_session_id, reply, allowed, deadline, "child")
        crash_point("child.after_round")
    raise RuntimeError(f"reached max_rounds={agent.max_rounds} without a final answer")
