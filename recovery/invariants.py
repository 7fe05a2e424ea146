"""Checks of invariants I1–I5 (docs/invariants.md) over the WHOLE database (tests, soak, demo),
I6's trace in a history (no turn answered twice), the round journal's two rules: J1 a tool
call that is neither read-only nor idempotent is started at most once; J2 a journaled reply is
never asked for again; and the two rules of local call ids (harness.callids): K1 no two
distinct calls share a key (a local id names one call of one assistant message, in the whole
installation); K2 never two TOOL rows for one call.

Each check returns human-readable violations; an empty list means it holds.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import timedelta
from itertools import pairwise
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session

from harness.delivery import result_content
from harness.history import PROVIDER_ID, check_legal, parse_tool_calls
from models import (
    ACTIVE_EXECUTION,
    ACTIVE_PHASES,
    AgentSession,
    DeliveryStatus,
    ExecutionStatus,
    InvocationType,
    JournalStatus,
    Message,
    PendingRound,
    Role,
    RoundJournal,
    RoundJournalCall,
    SessionType,
    SubagentExecution,
)
from settings import get_settings

if TYPE_CHECKING:
    from models.approval import ApprovalRequest


@dataclass(frozen=True)
class _Snapshot:
    """What the checks of I1-I5 read, once: every session, every execution (by id), and each
    session's live messages (by id)."""

    sessions: dict[int, AgentSession]
    executions: list[SubagentExecution]
    live: dict[int, list[Message]]


def _snapshot(s: Session) -> _Snapshot:
    sessions = {r.id: r for r in s.execute(select(AgentSession)).scalars()}
    executions = list(s.execute(select(SubagentExecution).order_by(SubagentExecution.id)).scalars())
    live: dict[int, list[Message]] = defaultdict(list)
    for m in s.execute(select(Message).where(Message.deleted.is_(False)).order_by(Message.id)).scalars():
        live[m.session_id].append(m)
    return _Snapshot(sessions, executions, live)


def check_all(s: Session, *, settled: bool = True, deadline_slack_seconds: float = 15.0) -> list[str]:
    """I1–I5, I6's trace in a history, then J1-J2, K1-K2 and A1-A3. With ``settled`` the system
    must also be at rest: nothing PENDING, no session RUNNING/RESUMING, no open round."""
    db = _snapshot(s)
    return [
        *_legal_histories(db),
        *_one_answer_per_turn(db),
        *_exactly_once(db, settled=settled),
        *_barrier(s, db, settled=settled),
        *_no_duplicate_child(db),
        *_absolute_deadlines(db, slack_seconds=deadline_slack_seconds),
        *check_journal(s),
        *check_call_ids(db.live),
        *check_approvals(s),
    ]


def _legal_histories(db: _Snapshot) -> list[str]:
    """I2: every session's live history is legal: the part after its compaction boundary, which
    is what the model is sent (rows at or before the boundary are replaced by the summary, and
    delivery never deletes them: a broken pair there stays, summarized)."""
    problems: list[str] = []
    for sid, rows in db.live.items():
        session = db.sessions.get(sid)
        boundary = session.compaction_boundary_message_id if session is not None else None
        for p in check_legal([m for m in rows if boundary is None or m.id > boundary]):
            problems.append(f"I2 session {sid}: {p}")
    return problems


