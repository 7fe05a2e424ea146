"""A human approves a tool call before it runs (models.approval holds the requests).

Which calls: a tool declared ``@tool(requires_approval=True)``, a tool whose name matches one of
the agent's ``approve`` globs (AGENTS_FILE), and with ``approve_destructive = true`` every MCP
tool whose ``destructiveHint`` is true or absent. Configuration only ever adds the need.

One round, in the order its commits happen:

1. the reply is journaled and, in the SAME transaction, a PENDING request is written for each
   call that needs approval (``Gate.record``);             crash point approval.after_request
2. the calls that need no approval run first, as usual (harness.journal);
3. each call that needs approval is answered from its request: APPROVED runs the tool (with
   the edited arguments when the approver gave some; at most once unless read-only or
   idempotent, as any tool); DENIED and EXPIRED are the TOOL result
   ``denied by NAME: REASON``; a request past its expiry is expired on the spot; a CANCELLED
   one (its session was cancelled) stops the loop: nothing more of the round runs;
4. if a request is still PENDING the loop parks (``park``): under the request rows' locks, the
   session goes to WAITING_APPROVAL (a child: its execution's lease dropped, its session
   WAITING_APPROVAL) and the loop returns: no lease, no worker slot, no process waits;
                                                            crash point approval.after_park
5. a decision (``decide``: the CLI, the Celery tasks ``agent.approve`` / ``agent.deny``, or an
   application's own endpoint) is a compare-and-set on the request and, in the same
   transaction, hands a parked session whose requests are all answered back to a loop (a new
   epoch and a reservation); then it enqueues the loop;   crash point approval.after_decision
6. the scan's backstop (recovery.scan) expires overdue requests, cancels those of stopped
   sessions, and hands back any parked session with nothing pending: a decision made while
   every worker was down, or a lost message, is acted on when a worker runs the scan.

Lock order everywhere: the request rows, then the session (or the execution, then its child
session). A decision that lands while the loop is still running its other calls finds the
session not parked; the loop's park then finds the request decided under the lock and goes on.
"""

from __future__ import annotations

import fnmatch
import json
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness.agents import AgentDef
from harness.errors import Cancelled
from harness.events import publish_status
from harness.fence import Fence
from harness.model import ModelReply, ToolCall
from harness.scheduler import Handed, Scheduler
from harness.tools import lookup
from harness.tools.registry import MCP_SEPARATOR
from logfmt import log_event
from models import Phase, SessionType, transaction
from models import approval as store
from models.approval import ApprovalRequest, ApprovalStatus, Decision, DecisionOutcome, NewRequest
from models.session import reservation_seconds
from settings import get_settings

log = logging.getLogger(__name__)


def call_id_of(call: ToolCall) -> str:
    """The call id an approval request, the CLI and the decision name: the journal entry's call
    id. The ONE place that reads it."""
    return call.id


def needs_approval(agent: AgentDef, name: str) -> bool:
    """True when a call of tool ``name`` by ``agent`` waits for a human decision. With
    ``approve_destructive``, an MCP tool whose annotations cannot be read now (its server
    cannot be listed) needs one: what is not known to be harmless is asked about."""
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in agent.approve):
        return True
    found = lookup(name)
    if found is None:
        server, sep, _ = name.partition(MCP_SEPARATOR)
        return bool(sep) and agent.approve_destructive and any(m.name == server for m in agent.mcp_servers)
    if found.requires_approval:
        return True
    return agent.approve_destructive and MCP_SEPARATOR in name and found.destructive is not False


def denied_result(by: str, reason: str) -> str:
    """The TOOL result the model sees for a denied, expired or cancelled request."""
    return f"denied by {by}: {reason}"


def edited_result(by: str, result: str) -> str:
    """The TOOL result of a call an approver ran with edited arguments: the model's call in the
    history is the approved one, and this says it is not the one the model sent."""
    return f"note: {by} edited the arguments of this call when approving it; it ran as shown.\n{result}"


class AwaitingApproval(Exception):
    """Raised by a round when a call's request is still PENDING after every other call ran; the
    loop parks its session. Control flow, not an error."""

    def __init__(self, journal_id: int, call_ids: list[str]) -> None:
        super().__init__(f"round {journal_id} waits for approval of {len(call_ids)} call(s)")
        self.journal_id = journal_id
        self.call_ids = call_ids


