"""The parent (NORMAL / SIDE_TASK) loop (DESIGN §6, normal path).

- A round without delegates commits one ASSISTANT + every TOOL in one transaction.
- A round with delegates commits pending_round + child sessions + executions + child USER
  messages in one transaction, runs the inline tools (recording each result in the round),
  then YIELDS: the lease is released (the epoch stays: deliver_round is handed it) and the
  scheduler enqueues chord(children..., deliver_round). No worker slot waits for a child.
- A broker error at that hand-off is not the parent's failure: everything the recovery needs
  is committed, the executions' creation reservations lapse and the scan starts them.
- A cancel lands between rounds, inside ``wait``, and in the fence of every write: a
  cancelled parent writes nothing more (it neither commits a round nor creates children).
- A model that repeats a tool_call id (within a reply, or one already answered in this
  session) gets that call refused as its TOOL error under a fresh id; it never kills the loop.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from sqlalchemy import bindparam, select, union
from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness.agents import DELEGATION_TOOLS, AgentDef, get_agent
from harness.delegate import CreatedExecution, create_execution, parent_of
from harness.errors import Cancelled, ModelUnavailable, infrastructure_boundary
from harness.events import publish_status
from harness.fence import Fence, Heartbeat, SessionFence
from harness.history import Compaction, append_message
from harness.journal import RoundInFlight, close_in, journal_reply, resume_in
from harness.loop import LoopDeps, ask, inline_round, model_messages
from harness.model import ModelReply, ToolCall
from harness.outage import model_answered, wait_for_model
from harness.scheduler import Handed
from harness.tools import ToolContext, run_inline, tool_names
from logfmt import log_event
from models import AgentSession, LeaseLost, Message, PendingRound, Phase, Role, SubagentExecution, transaction
from models.db import built_once
from models.session import end_run, release_session, take_session

log = logging.getLogger(__name__)


class RunOutcome(StrEnum):
    """How one ``run_agent`` (task ``agent.run``) ended."""

    STALE = "stale"  #: a newer owner holds the session (or it is not runnable): nothing done
    YIELDED = "yielded"  #: children were created; the lease is released until their delivery
    WAITING_USER = "waiting_user"  #: the model answered without tool calls; the user is next
    FAILED = "failed"  #: the run ended the session FAILED (a model/tool error, max_rounds)
    CANCELLED = "cancelled"  #: the session was cancelled; the lease is released
    WAITING_MODEL = "waiting_model"  #: the model is down: nothing written, resumed after a back-off
    LOST = "lost"  #: the lease was lost mid-run: nothing more written
    INFRA_ERROR = "infra_error"  #: a database/broker fault: nothing written, the scan resumes it


def run_agent(session_id: int, epoch: int, deps: LoopDeps) -> RunOutcome:
    """Run the session's rounds as the holder of ``epoch``. Returns what happened
    (``RunOutcome``); on INFRA_ERROR nothing was written: the lease lapses and the scan
    resumes the session."""
    with infrastructure_boundary(log, "agent_run_infra_error", session_id=session_id) as fault, transaction() as s:
        new_epoch = take_session(
            s,
            session_id,
            expected_epoch=epoch,
            owner=deps.owner,
            lease_seconds=deps.lease_seconds,
            to_phase=Phase.RUNNING,
        )
        agent_type: str | None = None
        in_flight = first_view = None
        model_waiting = False
        if new_epoch is not None:  # a stale message (or a session deleted meanwhile) reads nothing more
            row = s.execute(_run_facts_stmt(), {"b_sid": session_id}).one()
            agent_type = row.agent_type
            model_waiting = row.model_outage_since is not None
            # The first round's view (or the round a crashed run journaled) is read in the
            # take's transaction (one trip fewer); the take is the epoch's fence there.
            in_flight = resume_in(s, session_id, new_epoch)
            if in_flight is None:
                compaction = Compaction(row.compaction_boundary_message_id, row.compaction_summary)
                first_view = model_messages(session_id, get_agent(agent_type), s, compaction)
    if fault:
        return RunOutcome.INFRA_ERROR
    if new_epoch is None or agent_type is None:
        log_event(log, "agent_run_skipped", session_id=session_id, epoch=epoch, reason="stale")
        return RunOutcome.STALE
    crash_point("parent.after_resume")
    publish_status(session_id, Phase.RUNNING)
    fence = SessionFence(session_id, new_epoch, deps.lease_seconds)
    agent = get_agent(agent_type)
    allowed = agent.tool_names(tool_names(), subagent=False)
    try:
        # NOTE: an infrastructure fault is never a result: the lease lapses and the scan
        # resumes the session (R18). The boundary stops it before the handlers below.
        with Heartbeat(fence), infrastructure_boundary(log, "agent_run_infra_error", session_id=session_id):
            return _parent_rounds(
                session_id, fence, agent, allowed, deps, first_view, in_flight, model_waiting=model_waiting
            )
        return RunOutcome.INFRA_ERROR
    except LeaseLost:
        log_event(log, "agent_run_lost", session_id=session_id, epoch=new_epoch)
        return RunOutcome.LOST
    except Cancelled:
        _release(fence, None)
        return RunOutcome.CANCELLED
    except Exception as exc:
        if isinstance(exc, ModelUnavailable) and exc.transient:
            with infrastructure_boundary(log, "agent_run_infra_error", session_id=session_id) as fault:
                waiting = wait_for_model(fence, session_id)
            if fault:
                return RunOutcome.INFRA_ERROR
            if waiting:
                return RunOutcome.WAITING_MODEL
        log_event(
            log, "agent_run_failed", logging.WARNING, exc_info=True, session_id=session_id, error=type(exc).__name__
        )
        _release(fence, Phase.FAILED)
        return RunOutcome.FAILED


@built_once
def _run_facts_stmt() -> Any:
    S = AgentSession
    return select(S.agent_type, S.compaction_boundary_message_id, S.compaction_summary, S.model_outage_since).where(
        S.id == bindparam("b_sid")
    )


def _release(fence: Fence, phase: Phase | None) -> None:
    with transaction() as s:
        release_session(s, fence.session_id, epoch=fence.epoch, to_phase=phase)
    if phase is not None:
        publish_status(fence.session_id, phase)


def _parent_rounds(
    session_id: int,
    fence: SessionFence,
    agent: AgentDef,
    allowed: tuple[str, ...],
    deps: LoopDeps,
    view: list[dict[str, Any]] | None = None,
    in_flight: RoundInFlight | None = None,
    *,
    model_waiting: bool = False,
) -> RunOutcome:
    for _ in range(agent.max_rounds):
        fence.raise_if_stopped()
        if in_flight is not None:
            rnd, in_flight = in_flight, None  # continued from the journal: no model call
        else:
            reply = ask(deps, view or model_messages(session_id, agent), allowed, None, agent.model_options)
            view = None
            if model_waiting:
                model_answered(session_id)
                model_waiting = False
            if not reply.tool_calls:
                with transaction() as s:
                    # The release is the fence (one statement); when it does not land the
                    # fence says why (Cancelled or LeaseLost) and the answer rolls back.
                    if not end_run(s, session_id, epoch=fence.epoch, to_phase=Phase.WAITING_USER):
                        fence.check(s)
                        raise LeaseLost(f"session {session_id}: epoch {fence.epoch} could not end its run")
                    append_message(s, session_id, Role.ASSISTANT, reply.content or "")
                publish_status(session_id, Phase.WAITING_USER)
                return RunOutcome.WAITING_USER
            if _delegates(reply, allowed, {}):
                # NOTE: a delegating reply's journal entry is its pending round, committed with
                # its children before any of its tools (children or inline ones) runs: no
                # journal transaction of its own (issue 19). It is journaled only when none of
                # its delegations creates a child and it becomes an ordinary round.
                rnd = RoundInFlight(None, reply)
            else:
                rnd = journal_reply(fence, session_id, reply, lambda s, r: _unique_call_ids_in(s, session_id, r))
        if _delegates(rnd.reply, allowed, rnd.refused):
            if _delegating_round(session_id, fence, rnd, allowed, deps):
                return RunOutcome.YIELDED
            continue
        inline_round(fence, session_id=session_id, rnd=rnd, allowed=allowed, deadline=None, kind="parent")
    with transaction() as s:
        fence.check(s)
        append_message(s, session_id, Role.ASSISTANT, f"stopped: reached max_rounds={agent.max_rounds}")
        release_session(s, session_id, epoch=fence.epoch, to_phase=Phase.FAILED)
    publish_status(session_id, Phase.FAILED)
    return RunOutcome.FAILED


def _used_ids(s: Session, session_id: int, ids: list[str]) -> set[str]:
    """The ids among ``ids`` this session has used already (a delegation's or a TOOL's), in
    one statement."""
    E = SubagentExecution
    delegated = select(E.parent_tool_call_id.label("id")).where(
        E.parent_session_id == session_id, E.parent_tool_call_id.in_(ids)
    )
    answered = select(Message.tool_call_id.label("id")).where(
        Message.session_id == session_id,
        Message.role == Role.TOOL,
        Message.deleted.is_(False),
        Message.tool_call_id.in_(ids),
    )
    return {str(i) for i in s.execute(union(delegated, answered)).scalars() if i is not None}


def unique_call_ids(session_id: int, reply: ModelReply) -> tuple[ModelReply, dict[str, str]]:
    """Give every repeated tool_call id a fresh one and refuse that call (its TOOL error).
    The history stays legal (one TOOL per id) and the unique index never fires."""
    with transaction() as s:
        return _unique_call_ids_in(s, session_id, reply)


def _unique_call_ids_in(s: Session, session_id: int, reply: ModelReply) -> tuple[ModelReply, dict[str, str]]:
    used = _used_ids(s, session_id, [c.id for c in reply.tool_calls])
    seen: set[str] = set()
    calls: list[ToolCall] = []
    refused: dict[str, str] = {}
    for call in reply.tool_calls:
        if call.id in used or call.id in seen:
            fresh = f"{call.id[:80]}-dup-{uuid.uuid4().hex[:8]}"
            refused[fresh] = f"error: the model repeated tool_call id {call.id[:80]!r}; the call was not run"
            log_event(log, "duplicate_tool_call_id", logging.WARNING, session_id=session_id, tool=call.name)
            calls.append(ToolCall(fresh, call.name, call.arguments))
        else:
            seen.add(call.id)
            calls.append(call)
    if not refused:
        return reply, refused
    return ModelReply(reply.content, tuple(calls), reply.prompt_tokens, reply.completion_tokens), refused


def _delegates(reply: ModelReply, allowed: tuple[str, ...], refused: dict[str, str]) -> bool:
    """True when the reply asks for a delegation this agent may make (not refused already)."""
    return any(c.name in DELEGATION_TOOLS and c.name in allowed and c.id not in refused for c in reply.tool_calls)


class _NothingCreated(Exception):
    """Raised inside the creation transaction when no delegation of the round created a child,
    to roll that whole transaction back (the pending round, the fence's token counters); caught
    by ``_delegating_round``, which then commits the round as an ordinary one with the refusals
    as TOOL results. Control flow, not an error.

    NOTE: not a savepoint. The round's other (inline) tools must run outside any transaction,
    and the ordinary round's commit counts the reply's tokens itself: keeping the outer
    transaction's fence check would count them twice."""

    def __init__(self, rnd: RoundInFlight, errors: dict[str, str]) -> None:
        self.rnd = rnd  #: the round as the transaction saw it (tool_call ids made unique)
        self.errors = errors  #: tool_call_id -> TOOL error of every refused call


@dataclass(frozen=True)
class _Created:
    """What the creation transaction committed: the pending round, its children, and the
    round's inline calls still to run (the refused ones are already its TOOL errors)."""

    round_id: int
    executions: tuple[CreatedExecution, ...]
    inline: tuple[ToolCall, ...]


def _create_round(
    s: Session, session_id: int, fence: SessionFence, rnd: RoundInFlight, *, allowed: tuple[str, ...], deps: LoopDeps
) -> _Created:
    """ONE transaction: the pending round, a child session + execution + instruction per
    delegation (each in its own savepoint: a refused one becomes its TOOL error), the journal
    entry closed; released at once when nothing runs inline. Raises ``_NothingCreated``.

    A fresh reply (not journaled: ``journal_id`` None) has its tool_call ids made unique here,
    in the transaction that commits it."""
    fence.check(s, prompt_tokens=rnd.reply.prompt_tokens, completion_tokens=rnd.reply.completion_tokens)
    if rnd.journal_id is None:
        unique, refusals = _unique_call_ids_in(s, session_id, rnd.reply)
        rnd = replace(rnd, reply=unique, refused={**rnd.refused, **refusals})
    reply, refused = rnd.reply, rnd.refused
    parent = parent_of(s, session_id)
    round_row = PendingRound(
        session_id=session_id,
        assistant_content=reply.content,
        tool_calls=[c.to_openai() for c in reply.tool_calls],
        inline_results={},
        prompt_tokens=reply.prompt_tokens,
        completion_tokens=reply.completion_tokens,
    )
    s.add(round_row)
    s.flush()
    errors: dict[str, str] = dict(refused)
    created: list[CreatedExecution] = []
    for call in reply.tool_calls:
        if call.name not in DELEGATION_TOOLS or call.name not in allowed or call.id in refused:
            continue
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
        raise _NothingCreated(rnd, errors)
    close_in(s, rnd)
    round_row.inline_results = errors
    children = {c.tool_call_id for c in created}
    inline = tuple(
        c for c in reply.tool_calls if c.id not in children and c.id not in errors and c.name not in DELEGATION_TOOLS
    )
    if not inline:
        # Nothing runs between the round and the yield: release in the same transaction.
        release_session(s, session_id, epoch=fence.epoch)
    return _Created(round_row.id, tuple(created), inline)


def _delegating_round(
    session_id: int,
    fence: SessionFence,
    rnd: RoundInFlight,
    allowed: tuple[str, ...],
    deps: LoopDeps,
) -> bool:
    """Returns True when the loop yielded to its children, False when no child was created
    (every delegation was refused: the round was committed whole with the errors). The
    transaction that creates the children closes the round's journal entry: a journaled
    delegating reply creates its children once."""
    try:
        with transaction() as s:
            made = _create_round(s, session_id, fence, rnd, allowed=allowed, deps=deps)
    except _NothingCreated as nothing:
        # No child: an ordinary round whose delegation results are the refusals.
        refused = {**nothing.rnd.refused, **nothing.errors}
        if nothing.rnd.journal_id is None:  # journaled now, before its inline tools run
            rnd = journal_reply(fence, session_id, nothing.rnd.reply, lambda s, r: (r, refused))
        else:
            rnd = replace(nothing.rnd, refused=refused)
        inline_round(fence, session_id=session_id, rnd=rnd, allowed=allowed, deadline=None, kind="parent")
        return False
    if rnd.journal_id is None:
        crash_point("journal.after_reply")  # the reply is committed (as its pending round)
    crash_point("delegate.after_create")
    log_event(
        log,
        "delegation_round",
        session_id=session_id,
        round_id=made.round_id,
        execution_ids=[c.execution_id for c in made.executions],
    )
    for call in made.inline:
        ctx = ToolContext(session_id, call.id, None, fence.should_stop, "parent")
        result = run_inline(call.name, call.arguments, ctx, allowed)
        _record_inline(fence, made.round_id, call.id, result)
        crash_point("parent.mid_inline")
    crash_point("parent.before_yield")
    if made.inline:
        with transaction() as s:
            # Release as the epoch's owner; the epoch itself stays: deliver_round is handed it.
            fence.check(s)
            release_session(s, session_id, epoch=fence.epoch)
    try:
        deps.scheduler.start_children(session_id, fence.epoch, [Handed(c.execution_id, 0) for c in made.executions])
    except Exception as exc:
        # NOTE: the broker is down longer than its publish retries. Everything is committed:
        # the executions' creation reservations lapse and the scan starts them (DESIGN §6).
        log_event(log, "children_handoff_failed", logging.WARNING, session_id=session_id, error=type(exc).__name__)
    return True


def _record_inline(fence: SessionFence, round_id: int, call_id: str, result: str) -> None:
    with transaction() as s:
        fence.check(s)
        row = s.execute(select(PendingRound).where(PendingRound.id == round_id).with_for_update()).scalar_one()
        row.inline_results = {**row.inline_results, call_id: result}
