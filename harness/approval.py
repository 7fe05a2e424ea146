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
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, cast

from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness.agents import AgentDef
from harness.approval_notify import announce
from harness.budget_request import BUDGET_TOOL, amounts_finite, raise_for
from harness.budget_request import SCHEMA as BUDGET_SCHEMA
from harness.errors import Cancelled
from harness.events import publish_status
from harness.fence import Fence
from harness.model import ModelReply, ToolCall
from harness.scheduler import Handed, Scheduler
from harness.tools import lookup
from harness.tools.registry import MCP_SEPARATOR, Tool
from logfmt import log_event
from models import Phase, SessionType, transaction
from models import approval as store
from models import journal as journal_store
from models.approval import ApprovalRequest, ApprovalStatus, Decision, DecisionOutcome, NewRequest, Requested
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


#: Who decided, as the model reads it when APPROVAL_NAME_TO_MODEL is false.
UNNAMED = "an approver"


def shown_to_model(by: str, *, named: bool | None = None) -> str:
    """The decider's name as the model reads it: the name itself only with
    APPROVAL_NAME_TO_MODEL (``named``), else ``an approver``; ``system`` (an expiry, a cancel)
    names no person and is shown as it is."""
    if named is None:
        named = get_settings().APPROVAL_NAME_TO_MODEL
    return by if named or by == store.SYSTEM else UNNAMED


def denied_result(by: str, reason: str, *, named: bool | None = None) -> str:
    """The TOOL result the model sees for a denied, expired or cancelled request."""
    return f"denied by {shown_to_model(by, named=named)}: {reason}"


def edited_result(by: str, result: str, *, named: bool | None = None) -> str:
    """The TOOL result of a call an approver ran with edited arguments: the model's call in the
    history is the approved one, and this says it is not the one the model sent."""
    who = shown_to_model(by, named=named)
    return f"note: {who} edited the arguments of this call when approving it; it ran as shown.\n{result}"


def rule_decision(found: Tool, arguments: str, *, session_id: int) -> bool:
    """What ``found``'s ``requires_approval`` callable decides for a call with ``arguments`` (the
    model's JSON text): True, a person approves it first. Fails closed: arguments that are not
    a JSON object, a callable that raises, and one that returns something other than a bool
    each mean True, logged with the tool and the error's type, never the arguments."""
    rule = found.approval_rule
    if rule is None:
        return False
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    failed = "arguments" if not isinstance(value, dict) else None
    decided: object = True
    if failed is None:
        try:
            decided = rule(cast("dict[str, Any]", value))
        except Exception as exc:
            failed = type(exc).__name__
        else:
            failed = None if isinstance(decided, bool) else "not_bool"
    if failed is not None:
        log_event(log, "approval_rule_failed", logging.WARNING, session_id=session_id, tool=found.name, error=failed)
        return True
    return bool(decided)