@dataclass(frozen=True)
class Verdict:
    """How a call that needed approval is answered now: run it (with ``arguments``), write
    ``result`` instead, or wait (both None). ``edited_by``: the approver who edited the
    arguments (then ``arguments`` are theirs, and the call the model sees is that one)."""

    arguments: str | None = None
    result: str | None = None
    edited_by: str | None = None

    @property
    def waits(self) -> bool:
        return self.arguments is None and self.result is None


@dataclass(frozen=True)
class Gate:
    """The approval rules of one loop: its agent, and for a child its execution and absolute
    deadline (a child's request expires at its deadline at the latest)."""

    agent: AgentDef
    execution_id: int | None = None
    not_after: datetime | None = None

    def calls(self, reply: ModelReply, refused: dict[str, str]) -> list[NewRequest]:
        return [
            NewRequest(call_id_of(c), c.name, c.arguments)
            for c in reply.tool_calls
            if c.id not in refused and needs_approval(self.agent, c.name)
        ]

    def record(
        self, s: Session, *, session_id: int, journal_id: int, reply: ModelReply, refused: dict[str, str]
    ) -> int:
        """In the reply's journal transaction: a PENDING request per call that needs approval.
        Returns how many."""
        calls = self.calls(reply, refused)
        if calls:
            self._write(s, session_id=session_id, journal_id=journal_id, calls=calls)
        return len(calls)

    def _write(self, s: Session, *, session_id: int, journal_id: int, calls: Sequence[NewRequest | ToolCall]) -> None:
        requests = [c if isinstance(c, NewRequest) else NewRequest(call_id_of(c), c.name, c.arguments) for c in calls]
        store.record_requests(
            s,
            session_id=session_id,
            journal_id=journal_id,
            agent_type=self.agent.name,
            execution_id=self.execution_id,
            calls=requests,
            timeout_seconds=get_settings().APPROVAL_TIMEOUT_SECONDS,
            not_after=self.not_after,
        )
        for r in requests:
            log_event(log, "approval_requested", session_id=session_id, call_id=r.call_id, tool=r.tool)

    def gated(
        self, fence: Fence, *, session_id: int, journal_id: int | None, runnable: Sequence[ToolCall], replayed: bool
    ) -> set[str]:
        """The call ids of the round that wait for a decision: a call needs one when its journaled
        round asked for one OR the configuration in force now says so (a round journaled before
        a deploy that added the need is continued under the new rule). Of ``runnable`` (the
        calls that may still run: no result, not refused, not reported interrupted), one that
        the configuration needs now but that has no request gets it now, fenced, before any
        call of the round runs. One read, only when a call may need one: a ``replayed`` round,
        or a call that needs approval now."""
        if journal_id is None:
            return set()
        needed = [c for c in runnable if needs_approval(self.agent, c.name)]
        if not replayed and not needed:
            return set()
        with transaction() as s:
            asked = set(store.requests_of(s, journal_id))
            late = [c for c in needed if call_id_of(c) not in asked]
            if late:
                fence.check(s)
                self._write(s, session_id=session_id, journal_id=journal_id, calls=late)
        if late:
            crash_point("approval.after_request")
        return asked | {call_id_of(c) for c in late}


def order(calls: tuple[ToolCall, ...], gated: set[str]) -> list[ToolCall]:
    """The calls that need no approval first, then the gated ones, each in reply order."""
    return [c for c in calls if call_id_of(c) not in gated] + [c for c in calls if call_id_of(c) in gated]


def verdict(fence: Fence, session_id: int, call: ToolCall) -> Verdict:
    """Answer a gated call from its request, as the holder of the fence: an overdue request is
    expired first. A decision bound to other arguments or another tool is never used."""
    cid = call_id_of(call)
    with transaction() as s:
        store.close_stale(s, session_id=session_id, call_id=cid)
        fence.check(s)
        row = store.request_of(s, session_id, cid)
        if row is None:
            return Verdict(result=f"error: the approval request of the call to {call.name!r} is missing; not run")
        if row.status == ApprovalStatus.PENDING:
            return Verdict()
        if row.status == ApprovalStatus.CANCELLED:
            raise Cancelled(f"session {session_id} was cancelled")  # its loop stops: nothing more is run
        if row.tool != call.name or not store.same_arguments(row, call.arguments):
            return Verdict(result=f"error: the approval does not match the call to {call.name!r}; not run")
        if row.status == ApprovalStatus.APPROVED:
            if row.approved_arguments is not None:
                return Verdict(arguments=row.approved_arguments, edited_by=row.decided_by or store.SYSTEM)
            return Verdict(arguments=call.arguments)
        return Verdict(result=denied_result(row.decided_by or store.SYSTEM, row.reason or str(row.status).lower()))