def _one_answer_per_turn(db: _Snapshot) -> list[str]:
    """I6, as a history shows it: every turn holds at most one final answer (an ASSISTANT
    message without tool calls). A turn starts at a USER message, or at the assistant message a
    delivery wrote children's results under (a pre-upgrade row is delivered after its parent
    answered, and the parent answers that delivery). A run ends at its final answer and only a
    new turn starts the next one, so a second answer in the same turn was written by a run that
    should have been fenced out (a duplicate or late message whose take did not check its
    epoch). Checked on the live history after the compaction boundary, as I2."""
    delivered_under = {
        e.parent_assistant_message_id for e in db.executions if e.delivery_status == DeliveryStatus.DELIVERED
    }
    problems: list[str] = []
    for sid, rows in db.live.items():
        session = db.sessions.get(sid)
        boundary = session.compaction_boundary_message_id if session is not None else None
        turn: int | None = None  # the message the turn starts at (None: before any)
        answers: dict[int | None, list[int]] = defaultdict(list)
        for m in rows:
            if boundary is not None and m.id <= boundary:
                continue
            if m.role == Role.USER or m.id in delivered_under:
                turn = m.id
            elif m.role == Role.ASSISTANT and _final_answer(m):
                answers[turn].append(m.id)
        for start, ids in answers.items():
            if len(ids) > 1:
                problems.append(f"I6 session {sid}: the turn from message {start} answered {len(ids)} times {ids}")
    return problems


def _final_answer(m: Message) -> bool:
    """An assistant message that ends a run: no tool calls (an unreadable ``tool_calls`` is
    not counted: I2 says what is wrong with it)."""
    if not m.tool_calls:
        return True
    return parse_tool_calls(m.tool_calls) == []


def _exactly_once(db: _Snapshot, *, settled: bool) -> list[str]:
    """I1 (docs/exactly-once.md): one TOOL per call in a session, and each execution's result
    in its parent exactly when its delivery status says so."""
    problems: list[str] = []
    for sid, rows in db.live.items():
        counts = Counter(m.tool_call_id for m in rows if m.role == Role.TOOL)
        for call_id, n in counts.items():
            if n > 1:
                problems.append(f"I1 session {sid}: {n} TOOL messages for {call_id}")
    for e in db.executions:
        problems += _delivery_of(db, e, settled=settled)
    return problems


def _delivery_of(db: _Snapshot, e: SubagentExecution, *, settled: bool) -> list[str]:
    """I1 for one execution: DELIVERED has its one TOOL (the one it points at, from its child),
    SUPPRESSED and PENDING have none, and neither DELIVERED nor SUPPRESSED is still active."""
    problems: list[str] = []
    tools = [
        m
        for m in db.live.get(e.parent_session_id, [])
        if m.role == Role.TOOL and m.tool_call_id == e.parent_tool_call_id
    ]
    if e.delivery_status == DeliveryStatus.DELIVERED:
        if len(tools) != 1:
            problems.append(f"I1 execution {e.id}: DELIVERED but {len(tools)} TOOL messages in parent")
        elif e.parent_tool_message_id is not None and tools[0].id != e.parent_tool_message_id:
            problems.append(f"I1 execution {e.id}: parent_tool_message_id does not point at its TOOL")
        elif tools and tools[0].source_session_id not in (None, e.child_session_id):
            problems.append(f"I1 execution {e.id}: TOOL source_session_id is not the child")
        elif e.pending_round_id is not None and not _same_json(tools[0].content, result_content(e)):
            # Only a round's members: a row without a round may have been marked DELIVERED on
            # a complete pair written before the upgrade (R11), whose content is its own.
            problems.append(f"I1 execution {e.id}: its TOOL content is not the child's stored result")
    elif e.delivery_status == DeliveryStatus.SUPPRESSED and tools:
        problems.append(f"I1 execution {e.id}: SUPPRESSED but its result is in the parent")
    elif e.delivery_status == DeliveryStatus.PENDING:
        if tools and e.parent_tool_call_id is not None:
            problems.append(f"I1 execution {e.id}: PENDING but a TOOL for it is already in the parent")
        if settled:
            problems.append(f"I1 execution {e.id}: still PENDING ({e.status})")
    if e.delivery_status in (DeliveryStatus.DELIVERED, DeliveryStatus.SUPPRESSED) and e.status in ACTIVE_EXECUTION:
        problems.append(f"I1 execution {e.id}: {e.delivery_status} but still {e.status}")
    return problems


def _same_json(content: str | None, expected: str) -> bool:
    """Whether a TOOL content is the expected JSON text (compared as parsed values)."""
    try:
        return bool(json.loads(content or "") == json.loads(expected))
    except ValueError:
        return False