def _ruled(name: str) -> Tool | None:
    """The tool of that name when it has a ``requires_approval`` callable."""
    found = lookup(name)
    return found if found is not None and found.approval_rule is not None else None


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
    deadline (a child's request expires at its deadline at the latest). A tool's
    ``requires_approval`` callable is asked once per (tool, arguments) in this loop; what it
    decided is journaled with the reply, and a continued round reads that, never asks again."""

    agent: AgentDef
    execution_id: int | None = None
    not_after: datetime | None = None
    _asked: dict[tuple[str, str], bool] = field(default_factory=dict, compare=False, repr=False)

    def rules(self, reply: ModelReply, refused: dict[str, str], *, session_id: int = 0) -> dict[str, bool]:
        """call id -> what its tool's callable decides, for the reply's calls whose tool has one."""
        out: dict[str, bool] = {}
        for c in reply.tool_calls:
            found = _ruled(c.name) if c.id not in refused else None
            if found is not None:
                out[call_id_of(c)] = self._rule(found, c, session_id)
        return out

    def _rule(self, found: Tool, call: ToolCall, session_id: int) -> bool:
        key = (call.name, call.arguments)
        if key not in self._asked:
            self._asked[key] = rule_decision(found, call.arguments, session_id=session_id)
        return self._asked[key]

    def _needs(self, call: ToolCall, rules: dict[str, bool]) -> bool:
        return needs_approval(self.agent, call.name) or rules.get(call_id_of(call), False)

    def calls(
        self, reply: ModelReply, refused: dict[str, str], rules: dict[str, bool] | None = None, *, session_id: int = 0
    ) -> list[NewRequest]:
        """The reply's calls that need approval (``rules``: the callables' decisions, else asked now)."""
        if rules is None:
            rules = self.rules(reply, refused, session_id=session_id)
        return [self._request(c) for c in reply.tool_calls if c.id not in refused and self._needs(c, rules)]

    def timeout_seconds(self, tool: str) -> float:
        """How long a request for a call of ``tool`` waits: the agent's ``approval_timeout_seconds``
        entry (AGENTS_FILE) that matches first, else the tool's ``@tool(approval_timeout_seconds=)``,
        else APPROVAL_TIMEOUT_SECONDS."""
        for pattern, seconds in self.agent.approval_timeouts:
            if fnmatch.fnmatchcase(tool, pattern):
                return seconds
        found = lookup(tool)
        if found is not None and found.approval_timeout_seconds is not None:
            return found.approval_timeout_seconds
        return get_settings().APPROVAL_TIMEOUT_SECONDS

    def _request(self, c: ToolCall) -> NewRequest:
        return NewRequest(call_id_of(c), c.name, c.arguments, self.timeout_seconds(c.name))

    def record(
        self,
        s: Session,
        *,
        session_id: int,
        journal_id: int,
        reply: ModelReply,
        refused: dict[str, str],
        rules: dict[str, bool] | None = None,
    ) -> list[Requested]:
        """In the reply's journal transaction: a request per call that needs approval (``rules``:
        what the callables decided, journaled with the reply). Returns them as written."""
        calls = self.calls(reply, refused, rules)
        if not calls:
            return []
        return self._write(s, session_id=session_id, journal_id=journal_id, calls=calls)

    def _write(self, s: Session, *, session_id: int, journal_id: int, calls: Sequence[NewRequest]) -> list[Requested]:
        written = store.record_requests(
            s,
            session_id=session_id,
            journal_id=journal_id,
            agent_type=self.agent.name,
            execution_id=self.execution_id,
            calls=list(calls),
            timeout_seconds=get_settings().APPROVAL_TIMEOUT_SECONDS,
            not_after=self.not_after,
        )
        for r in written:
            log_event(
                log,
                "approval_requested" if r.grant_id is None else "approval_granted_for_session",
                session_id=session_id,
                call_id=r.call_id,
                tool=r.tool,
            )
        return written

    def gated(
        self, fence: Fence, *, session_id: int, journal_id: int | None, runnable: Sequence[ToolCall], replayed: bool
    ) -> set[str]:
        """The call ids of the round that wait for a decision: a call needs one when its journaled
        round asked for one OR the configuration in force now says so (a round journaled before
        a deploy that added the need is continued under the new rule). A tool's callable is not
        asked again: its journaled decision stands (a call journaled before the tool had one is
        asked now, and that decision journaled). Of ``runnable`` (the calls that may still run:
        no result, not refused, not reported interrupted), one that needs approval now but that
        has no request gets it now, fenced, before any call of the round runs. One read, only
        when a call may need one: a ``replayed`` round, a call that needs approval now, or a
        call of a tool with a callable."""
        if journal_id is None:
            return set()
        needed = [c for c in runnable if needs_approval(self.agent, c.name)]
        ruled = [(c, found) for c in runnable if (found := _ruled(c.name)) is not None]
        if not replayed and not needed and not ruled:
            return set()
        with transaction() as s:
            asked = set(store.requests_of(s, journal_id))
            journaled = journal_store.approval_rules_of(s, journal_id) if ruled else {}
            fresh = {call_id_of(c): self._rule(f, c, session_id) for c, f in ruled if call_id_of(c) not in journaled}
            rules = {**journaled, **fresh}
            late = [self._request(c) for c in runnable if self._needs(c, rules) and call_id_of(c) not in asked]
            written: list[Requested] = []
            if late or fresh:
                fence.check(s)
                if fresh:
                    journal_store.add_approval_rules(s, journal_id, fresh)
                if late:
                    written = self._write(s, session_id=session_id, journal_id=journal_id, calls=late)
        if fresh:
            crash_point("approval.after_rule")
        if late:
            crash_point("approval.after_request")
            announce(written)
        return asked | {r.call_id for r in late}


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
    #: With ``for_session``: the calls the session's grant approved (this one first).
    granted: list[str] = field(default_factory=list)

    def describe(self) -> str:
        r = self.request
        if r is None:
            return "no such approval request"
        stands = f"{r.status.lower()} by {r.decided_by or '-'}" + (f": {r.reason}" if r.reason else "")
        said = {
            DecisionOutcome.DECIDED: f"{stands} (session {r.session_id}, call {r.call_id}, tool {r.tool})",
            DecisionOutcome.REPEATED: f"already {stands}: nothing done",
            DecisionOutcome.CONFLICT: f"refused: the decision that stands is {stands}",
            DecisionOutcome.NOT_FOUND: "no such approval request",
        }[self.outcome]
        if self.granted:
            others = len(self.granted) - 1
            said += f"; {r.tool} approved for the rest of session {r.session_id}" + (
                f" ({others} other pending call(s) with it)" if others else ""
            )
        return said


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
    if tool == BUDGET_TOOL:
        schema: dict[str, Any] = BUDGET_SCHEMA
    else:
        found = lookup(tool)
        if found is None:
            raise DecisionRefused(f"tool {tool!r} is not known to this process: its schema cannot be checked")
        schema = found.parameters
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "arguments"
        raise DecisionRefused(f"--arguments do not match the schema of {tool!r} at {where}: {exc.validator}") from None
    if tool == BUDGET_TOOL and not amounts_finite(value):
        raise DecisionRefused(f"--arguments of {tool!r} must be finite numbers")
    return store.canonical(value)


def decide(session_id: int, call_id: str, decision: Decision, scheduler: Scheduler) -> DecisionResult:
    """Record a human's decision on one request (a compare-and-set: the first one wins) and, in
    the same transaction, hand the session back to a loop when nothing else of it is pending;
    then enqueue that loop. A lost message is harmless: the reservation lapses and the scan
    resumes the session. Raises DecisionRefused for invalid edited arguments."""
    if decision.arguments is not None and not decision.approve:
        raise DecisionRefused("edited arguments go with an approval only")
    if decision.for_session and not decision.approve:
        raise DecisionRefused("for the rest of the session goes with an approval only")
    with transaction() as s:
        row = store.request_of(s, session_id, call_id)
        if row is None:
            return DecisionResult(DecisionOutcome.NOT_FOUND, None)
        if decision.arguments is not None:
            edited: str | None = validated_arguments(row.tool, decision.arguments)
            if edited == store.canonical(row.arguments):
                edited = None  # the model's own arguments, in another key order: not an edit
            decision = Decision(True, decision.by, decision.reason, edited, decision.for_session)
        if decision.for_session and row.tool == BUDGET_TOOL:
            raise DecisionRefused("a budget request is approved one at a time")
        outcome, row = store.decide(s, session_id, call_id, decision)
        approved = outcome == DecisionOutcome.DECIDED and row is not None and row.status == ApprovalStatus.APPROVED
        if approved and row is not None and row.tool == BUDGET_TOOL:
            raise_for(s, row)  # the budget is higher before the session is handed back
        granted = _granted(s, decision, outcome, row)
        handed = _hand_back(s, session_id) if outcome == DecisionOutcome.DECIDED or granted else None
    if granted:
        log_event(log, "approval_granted_for_session", session_id=session_id, call_id=call_id, by=decision.by)
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
    return DecisionResult(outcome, row, resumed=handed is not None, granted=granted)


def _granted(s: Session, decision: Decision, outcome: DecisionOutcome, row: ApprovalRequest | None) -> list[str]:
    """With ``for_session``, an approval that stands (this one, or the same one again) grants its
    tool for the rest of the session, in the decision's transaction, and approves the tool's
    other pending requests of the session with it. Returns the call ids so approved (the
    request's own included, a repeat of the grant too: the grant is what the caller asked)."""
    if not decision.for_session or row is None or row.status != ApprovalStatus.APPROVED:
        return []
    if outcome not in (DecisionOutcome.DECIDED, DecisionOutcome.REPEATED):
        return []
    g = store.grant(s, row, by=decision.by)
    return [row.call_id, *store.approve_by_grant(s, g)]


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