class ParkOutcome(StrEnum):
    """What a loop's ``park`` ended in."""

    PARKED = "parked"  #: the session waits in WAITING_APPROVAL; the loop returns
    DECIDED = "decided"  #: every waiting request was answered meanwhile: the loop continues the round


def park(fence: Fence, *, session_id: int, journal_id: int, execution_id: int | None) -> ParkOutcome:
    """Park the loop's session (or its child execution) while a request of the round is still
    PENDING, under the request rows' locks (a decision takes them first: it either lands before,
    and the round goes on, or after, and finds the session parked)."""
    with transaction() as s:
        store.requests_of(s, journal_id, lock=True)
        store.close_stale(s, session_id=session_id)
        if store.session_cancelled(s, session_id):
            raise Cancelled(f"session {session_id} was cancelled")  # never parked, never continued
        waiting = [r for r in store.requests_of(s, journal_id).values() if r.status == ApprovalStatus.PENDING]
        if not waiting:
            return ParkOutcome.DECIDED
        fence.check(s)
        if execution_id is None:
            parked = store.park_session(s, session_id, epoch=fence.epoch)
        else:
            until = min(r.expires_at for r in waiting)
            parked = store.park_execution(s, execution_id, session_id, epoch=fence.epoch, until=until)
        if not parked:
            fence.check(s)  # says why: cancelled or lost
            raise RuntimeError(f"session {session_id} could not be parked at epoch {fence.epoch}")
    crash_point("approval.after_park")
    log_event(
        log, "approval_waiting", session_id=session_id, execution_id=execution_id, calls=[r.call_id for r in waiting]
    )
    publish_status(session_id, Phase.WAITING_APPROVAL)
    return ParkOutcome.PARKED


def after_child_parked(execution_id: int, child_session_id: int, epoch: int) -> None:
    """Once the parked child's heartbeat has stopped: its lease end is its earliest request's
    expiry again (``restate_parked_lease``). Only what ``status`` and the metrics count as work
    nobody picks up depends on it: a failure is logged, never raised."""
    try:
        with transaction() as s:
            store.restate_parked_lease(s, execution_id, child_session_id, epoch=epoch)
    except Exception:
        log_event(log, "approval_park_lease_not_restated", logging.WARNING, exc_info=True, execution_id=execution_id)


class DecisionRefused(Exception):
    """Raised when a decision cannot be recorded as given: edited arguments that are not a JSON
    object valid for the tool's schema, or edited arguments on a denial."""


@dataclass(frozen=True)
class DecisionResult:
    """What ``decide`` did: the outcome, the request as it stands, and whether the session was
    handed back to a loop."""

    outcome: DecisionOutcome
    request: ApprovalRequest | None
    resumed: bool = False

    def describe(self) -> str:
        r = self.request
        if r is None:
            return "no such approval request"
        stands = f"{r.status.lower()} by {r.decided_by or '-'}" + (f": {r.reason}" if r.reason else "")
        return {
            DecisionOutcome.DECIDED: f"{stands} (session {r.session_id}, call {r.call_id}, tool {r.tool})",
            DecisionOutcome.REPEATED: f"already {stands}: nothing done",
            DecisionOutcome.CONFLICT: f"refused: the decision that stands is {stands}",
            DecisionOutcome.NOT_FOUND: "no such approval request",
        }[self.outcome]


def validated_arguments(tool: str, arguments: str | dict[str, Any]) -> str:
    """Edited arguments (JSON text, or a dict from a Python caller or ``celery call``) as
    canonical JSON text (models.approval.canonical), valid for the tool's schema. Raises
    DecisionRefused."""
    import jsonschema  # only an approver's edited arguments need it: not imported at every worker's boot

    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            raise DecisionRefused("--arguments is not valid JSON") from None
    else:
        value = arguments
    if not isinstance(value, dict):
        raise DecisionRefused("--arguments must be a JSON object")
    found = lookup(tool)
    if found is None:
        raise DecisionRefused(f"tool {tool!r} is not known to this process: its schema cannot be checked")
    try:
        jsonschema.validate(value, found.parameters)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "arguments"
        raise DecisionRefused(f"--arguments do not match the schema of {tool!r} at {where}: {exc.validator}") from None
    return store.canonical(value)