def _barrier(s: Session, db: _Snapshot, *, settled: bool) -> list[str]:
    """I3: a parent with an open round wrote nothing after it; a delivered round's TOOLs share
    one assistant; a parent never runs while it has PENDING executions. With ``settled``, no
    round is open and no session is active."""
    problems: list[str] = []
    open_rounds = list(s.execute(select(PendingRound).where(PendingRound.closed_at.is_(None))).scalars())
    for rnd in open_rounds:
        later = [m.id for m in db.live.get(rnd.session_id, []) if m.created_at > rnd.created_at]
        if later:
            problems.append(f"I3 session {rnd.session_id}: messages {later} written while round {rnd.id} is open")
        if settled:
            problems.append(f"I3 session {rnd.session_id}: round {rnd.id} still open")
    by_round: dict[int, set[int | None]] = defaultdict(set)
    for e in db.executions:
        if e.pending_round_id is not None and e.delivery_status == DeliveryStatus.DELIVERED:
            by_round[e.pending_round_id].add(e.parent_assistant_message_id)
    problems += _answers_inside_rounds(s, db.live, by_round)
    for rid, assistants in by_round.items():
        if len(assistants) != 1:
            problems.append(f"I3 round {rid}: delivered under {len(assistants)} assistant messages")
    if settled:
        for sid, row in db.sessions.items():
            if row.phase in ACTIVE_PHASES:
                problems.append(f"settled: session {sid} is still {row.phase}")
    return problems


def _no_duplicate_child(db: _Snapshot) -> list[str]:
    """I4: every SUBAGENT session has exactly one DELEGATE execution, the earliest; no
    execution points at a session that is not a SUBAGENT of that parent."""
    problems: list[str] = []
    per_child: dict[int, list[SubagentExecution]] = defaultdict(list)
    for e in db.executions:
        per_child[e.child_session_id].append(e)
        child = db.sessions.get(e.child_session_id)
        if (
            child is None
            or child.session_type != SessionType.SUBAGENT
            or child.parent_session_id != e.parent_session_id
        ):
            problems.append(
                f"I4 execution {e.id}: child {e.child_session_id} is not a subagent of {e.parent_session_id}"
            )
    for sid, row in db.sessions.items():
        if row.session_type != SessionType.SUBAGENT:
            continue
        child_execs = per_child.get(sid, [])
        if not child_execs:
            problems.append(f"I4 subagent session {sid} has no execution (orphan child)")
            continue
        delegates = [e for e in child_execs if e.invocation_type == InvocationType.DELEGATE]
        if len(delegates) > 1 or (delegates and delegates[0].id != child_execs[0].id):
            problems.append(f"I4 subagent session {sid}: {len(delegates)} DELEGATE executions")
    return problems


def _absolute_deadlines(db: _Snapshot, *, slack_seconds: float) -> list[str]:
    """I5: the deadline is absolute: no result was produced later than started_at + timeout +
    grace. A recovery that comes later still ENDS the execution late — as a timeout, or as
    the final answer that was already written in time (R20) — never as new work."""
    problems: list[str] = []
    cfg = get_settings()
    limit = timedelta(seconds=cfg.SUBAGENT_TIMEOUT_SECONDS + cfg.SUBAGENT_CANCEL_GRACE_SECONDS + slack_seconds)
    created = {m.id: m.created_at for rows in db.live.values() for m in rows}
    for e in db.executions:
        if e.completed_at is None or e.delivery_status == DeliveryStatus.LEGACY:
            continue
        if e.status == ExecutionStatus.COMPLETED:
            produced = created.get(e.final_message_id or -1, e.completed_at)
            if produced - e.started_at > limit:
                problems.append(
                    f"I5 execution {e.id}: its result was produced {produced - e.started_at} after its start"
                )
        elif (
            e.completed_at - e.started_at > limit
            and e.status == ExecutionStatus.FAILED
            and "timed out" not in (e.error or "")
            and "did not connect" not in (e.error or "")
        ):
            problems.append(
                f"I5 execution {e.id}: failed {e.completed_at - e.started_at} after its start, not as a timeout"
            )
    return problems


