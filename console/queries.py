"""What the console reads: the session list, one session's tree and timeline. Each function
runs in the caller's READ ONLY transaction (:func:`read_only`) and returns plain JSON values:
the ``/api`` shapes are a public interface, and the pages render the same values.

Content is the users' data: without ``show_content`` a message or a tool call is described by
its role, its tool names and its size in characters, never its text.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import exists, func, or_, select, text
from sqlalchemy.orm import Session

from harness.events import external_phase
from harness.history import parse_tool_calls
from models import AgentSession, ExecutionStatus, Message, Phase, Role, SubagentExecution, transaction
from models.base import utcnow
from models.journal import RoundJournal, RoundJournalCall
from models.round import PendingRound

S = AgentSession
E = SubagentExecution

#: A page of the list holds at most this many sessions.
MAX_PAGE = 500
DEFAULT_PAGE = 50
#: The tree is read this many levels below the session (parent -> children -> grandchildren ...).
MAX_TREE_DEPTH = 4
#: Tools that hand work to a child session: their result is delivered from the child.
DELEGATING_TOOLS = ("delegate", "delegate_followup")
#: A statement of the console that the database cannot answer in this time fails.
STATEMENT_TIMEOUT_MS = 5000


@contextmanager
def read_only() -> Iterator[Session]:
    """One READ ONLY transaction with a statement timeout: the console never writes here (its
    actions go through the domain functions, each in its own transaction)."""
    with transaction() as s:
        s.execute(text("SET TRANSACTION READ ONLY"))
        s.execute(text(f"SET LOCAL statement_timeout = {STATEMENT_TIMEOUT_MS}"))
        yield s


def recoveries(execution: Any) -> int:
    """Times recovery took an execution back (``subagent_execution.recoveries``, counted by the
    scan's reservation). Not the epoch: an approval's hand-back moves the epoch too."""
    return int(execution.recoveries or 0)


@dataclass(frozen=True)
class SessionFilter:
    """The list's filters (query parameters of ``GET /api/sessions``); None: no filter."""

    phase: str | None = None
    agent: str | None = None
    user: str | None = None
    waiting_approval: bool | None = None
    recovered: bool | None = None
    failed: bool | None = None
    #: Sessions stopped with this reason (``agent_session.failure_code``: docs/providers.md).
    failure_code: str | None = None
    since: datetime | None = None
    until: datetime | None = None


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _age(now: datetime, since: datetime | None) -> float | None:
    return None if since is None else round((now - since).total_seconds(), 1)


def _phase_clause(phase: str) -> Any:
    if phase == Phase.RUNNING.value:  # RESUMING is shown as RUNNING everywhere
        return S.phase.in_((Phase.RUNNING, Phase.RESUMING))
    if phase.upper() in ("NONE", "NULL"):
        return S.phase.is_(None)
    return S.phase == phase


def _recovered_clause() -> Any:
    """SQL over ``agent_session``: the session is a child whose execution recovery took back,
    or the parent of one. One pass over the executions (no index names the epoch) hashed once,
    rather than a probe of two indexes for every session the list walks past."""
    taken_back = E.recoveries > 0
    ids = select(E.child_session_id).where(taken_back).union(select(E.parent_session_id).where(taken_back))
    return S.id.in_(ids)


def _failed_clause() -> Any:
    return or_(
        S.phase == Phase.FAILED,
        exists().where(E.parent_session_id == S.id, E.status == ExecutionStatus.FAILED),
    )


def _where(f: SessionFilter) -> list[Any]:
    from console import approvals

    clauses: list[Any] = []
    if f.phase:
        clauses.append(_phase_clause(f.phase))
    if f.agent:
        clauses.append(S.agent_type == f.agent)
    if f.user:
        clauses.append(S.user_id == f.user)
    if f.failure_code:
        clauses.append(S.failure_code == f.failure_code)
    for flag, clause in (
        (f.waiting_approval, approvals.waiting_clause),
        (f.recovered, _recovered_clause),
        (f.failed, _failed_clause),
    ):
        if flag is not None:
            clauses.append(clause() if flag else ~clause())
    if f.since is not None:
        clauses.append(S.started_at >= f.since)
    if f.until is not None:
        clauses.append(S.started_at < f.until)
    return clauses


def list_sessions(
    s: Session, f: SessionFilter, *, limit: int = DEFAULT_PAGE, before: int | None = None
) -> dict[str, Any]:
    """Newest first (by id), ``limit`` at most, keyset-paged: ``next_before`` is the ``before``
    of the next page (None on the last page). The cost follows the page, not the table: the
    primary key is walked backwards from ``before``."""
    limit = max(1, min(limit, MAX_PAGE))
    stmt = select(S).where(*_where(f)).order_by(S.id.desc()).limit(limit + 1)
    if before is not None:
        stmt = stmt.where(S.id < before)
    rows = list(s.execute(stmt).scalars())
    more = len(rows) > limit
    rows = rows[:limit]
    ids = [r.id for r in rows]
    counts: dict[int, int] = {}
    recovered: set[int] = set()
    if ids:
        per_parent = select(E.parent_session_id, func.count()).where(E.parent_session_id.in_(ids))
        counts = dict(s.execute(per_parent.group_by(E.parent_session_id)).all())
        recovered = set(s.execute(select(S.id).where(S.id.in_(ids), _recovered_clause())).scalars())
    now = utcnow()
    return {
        "sessions": [
            {
                "id": r.id,
                "phase": external_phase(r.phase),
                "session_type": str(r.session_type),
                "agent_type": r.agent_type,
                "user_id": r.user_id,
                "parent_session_id": r.parent_session_id,
                "started_at": _iso(r.started_at),
                "updated_at": _iso(r.updated_at),
                "age_seconds": _age(now, r.started_at),
                "executions": int(counts.get(r.id, 0)),
                "recovered": r.id in recovered,
                "failure_code": r.failure_code,
            }
            for r in rows
        ],
        "next_before": rows[-1].id if more and rows else None,
    }


# --- one session: the tree -----------------------------------------------------------------


#: Execution statuses whose child session's reason is the execution's.
_ENDED_WITHOUT_RESULT = (ExecutionStatus.FAILED.value, ExecutionStatus.CANCELLED.value)


def _execution(e: Any, now: datetime, child: Any = None) -> dict[str, Any]:
    """``child``: the child session's row, whose reason a failed or cancelled execution shows."""
    from harness.child import child_deadline

    ended = str(e.status) in _ENDED_WITHOUT_RESULT and child is not None
    return {
        "id": e.id,
        "parent_session_id": e.parent_session_id,
        "child_session_id": e.child_session_id,
        "agent_type": e.agent_type,
        "invocation_type": None if e.invocation_type is None else str(e.invocation_type),
        "parent_tool_call_id": e.parent_tool_call_id,
        "status": str(e.status),
        "delivery_status": str(e.delivery_status),
        "epoch": e.epoch,
        "recoveries": recoveries(e),
        "lease_owner": e.lease_owner,
        "lease_expires_at": _iso(e.lease_expires_at),
        "lease_expired": e.lease_expires_at is not None and e.lease_expires_at < now,
        "deadline": _iso(child_deadline(e.started_at)),
        "started_at": _iso(e.started_at),
        "completed_at": _iso(e.completed_at),
        "delivered_at": _iso(e.parent_result_delivered_at),
        "rounds": e.rounds,
        "tokens": {"prompt": e.prompt_tokens, "completion": e.completion_tokens, "total": e.total_tokens},
        "tool_calls": e.total_tool_calls,
        "error": e.error is not None,
        "error_message": e.error,
        "failure_code": child.failure_code if ended else None,
    }


def _node(row: Any, executions: list[dict[str, Any]], rounds: int, now: datetime) -> dict[str, Any]:
    tokens = None
    if executions:  # a child's counters live on its executions (a follow-up adds one)
        tokens = sum(e["tokens"]["total"] for e in executions)
    return {
        "session_id": row.id,
        "session_type": str(row.session_type),
        "agent_type": row.agent_type,
        "user_id": row.user_id,
        "phase": external_phase(row.phase),
        "epoch": row.epoch,
        "lease_owner": row.lease_owner,
        "lease_expires_at": _iso(row.lease_expires_at),
        "started_at": _iso(row.started_at),
        "updated_at": _iso(row.updated_at),
        "age_seconds": _age(now, row.started_at),
        "failure_code": row.failure_code,
        "failure_message": row.failure_message,
        "rounds": rounds,
        "tokens": tokens,
        "executions": executions,
        "children": [],
    }


def _assistant_rounds(s: Session, session_id: int) -> int:
    """Model replies in the session's history (one per round)."""
    return int(
        s.execute(
            select(func.count()).where(
                Message.session_id == session_id, Message.role == Role.ASSISTANT, Message.deleted.is_(False)
            )
        ).scalar_one()
    )


def session_tree(s: Session, session_id: int) -> dict[str, Any] | None:
    """The session and its descendants, level by level: one query per level and table, so a
    parent with 200 children costs the same few statements as one with two. Rows are read as
    Core rows (no ORM identity map: the console never writes them). A child's rounds are its
    executions' counters; the top session's are its model replies in the history."""
    root = s.execute(select(S.__table__).where(S.id == session_id)).one_or_none()
    if root is None:
        return None
    now = utcnow()
    mine = s.execute(select(E.__table__).where(E.child_session_id == session_id).order_by(E.id)).all()
    own = [_execution(e, now, root) for e in mine]
    top = _node(root, own, _assistant_rounds(s, session_id), now)
    level = {session_id: top}
    for _ in range(MAX_TREE_DEPTH):
        if not level:
            break
        execs = s.execute(select(E.__table__).where(E.parent_session_id.in_(list(level))).order_by(E.id)).all()
        child_ids = list(dict.fromkeys(e.child_session_id for e in execs))
        sessions = (
            {r.id: r for r in s.execute(select(S.__table__).where(S.id.in_(child_ids))).all()} if child_ids else {}
        )
        by_child: dict[int, list[dict[str, Any]]] = {}
        for e in execs:
            by_child.setdefault(e.child_session_id, []).append(_execution(e, now, sessions.get(e.child_session_id)))
        next_level: dict[int, dict[str, Any]] = {}
        for e in execs:
            cid = e.child_session_id
            if cid in next_level or cid not in sessions:
                continue
            rounds = sum(x["rounds"] for x in by_child[cid])
            node = _node(sessions[cid], by_child[cid], rounds, now)
            level[e.parent_session_id]["children"].append(node)
            next_level[cid] = node
        level = next_level
    return top


def _walk(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node["children"]:
        yield from _walk(child)


def tree_active(tree: dict[str, Any]) -> bool:
    """Something in the tree still runs or waits for a delivery: the page keeps updating."""
    for node in _walk(tree):
        if node["phase"] in (None, Phase.RUNNING.value, Phase.IDLE.value):
            return True
        if any(e["delivery_status"] == "PENDING" for e in node["executions"]):
            return True
    return False


def tree_counts(tree: dict[str, Any]) -> dict[str, int]:
    """Figures of the whole tree: sessions, executions, recovered executions, pending deliveries."""
    nodes = list(_walk(tree))
    executions = [e for n in nodes[1:] for e in n["executions"]]
    return {
        "sessions": len(nodes),
        "executions": len(executions),
        "recovered": sum(1 for e in executions if e["recoveries"] > 0),
        "pending_delivery": sum(1 for e in executions if e["delivery_status"] == "PENDING"),
    }


# --- one session: the rounds as a timeline -----------------------------------------------------


def _crash_behaviour(name: str) -> str:
    """What happens to this tool call after a crash (the tool's declaration)."""
    from harness.tools.registry import REGISTRY

    if name in DELEGATING_TOOLS:
        return "delegated"  # a child session; its result is delivered exactly once
    tool = REGISTRY.get(name)
    if tool is None:
        return "unknown"  # not registered in this process (an MCP tool, another deployment's tool)
    if tool.read_only:
        return "read_only"
    if tool.idempotent:
        return "idempotent"
    return "at_most_once"


def _size(text_value: str | None) -> int:
    return len(text_value or "")


def _call(call: dict[str, Any], show_content: bool) -> dict[str, Any]:
    fn = call.get("function") or {}
    name = str(fn.get("name", ""))
    out: dict[str, Any] = {
        "tool_call_id": call.get("id"),
        "name": name,
        "crash": _crash_behaviour(name),
        "arguments_size": _size(fn.get("arguments") if isinstance(fn.get("arguments"), str) else None),
        "result": None,
    }
    if show_content:
        out["arguments"] = fn.get("arguments")
    return out


def _message_entry(m: Any, show_content: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "message_id": m.id,
        "role": str(m.role),
        "at": _iso(m.created_at),
        "size": _size(m.content),
    }
    if show_content:
        entry["content"] = m.content
    return entry


def timeline(s: Session, session_id: int, *, show_content: bool = False) -> list[dict[str, Any]]:
    """The session's history as rounds: each USER message, each model reply with its tool
    calls (their crash behaviour and the result that answered them: inline, or delivered from a
    child session), then the round in flight (journaled, not in the history yet) and the round
    waiting for its children."""
    out: list[dict[str, Any]] = []
    calls_by_id: dict[str, dict[str, Any]] = {}
    messages = s.execute(
        select(Message.__table__)
        .where(Message.session_id == session_id, Message.deleted.is_(False))
        .order_by(Message.id)
    ).all()
    for m in messages:
        entry = _message_entry(m, show_content)
        if m.role == Role.ASSISTANT:
            parsed = parse_tool_calls(m.tool_calls)
            calls = [_call(c, show_content) for c in parsed] if isinstance(parsed, list) else []
            entry.update(kind="model_reply", tool_calls=calls)
            for c in calls:
                if c["tool_call_id"]:
                    calls_by_id[str(c["tool_call_id"])] = c
        elif m.role == Role.TOOL:
            result = {
                "message_id": m.id,
                "size": _size(m.content),
                "at": _iso(m.created_at),
                "delivered_from_session_id": m.source_session_id,
            }
            if show_content:
                result["content"] = m.content
            call = calls_by_id.get(str(m.tool_call_id))
            if call is not None:
                call["result"] = result
                continue
            entry.update(kind="tool_result", tool_call_id=m.tool_call_id, **result)
        else:
            entry["kind"] = str(m.role).lower()
        out.append(entry)
    out.extend(_journal_entries(s, session_id, show_content))
    out.extend(_waiting_round(s, session_id, show_content))
    return out


def _journal_entries(s: Session, session_id: int, show_content: bool) -> list[dict[str, Any]]:
    entry = s.execute(
        select(RoundJournal).where(RoundJournal.session_id == session_id, RoundJournal.closed_at.is_(None))
    ).scalar_one_or_none()
    if entry is None:
        return []
    journaled = {
        c.tool_call_id: c
        for c in s.execute(select(RoundJournalCall).where(RoundJournalCall.journal_id == entry.id)).scalars()
    }
    calls = []
    for call in entry.tool_calls or []:
        item = _call(call, show_content)
        j = journaled.get(str(item["tool_call_id"]))
        item["journal"] = None
        if j is not None:
            item["journal"] = {"status": str(j.status), "starts": j.starts, "repeatable": j.repeatable}
        calls.append(item)
    out: dict[str, Any] = {
        "kind": "round_in_flight",
        "journal_id": entry.id,
        "epoch": entry.epoch,
        "at": _iso(entry.created_at),
        "replays": entry.replays,
        "size": _size(entry.content),
        "tool_calls": calls,
    }
    if show_content:
        out["content"] = entry.content
    return [out]


def _waiting_round(s: Session, session_id: int, show_content: bool) -> list[dict[str, Any]]:
    rnd = s.execute(
        select(PendingRound).where(PendingRound.session_id == session_id, PendingRound.closed_at.is_(None))
    ).scalar_one_or_none()
    if rnd is None:
        return []
    children = {
        e.parent_tool_call_id: e
        for e in s.execute(select(E).where(E.pending_round_id == rnd.id)).scalars()
        if e.parent_tool_call_id
    }
    calls = []
    for call in rnd.tool_calls or []:
        item = _call(call, show_content)
        e = children.get(str(item["tool_call_id"]))
        if e is not None:
            item["execution"] = {"id": e.id, "status": str(e.status), "delivery_status": str(e.delivery_status)}
        elif item["tool_call_id"] in (rnd.inline_results or {}):
            item["result"] = {"inline": True, "size": _size(rnd.inline_results[item["tool_call_id"]])}
        calls.append(item)
    return [{"kind": "waiting_for_children", "round_id": rnd.id, "at": _iso(rnd.created_at), "tool_calls": calls}]


def session_detail(s: Session, session_id: int, *, show_content: bool = False) -> dict[str, Any] | None:
    """``GET /api/sessions/{id}``: the tree, its figures, the timeline and whether it still runs."""
    tree = session_tree(s, session_id)
    if tree is None:
        return None
    return {
        "session": {k: v for k, v in tree.items() if k != "children"},
        "tree": tree,
        "counts": tree_counts(tree),
        "active": tree_active(tree),
        "timeline": timeline(s, session_id, show_content=show_content),
        "content_shown": show_content,
    }