def decide(session_id: int, call_id: str, decision: Decision, scheduler: Scheduler) -> DecisionResult:
    """Record a human's decision on one request (a compare-and-set: the first one wins) and, in
    the same transaction, hand the session back to a loop when nothing else of it is pending;
    then enqueue that loop. A lost message is harmless: the reservation lapses and the scan
    resumes the session. Raises DecisionRefused for invalid edited arguments."""
    if decision.arguments is not None and not decision.approve:
        raise DecisionRefused("edited arguments go with an approval only")
    with transaction() as s:
        row = store.request_of(s, session_id, call_id)
        if row is None:
            return DecisionResult(DecisionOutcome.NOT_FOUND, None)
        if decision.arguments is not None:
            edited: str | None = validated_arguments(row.tool, decision.arguments)
            if edited == store.canonical(row.arguments):
                edited = None  # the model's own arguments, in another key order: not an edit
            decision = Decision(True, decision.by, decision.reason, edited)
        outcome, row = store.decide(s, session_id, call_id, decision)
        handed = _hand_back(s, session_id) if outcome == DecisionOutcome.DECIDED else None
    if outcome == DecisionOutcome.DECIDED:
        log_event(
            log,
            "approval_decided",
            session_id=session_id,
            call_id=call_id,
            decision=decision.status,
            by=decision.by,
            edited=decision.arguments is not None,
        )
    crash_point("approval.after_decision")
    if handed is not None:
        _enqueue(scheduler, handed)
    return DecisionResult(outcome, row, resumed=handed is not None)


@dataclass(frozen=True)
class _Handed:
    session_id: int
    epoch: int
    parent_id: int | None = None  #: set for a child: ``epoch`` is its execution's
    execution_id: int | None = None


def _hand_back(s: Session, session_id: int) -> _Handed | None:
    """A parked session with nothing pending -> a loop's reservation (new epoch), in ``s``."""
    from models import AgentSession

    kind = s.get(AgentSession, session_id)
    if kind is None:
        return None
    seconds = reservation_seconds()
    if kind.session_type == SessionType.SUBAGENT:
        got = store.unpark_execution(s, session_id, reserve_seconds=seconds)
        return None if got is None else _Handed(session_id, got[2], parent_id=got[0], execution_id=got[1])
    epoch = store.unpark_session(s, session_id, reserve_seconds=seconds)
    return None if epoch is None else _Handed(session_id, epoch)


def _enqueue(scheduler: Scheduler, handed: _Handed) -> None:
    try:
        if handed.execution_id is not None and handed.parent_id is not None:
            scheduler.recover_many([(handed.parent_id, 0, [Handed(handed.execution_id, handed.epoch)])])
        else:
            scheduler.resume_parent(handed.session_id, handed.epoch)
    except Exception as exc:
        # NOTE: everything is committed; the reservation lapses and the scan resumes it.
        log_event(
            log, "approval_resume_not_enqueued", logging.WARNING, session_id=handed.session_id, error=type(exc).__name__
        )


def backstop(scheduler: Scheduler, first: Callable[[], AbstractContextManager[Session]] = transaction) -> list[int]:
    """The scan's step: expire overdue requests, cancel those of stopped sessions, and hand
    every parked session with nothing pending back to a loop. Returns the sessions handed back.
    Each session is handed back in its own transaction (one bad row never stops the rest).
    ``first``: the step's first transaction (the scan's checks its right to scan in it)."""
    with first() as s:
        store.close_stale(s)
        store.free_cancelled_parked(s)  # recovered by the same pass, ended CANCELLED
        ready = store.parked_ready(s)
    out: list[int] = []
    for session_id, _kind in ready:
        try:
            with transaction() as s:
                handed = _hand_back(s, session_id)
        except Exception:
            log_event(log, "approval_backstop_failed", logging.ERROR, exc_info=True, session_id=session_id)
            continue
        if handed is not None:
            log_event(log, "approval_resume", session_id=session_id, epoch=handed.epoch)
            _enqueue(scheduler, handed)
            out.append(session_id)
    return out
