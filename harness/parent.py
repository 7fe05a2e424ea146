"""The parent (NORMAL / SIDE_TASK) loop (docs/tasks.md, "The normal path").

- A round without delegates commits one ASSISTANT + every TOOL in one transaction.
- A round with delegates commits pending_round + child sessions + executions + child USER
  messages in one transaction, runs the inline tools (recording each result in the round),
  then YIELDS: the lease is released (the epoch stays: deliver_round is handed it) and the
  scheduler enqueues one run_child per child (the last to end delivers). No worker slot waits
  for a child.
- A broker error at that hand-off is not the parent's failure: everything the recovery needs
  is committed, the executions' creation reservations lapse and the scan starts them.
- A reply with a call that needs approval (a delegation too) is journaled with its requests;
  a delegating one waits in WAITING_APPROVAL before any child exists, then creates the
  approved delegations' children and gives a denied one its denial as its TOOL result.
- Each inline call of a delegating round starts only after its start is committed under the
  parent's fence: a parent that lost its lease starts nothing (docs/exactly-once.md).
- A cancel lands between rounds, inside ``wait``, and in the fence of every write: a
  cancelled parent writes nothing more (it neither commits a round nor creates children).
- Every call gets its local id when its reply is first committed (harness.callids): a
  provider id seen in an earlier round is a new call; one repeated inside a reply is refused
  as that call's TOOL error, as in a child. It never kills the loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness import arguments
from harness.agents import DELEGATION_TOOLS, AgentDef
from harness.approval import AwaitingApproval, Gate, ParkOutcome, call_id_of, park, verdict
from harness.budget_request import AskOutcome, ask_for_budget
from harness.callids import context_for, localize
from harness.delegate import CreatedExecution, create_execution, parent_of
from harness.errors import BudgetExhausted, Cancelled, MaxRoundsReached, ModelUnavailable, infrastructure_boundary
from harness.events import publish_status
from harness.failure import incomplete_reason, reason_for
from harness.fence import Fence, Heartbeat, SessionFence
from harness.history import Compaction, append_message
from harness.journal import RoundInFlight, close_in, journal_reply, resume, resume_in
from harness.loop import LoopDeps, ask, inline_round, model_messages
from harness.model import ModelReply, ToolCall
from harness.outage import model_answered, wait_for_model
from harness.release import (
    ReleaseWait,
    at_boundary,
    latest_release,
    offered_tools,
    release_needed,
    session_agent,
    session_release,
    wait_for_worker,
)
from harness.scheduler import Handed
from harness.tools import run_inline
from harness.usage import append_reply, record_call
from logfmt import log_event
from models import LeaseLost, PendingRound, Phase, Role, transaction
from models.budget import charge_estimated
from models.journal import JOURNAL_OPEN
from models.release import release_found, target_of
from models.round import record_inline, start_inline
from models.session import FailureReason, end_run, release_session, take_session_facts

log = logging.getLogger(__name__)


class RunOutcome(StrEnum):
    """How one ``run_agent`` (task ``agent.run``) ended."""

    STALE = "stale"  #: a newer owner holds the session (or it is not runnable): nothing done
    YIELDED = "yielded"  #: children were created; the lease is released until their delivery
    WAITING_USER = "waiting_user"  #: the model answered without tool calls; the user is next
    WAITING_APPROVAL = "waiting_approval"  #: a tool call waits for a human decision; the lease is released
    FAILED = "failed"  #: the run ended the session FAILED (a model/tool error, max_rounds)
    CANCELLED = "cancelled"  #: the session was cancelled; the lease is released
    WAITING_MODEL = "waiting_model"  #: the model is down: nothing written, resumed after a back-off
    #: the session's release is newer than this worker's, whose tools it lacks: nothing run, its
    #: lease lapses after a back-off and the scan resumes it (docs/releases.md)
    WAITING_RELEASE = "waiting_release"
    LOST = "lost"  #: the lease was lost mid-run: nothing more written
    INFRA_ERROR = "infra_error"  #: a database/broker fault: nothing written, the scan resumes it


def run_agent(session_id: int, epoch: int, deps: LoopDeps) -> RunOutcome:
    """Run the session's rounds as the holder of ``epoch``. Returns what happened
    (``RunOutcome``); on INFRA_ERROR nothing was written: the lease lapses and the scan
    resumes the session."""
    with infrastructure_boundary(log, "agent_run_infra_error", session_id=session_id) as fault, transaction() as s:
        # The take returns the run's facts (one statement).
        row = take_session_facts(
            s,
            session_id,
            expected_epoch=epoch,
            owner=deps.owner,
            lease_seconds=deps.lease_seconds,
            to_phase=Phase.RUNNING,
            facts=RUN_FACTS,
        )
        new_epoch = None if row is None else int(row.epoch)
        agent_type: str | None = None
        budget_root_id: int | None = None
        agent: AgentDef | None = None
        in_flight = first_view = None
        model_waiting = False
        latest: int | None = None
        waited: ReleaseWait | None = None
        if new_epoch is not None:  # a stale message (or a session deleted meanwhile) reads nothing more
            agent_type = row.agent_type
            budget_root_id = row.budget_root_id
            if budget_root_id is not None and row.held_tokens:
                # The previous run died with a model call in flight: charged as estimated.
                charge_estimated(
                    s, session_id=session_id, execution_id=None, root_session_id=budget_root_id, held=row.held_tokens
                )
            # The session's release's definition (docs/releases.md), read in the take's transaction.
            agent = session_agent(s, agent_type, row.release_id or session_release(s, session_id, new_epoch))
            latest = latest_release(s)
            if not row.journal_open:  # a round boundary: no statement unless a move is due
                target = row.release_target_id
                moved = at_boundary(s, session_id, epoch=new_epoch, agent=agent, latest=latest, target=target)
                agent = moved or agent
            needed = release_needed(s, agent)
            if needed is not None:
                waited = wait_for_worker(
                    s, session_id, epoch=new_epoch, release_id=needed, since=row.release_wait_since
                )
        if waited is None and new_epoch is not None and agent is not None:
            if row.release_wait_since is not None:
                release_found(s, session_id, epoch=new_epoch)
            model_waiting = row.model_outage_since is not None
            # The first round's view (or the round a crashed run journaled) is read in the
            # take's transaction (one trip fewer); the take is the epoch's fence there. The
            # take says whether an entry is open (JOURNAL_OPEN): with none, nothing to read.
            in_flight = resume_in(s, session_id, new_epoch) if row.journal_open else None
            if in_flight is None:
                compaction = Compaction(row.compaction_boundary_message_id, row.compaction_summary)
                first_view = model_messages(session_id, agent, s=s, compaction=compaction)
    if fault:
        return RunOutcome.INFRA_ERROR
    if waited is not None:
        return _left_for_release(session_id, waited)
    if new_epoch is None or agent_type is None or agent is None:
        log_event(log, "agent_run_skipped", session_id=session_id, epoch=epoch, reason="stale")
        return RunOutcome.STALE
    crash_point("parent.after_resume")
    publish_status(session_id, Phase.RUNNING)
    fence = SessionFence(session_id, new_epoch, deps.lease_seconds)
    allowed = offered_tools(agent, subagent=False)
    try:
        # NOTE: an infrastructure fault is never a result: the lease lapses and the scan
        # resumes the session (R18). The boundary stops it before the handlers below.
        with Heartbeat(fence), infrastructure_boundary(log, "agent_run_infra_error", session_id=session_id):
            return _parent_rounds(
                session_id,
                fence,
                agent=agent,
                allowed=allowed,
                deps=deps,
                view=first_view,
                in_flight=in_flight,
                model_waiting=model_waiting,
                budget_root_id=budget_root_id,
                latest=latest,
            )
        return RunOutcome.INFRA_ERROR
    except _LeftForRelease as left:
        return _left_for_release(session_id, left.waited)
    except LeaseLost:
        log_event(log, "agent_run_lost", session_id=session_id, epoch=new_epoch)
        return RunOutcome.LOST
    except Cancelled:
        _release(fence, None)
        return RunOutcome.CANCELLED
    except BudgetExhausted as exc:
        # Refused before the model was asked: no round is open, the answer says why it stopped
        # (or, when the agent asks, the session waits for a person to raise the budget).
        try:
            with infrastructure_boundary(log, "agent_run_infra_error", session_id=session_id):
                if agent.on_budget_exhausted == "ask":
                    asked = ask_for_budget(fence, session_id=session_id, agent_type=agent_type, needs=exc.needs)
                    if asked == AskOutcome.PARKED:
                        return RunOutcome.WAITING_APPROVAL
                    said = asked.stopped(str(exc)) if asked == AskOutcome.REFUSED else str(exc)
                    return _stop(fence, f"stopped: {said}", reason_for(exc))
                return _stop(fence, f"stopped: {exc}", reason_for(exc))
            return RunOutcome.INFRA_ERROR
        except (LeaseLost, Cancelled):
            return RunOutcome.LOST  # a newer owner or a cancel: nothing written
    except Exception as exc:
        if isinstance(exc, ModelUnavailable) and exc.transient:
            with infrastructure_boundary(log, "agent_run_infra_error", session_id=session_id) as fault:
                waiting = wait_for_model(fence, session_id, retry_after_seconds=exc.retry_after_seconds)
            if fault:
                return RunOutcome.INFRA_ERROR
            if waiting:
                return RunOutcome.WAITING_MODEL
        log_event(
            log, "agent_run_failed", logging.WARNING, exc_info=True, session_id=session_id, error=type(exc).__name__
        )
        _release(fence, Phase.FAILED, reason_for(exc))
        return RunOutcome.FAILED


class _LeftForRelease(Exception):
    """Raised between two rounds when the session moved to a release this worker must leave to a
    worker of it; caught by ``run_agent``. Control flow, not an error."""

    def __init__(self, waited: ReleaseWait) -> None:
        self.waited = waited


def _left_for_release(session_id: int, waited: ReleaseWait) -> RunOutcome:
    if waited == ReleaseWait.GAVE_UP:
        publish_status(session_id, Phase.FAILED)
        return RunOutcome.FAILED
    if waited == ReleaseWait.LOST:
        return RunOutcome.STALE
    return RunOutcome.WAITING_RELEASE


#: What a run reads of its session, returned by its take.
RUN_FACTS = (
    "agent_type",
    "release_id",
    "release_target_id",
    "release_wait_since",
    "compaction_boundary_message_id",
    "compaction_summary",
    "model_outage_since",
    "budget_root_id",
    "held_tokens",
    JOURNAL_OPEN,
)


def _release(fence: Fence, phase: Phase | None, reason: FailureReason | None = None) -> None:
    with transaction() as s:
        release_session(s, fence.session_id, epoch=fence.epoch, to_phase=phase, reason=reason)
    if phase is not None:
        publish_status(fence.session_id, phase)


def _parent_rounds(
    session_id: int,
    fence: SessionFence,
    *,
    agent: AgentDef,
    allowed: tuple[str, ...],
    deps: LoopDeps,
    view: list[dict[str, Any]] | None = None,
    in_flight: RoundInFlight | None = None,
    model_waiting: bool = False,
    budget_root_id: int | None = None,
    latest: int | None = None,
) -> RunOutcome:
    gate = Gate(agent)
    for _ in range(agent.max_rounds):
        fence.raise_if_stopped()
        if in_flight is not None:
            rnd, in_flight = in_flight, None  # continued from the journal: no model call
        else:
            if view is None:  # a round boundary inside the run (the take decided the first one)
                moved = _between_rounds(session_id, fence, agent, latest)
                if moved is not None:
                    agent, allowed, gate = moved, offered_tools(moved, subagent=False), Gate(moved)
            messages = view or model_messages(session_id, agent)
            arguments.check(messages)  # the model is not asked again past a tool's max_retries
            reply = ask(
                deps,
                messages,
                tools=allowed,
                deadline=None,
                options=agent.model_options,
                budget_root_id=budget_root_id,
                session_id=session_id,
            )
            view = None
            if model_waiting:
                model_answered(session_id)
                model_waiting = False
            if not reply.tool_calls:
                return _final_answer(session_id, fence, agent, reply)
            if _delegates(reply, allowed, {}) and not gate.calls(reply, {}, session_id=session_id):
                # NOTE: a delegating reply's journal entry is its pending round, committed with
                # its children before any of its tools (children or inline ones) runs: no
                # journal transaction of its own (one commit fewer). It is journaled only when a
                # call of it needs approval (its requests are written with it: harness.approval),
                # or when none of its delegations creates a child and it becomes an ordinary round.
                unique, refusals = localize(reply, session_id=session_id)
                rnd = RoundInFlight(None, unique, refusals)
            else:
                rnd = journal_reply(fence, session_id, reply, approval=gate)
        try:
            if _delegates(rnd.reply, allowed, rnd.refused):
                if _delegating_round(session_id, fence, rnd, allowed=allowed, deps=deps, gate=gate):
                    return RunOutcome.YIELDED
                continue
            inline_round(
                fence, session_id=session_id, rnd=rnd, allowed=allowed, deadline=None, kind="parent", approval=gate
            )
        except AwaitingApproval as waiting:
            if (
                park(fence, session_id=session_id, journal_id=waiting.journal_id, execution_id=None)
                == ParkOutcome.PARKED
            ):
                return RunOutcome.WAITING_APPROVAL
            in_flight = resume(fence, session_id)  # answered meanwhile: the round goes on
    reason = reason_for(MaxRoundsReached(f"reached max_rounds={agent.max_rounds} without a final answer"))
    return _stop(fence, f"stopped: reached max_rounds={agent.max_rounds}", reason)


def _stop(fence: SessionFence, answer: str, reason: FailureReason) -> RunOutcome:
    """End the run FAILED with ``answer`` as the parent's last ASSISTANT message (the user reads
    why it stopped), in one transaction under the fence."""
    with transaction() as s:
        fence.check(s)
        append_message(s, fence.session_id, Role.ASSISTANT, answer)
        release_session(s, fence.session_id, epoch=fence.epoch, to_phase=Phase.FAILED, reason=reason)
    publish_status(fence.session_id, Phase.FAILED)
    return RunOutcome.FAILED


def _between_rounds(session_id: int, fence: SessionFence, agent: AgentDef, latest: int | None) -> AgentDef | None:
    """A move of the session's tree at this round boundary (``at_boundary``): the new release's
    agent, or None when nothing moved. Raises ``_LeftForRelease`` when the new release needs a
    worker of it."""
    if agent.release_id is None:
        return None
    waited = None
    with transaction() as s:
        target = target_of(s, session_id)
        moved = at_boundary(s, session_id, epoch=fence.epoch, agent=agent, latest=latest, target=target)
        needed = None if moved is None else release_needed(s, moved)
        if needed is not None:
            waited = wait_for_worker(s, session_id, epoch=fence.epoch, release_id=needed, since=None)
    if waited is not None:
        raise _LeftForRelease(waited)  # the move and the wait are committed
    if moved is not None:
        crash_point("release.after_move")
    return moved


def _final_answer(session_id: int, fence: SessionFence, agent: AgentDef, reply: ModelReply) -> RunOutcome:
    """Store the model's answer and end the run: the user is next. An answer the model did not
    finish is stored as it came (a refusal's text as its content) and marked; with the agent's
    ``on_incomplete = "fail"`` the session ends FAILED with the reason instead."""
    mark = reason = None
    if reply.incomplete is not None:
        reason = incomplete_reason(reply.incomplete)
        mark = reason.code
    fail = reason is not None and agent.on_incomplete == "fail"
    phase = Phase.FAILED if fail else Phase.WAITING_USER
    with transaction() as s:
        # The release is the fence (one statement); when it does not land the fence says why
        # (Cancelled or LeaseLost) and the answer rolls back.
        if not end_run(s, session_id, epoch=fence.epoch, to_phase=phase, reason=reason if fail else None):
            fence.check(s)
            raise LeaseLost(f"session {session_id}: epoch {fence.epoch} could not end its run")
        content = reply.content or reply.refusal or ""
        # The answer and its usage row: one statement (harness.usage.append_reply).
        incomplete = None if mark is None else str(mark)
        append_reply(s, session_id, reply, content, provider_fields=reply.provider_fields, incomplete=incomplete)
    if mark is not None:
        log_event(log, "parent_answer_incomplete", session_id=session_id, mark=str(mark), failed=fail)
    publish_status(session_id, phase)
    return RunOutcome.FAILED if fail else RunOutcome.WAITING_USER


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
    #: tool_call_id -> TOOL error of each refused call, written with the round.
    refused: dict[str, str]


#: tool_call_id -> the arguments an approved call runs (or creates its child) with.
Approved = dict[str, str]


def _answered(fence: SessionFence, session_id: int, rnd: RoundInFlight, gate: Gate) -> tuple[RoundInFlight, Approved]:
    """Answer the round's calls that need approval, before any child of it exists: a denied,
    expired or cancelled call (a delegation too) gets its denial as its TOOL result (added to
    ``refused``: it never runs, no child is created for it); an approved one runs (or creates
    its child) with the arguments the approval stands for. Raises ``AwaitingApproval`` while a
    request is PENDING: the loop parks, and the round is continued from its journal entry once
    every request is answered (docs/approvals.md, "Delegations that need approval")."""
    runnable = [c for c in rnd.reply.tool_calls if c.id not in rnd.refused and c.id not in rnd.results]
    gated = gate.gated(
        fence, session_id=session_id, journal_id=rnd.journal_id, runnable=runnable, replayed=rnd.replayed
    )
    if not gated or rnd.journal_id is None:
        return rnd, {}
    refused, approved, waiting = dict(rnd.refused), {}, []
    for call in rnd.reply.tool_calls:
        if call_id_of(call) not in gated or call.id in refused:
            continue
        answer = verdict(fence, session_id, call)
        if answer.waits:
            waiting.append(call.id)
        elif answer.result is not None:
            refused[call.id] = answer.result
        else:
            approved[call.id] = answer.arguments or call.arguments
    if waiting:
        raise AwaitingApproval(rnd.journal_id, waiting)
    return replace(rnd, refused=refused), approved


def _create_round(
    s: Session,
    session_id: int,
    fence: SessionFence,
    rnd: RoundInFlight,
    *,
    allowed: tuple[str, ...],
    deps: LoopDeps,
    approved: Approved,
    release_id: int | None,
    child_cap: int | None = None,
) -> _Created:
    """ONE transaction: the pending round, a child session + execution + instruction per
    delegation (each in its own savepoint: a refused one becomes its TOOL error), the journal
    entry closed; released at once when nothing runs inline. Raises ``_NothingCreated``.

    A fresh reply (not journaled: ``journal_id`` None) gets its local call ids here: the
    transaction that commits it is its journal."""
    fence.check(s, prompt_tokens=rnd.reply.prompt_tokens, completion_tokens=rnd.reply.completion_tokens)
    if rnd.journal_id is None:
        unique, refusals = localize(rnd.reply, session_id=session_id)
        rnd = replace(rnd, reply=unique, refused={**rnd.refused, **refusals})
        record_call(s, session_id, rnd.reply)  # a fresh reply: this transaction stores it
    reply, refused = rnd.reply, rnd.refused
    parent = parent_of(s, session_id, release_id=release_id, child_cap=child_cap)
    round_row = PendingRound(
        session_id=session_id,
        assistant_content=reply.content,
        tool_calls=[c.to_openai() for c in reply.tool_calls],
        inline_results={},
        provider_fields=reply.provider_fields or None,
        inline_started=[],
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
            raw_arguments=approved.get(call.id, call.arguments),
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
    return _Created(round_row.id, tuple(created), inline, errors)


def _delegating_round(
    session_id: int,
    fence: SessionFence,
    rnd: RoundInFlight,
    *,
    allowed: tuple[str, ...],
    deps: LoopDeps,
    gate: Gate,
) -> bool:
    """Returns True when the loop yielded to its children, False when no child was created
    (every delegation was refused or denied: the round was committed whole with the errors).
    The transaction that creates the children closes the round's journal entry: a journaled
    delegating reply creates its children once. Raises ``AwaitingApproval`` while a call of the
    round waits for a decision (nothing is created before every request is answered)."""
    rnd, approved = _answered(fence, session_id, rnd, gate)
    try:
        with transaction() as s:
            made = _create_round(
                s,
                session_id,
                fence,
                rnd,
                allowed=allowed,
                deps=deps,
                approved=approved,
                child_cap=gate.agent.child_budget_tokens,
                release_id=gate.agent.release_id,
            )
    except _NothingCreated as nothing:
        # No child: an ordinary round whose delegation results are the refusals.
        refused = {**nothing.rnd.refused, **nothing.errors}
        if nothing.rnd.journal_id is None:  # journaled now, before its inline tools run
            rnd = journal_reply(fence, session_id, nothing.rnd.reply, lambda s, r: (r, refused))
        else:
            rnd = replace(nothing.rnd, refused=refused)
        inline_round(
            fence, session_id=session_id, rnd=rnd, allowed=allowed, deadline=None, kind="parent", approval=gate
        )
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
    started: list[str] = []
    results = dict(made.refused)
    for call in made.inline:
        started.append(call.id)
        _start_inline(fence, made.round_id, started)
        crash_point("parent.after_inline_start")
        ctx = context_for(session_id, call, None, fence.should_stop, "parent")
        results[call.id] = run_inline(call.name, approved.get(call.id, call.arguments), ctx, allowed)
        _record_inline(fence, made.round_id, results)
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
        # the executions' creation reservations lapse and the scan starts them (docs/fault-model.md).
        log_event(log, "children_handoff_failed", logging.WARNING, session_id=session_id, error=type(exc).__name__)
    return True


def _start_inline(fence: SessionFence, round_id: int, started: list[str]) -> None:
    """Commit the start of the round's next inline call (the last of ``started``) under the
    parent's fence, before it runs. A parent that lost its lease (stopped past it, and taken over
    by the scan, which delivers the round without this call's result) raises LeaseLost here and
    starts nothing; delivery tells the model a call that never started did not run
    (docs/exactly-once.md, "Inline tools of a delegating round")."""
    with transaction() as s:
        fence.check(s)
        if not start_inline(s, round_id, started):
            # NOTE: under a fence that landed the round is open (a delivery or a suppression
            # needs the parent's row without this epoch's lease): closed means no longer ours.
            raise LeaseLost(f"pending round {round_id} is closed")


def _record_inline(fence: SessionFence, round_id: int, results: dict[str, str]) -> None:
    """Commit the round's inline results so far (the latest call's last) under the parent's
    fence. A round closed meanwhile is no longer this run's (as in ``_start_inline``): LeaseLost,
    nothing written."""
    with transaction() as s:
        fence.check(s)
        if not record_inline(s, round_id, results):
            raise LeaseLost(f"pending round {round_id} is closed")