def check_call_ids(live: dict[int, list[Message]]) -> list[str]:
    """K1 and K2 over the live history of every session. A call under a local id (it has a
    provider id beside it) is one call: its id appears in one assistant message, once, and is
    answered by one TOOL row, in the whole installation. Calls journaled before local ids
    existed (the provider's ids) are per session: I1 covers them."""
    problems: list[str] = []
    calls: Counter[str] = Counter()
    for rows in live.values():
        for m in rows:
            if m.role != Role.ASSISTANT:
                continue
            parsed = parse_tool_calls(m.tool_calls)
            if isinstance(parsed, list):
                calls.update(str(c["id"]) for c in parsed if PROVIDER_ID in c)
    for call_id, n in calls.items():
        if n > 1:
            problems.append(f"K1 call {call_id}: {n} calls share its id and so its idempotency key")
    answers = Counter(m.tool_call_id for rows in live.values() for m in rows if m.role == Role.TOOL)
    for call_id in calls:
        if answers[call_id] > 1:
            problems.append(f"K2 call {call_id}: {answers[call_id]} TOOL messages")
    return problems


def check_approvals(s: Session) -> list[str]:
    """A1-A3 over approval requests. A1: a call that needed approval started (or has a result
    that is not a denial) only after an APPROVED decision. A2: its TOOL result in the history is
    the tool's only after an approval and a denial only after a denial, expiry or cancel; never
    a result without a decision. A3: one decision per request, never changed (decided_at and
    decided_by set exactly when it is no longer PENDING)."""
    from harness.approval import denied_result
    from models.approval import ApprovalRequest, ApprovalStatus

    denial = denied_result("", "")[: len("denied by ")]
    problems: list[str] = []
    requests = list(s.execute(select(ApprovalRequest).order_by(ApprovalRequest.id)).scalars())
    if not requests:
        return problems
    C = RoundJournalCall
    calls: dict[tuple[int | None, str], RoundJournalCall] = {
        (c.journal_id, c.tool_call_id): c
        for c in s.execute(select(C).where(C.journal_id.in_({r.journal_id for r in requests}))).scalars()
    }
    tools: dict[tuple[int, str], list[Message]] = defaultdict(list)
    for m in s.execute(
        select(Message).where(
            Message.session_id.in_({r.session_id for r in requests}),
            Message.role == Role.TOOL,
            Message.deleted.is_(False),
        )
    ).scalars():
        tools[(m.session_id, m.tool_call_id or "")].append(m)
    for r in requests:
        where = f"approval {r.id} (session {r.session_id}, call {r.call_id})"
        if (r.status == ApprovalStatus.PENDING) != (r.decided_at is None) or (r.decided_at is None) != (
            r.decided_by is None
        ):
            problems.append(f"A3 {where}: {r.status} with decided_at={r.decided_at} decided_by={r.decided_by}")
        call = calls.get((r.journal_id, r.call_id))
        ran = call is not None and not (call.result or "").startswith((denial, "error: the approval"))
        if ran and r.status != ApprovalStatus.APPROVED:
            problems.append(f"A1 {where}: the tool started while the request is {r.status}")
        started = call.started_at if call is not None else None
        if ran and r.decided_at is not None and started is not None and started < r.decided_at:
            problems.append(f"A1 {where}: the tool started before the approval")
        for m in tools.get((r.session_id, r.call_id), []):
            content = m.content or ""
            if r.status == ApprovalStatus.PENDING:
                problems.append(f"A2 {where}: a TOOL result while the request is still pending")
            elif r.status == ApprovalStatus.APPROVED and content.startswith(denial):
                problems.append(f"A2 {where}: approved but its TOOL result is a denial")
            elif r.status != ApprovalStatus.APPROVED and not content.startswith(denial):
                problems.append(f"A2 {where}: {r.status} but its TOOL result is not a denial")
        if r.status == ApprovalStatus.APPROVED and r.approved_arguments is not None:
            problems += _edited_call_problems(s, r, where, tools.get((r.session_id, r.call_id), []))
    return problems


def _edited_call_problems(s: Session, r: ApprovalRequest, where: str, tool_rows: list[Message]) -> list[str]:
    """A2 for an approval with edited arguments: the history's call is the approved one, and its
    TOOL result says the approver edited it (docs/approvals.md)."""
    from harness.approval import edited_result
    from models.approval import SYSTEM, canonical

    problems = []
    # Named or not (APPROVAL_NAME_TO_MODEL when the result was written).
    notes = tuple(edited_result(r.decided_by or SYSTEM, "", named=named) for named in (True, False))
    if any(not (m.content or "").startswith(notes) for m in tool_rows):
        problems.append(f"A2 {where}: ran with edited arguments but its TOOL result does not say so")
    approved = canonical(r.approved_arguments or "")
    for m in s.execute(
        select(Message).where(
            Message.session_id == r.session_id, Message.role == Role.ASSISTANT, Message.deleted.is_(False)
        )
    ).scalars():
        calls = parse_tool_calls(m.tool_calls)
        for c in calls if isinstance(calls, list) else []:
            if str(c.get("id")) == r.call_id and canonical(str(c["function"].get("arguments") or "")) != approved:
                problems.append(f"A2 {where}: the history shows arguments the approver did not approve")
    return problems


def _answers_inside_rounds(
    s: Session, live: dict[int, list[Message]], delivered_under: dict[int, set[int | None]]
) -> list[str]:
    """I3: a parent writes no final answer (an assistant message without tool calls) between a
    round's creation and its close, whether the round is open or closed now (a parent resumed
    while its children were PENDING answers, and answers again when the round is delivered).
    The assistant message the round was delivered under is the round's own."""
    problems = []
    for rnd in s.execute(select(PendingRound).order_by(PendingRound.id)).scalars():
        own = delivered_under.get(rnd.id, set())
        inside = [
            m.id
            for m in live.get(rnd.session_id, [])
            if m.role == Role.ASSISTANT
            and not tool_call_ids(m.tool_calls)
            and m.id not in own
            and m.created_at > rnd.created_at
            and (rnd.closed_at is None or m.created_at < rnd.closed_at)
        ]
        if inside:
            problems.append(
                f"I3 session {rnd.session_id}: final answers {inside} written between the creation and the "
                f"close of round {rnd.id}"
            )
    return problems


def check_journal(s: Session) -> list[str]:
    """J1 and J2 over the round journal. J2: a loop that asked the model again although the
    session's open entry held a reply would have abandoned that entry and written a new one
    asked from the SAME history; an entry is only abandoned when the history moved on."""
    problems: list[str] = []
    C = RoundJournalCall
    for row in s.execute(select(C).where(C.repeatable.is_(False), C.starts > 1)):
        call = row[0]
        problems.append(
            f"J1 journal {call.journal_id}: {call.tool_name} call {call.tool_call_id} started {call.starts} times"
        )
    entries = list(s.execute(select(RoundJournal).order_by(RoundJournal.id)).scalars())
    by_session: dict[int, list[RoundJournal]] = defaultdict(list)
    for entry in entries:
        by_session[entry.session_id].append(entry)
    for sid, rows in by_session.items():
        for earlier, later in pairwise(rows):
            if earlier.status == JournalStatus.ABANDONED and earlier.after_message_id == later.after_message_id:
                problems.append(
                    f"J2 session {sid}: journaled reply {earlier.id} was asked for again (entry {later.id})"
                )
    return problems


def tool_call_ids(raw: str | None) -> list[str]:
    calls = parse_tool_calls(raw)
    return [str(c["id"]) for c in calls] if isinstance(calls, list) else []
