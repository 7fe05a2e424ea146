"""What the console reads: the session list, one session's tree and its figures (its timeline:
``console.timeline``). Each function runs in the caller's READ ONLY transaction
(:func:`read_only`) and returns plain JSON values: the ``/api`` shapes are a public interface,
and the pages render the same values.

Content is the users' data: without ``show_content`` a message or a tool call is described by
its role, its tool names and its size in characters, never its text.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Integer, cast, exists, func, literal, or_, select, text
from sqlalchemy.orm import Session

from console.timeline import timeline
from harness.events import external_phase
from harness.views import session_release
from models import AgentSession, DeliveryStatus, ExecutionStatus, Message, Phase, Role, SubagentExecution, transaction
from models.base import utcnow

S = AgentSession
E = SubagentExecution

#: A page of the list holds at most this many sessions.
MAX_PAGE = 500
DEFAULT_PAGE = 50
#: A session's own children are shown this many at a time (``children_offset`` pages them).
CHILDREN_PAGE = 50
#: A child's children: the first this many, the rest counted by phase.
NESTED_PAGE = 10
#: The phase key of a child that has not started yet.
NOT_STARTED = "NOT_STARTED"
#: The tree is read this many levels below the session (parent -> children -> grandchildren ...).
MAX_TREE_DEPTH = 4
#: A statement of the console that the database cannot answer in this time fails.
STATEMENT_TIMEOUT_MS = 5000


@contextmanager
def read_only() -> Iterator[Session]:
    """One READ ONLY transaction with a statement timeout: the console never writes here (its
    actions go through the domain functions, each in its own transaction).

    REPEATABLE READ: every statement of a page sees the snapshot of its first one. Under READ
    COMMITTED each saw its own, and a session that ended its turn between the read of its row
    (RUNNING) and that of its tree's figures (nothing live) was shown running and settled at
    once: its page stopped asking for updates and kept RUNNING. A read-only transaction never
    gets a serialization failure at this level."""
    with transaction() as s:
        s.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))
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


#: What the list's ``phase`` filter accepts: the phases a client sees, and NONE (not started).
PHASE_FILTERS = (*(p.value for p in Phase if p != Phase.RESUMING), "NONE")


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
        "parent_session_id": row.parent_session_id,
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


def _page_of_children(s: Session, parents: list[int], *, offset: int, per_parent: int) -> list[int]:
    """The child sessions shown under ``parents``, in the order they were started (their first
    execution's id): for one parent a page from ``offset``; for several, the first
    ``per_parent`` of each (one window query, not one per parent)."""
    first = func.min(E.id)
    if len(parents) == 1:
        page = (
            select(E.child_session_id)
            .where(E.parent_session_id == parents[0])
            .group_by(E.child_session_id)
            .order_by(first)
            .limit(per_parent)
            .offset(offset)
        )
        return list(s.execute(page).scalars())
    ranked = (
        select(
            E.child_session_id,
            func.row_number().over(partition_by=E.parent_session_id, order_by=first).label("rank"),
        )
        .where(E.parent_session_id.in_(parents))
        .group_by(E.parent_session_id, E.child_session_id)
        .subquery()
    )
    return list(s.execute(select(ranked.c.child_session_id).where(ranked.c.rank <= per_parent)).scalars())


def _children_by_phase(s: Session, parents: list[int]) -> dict[int, dict[str, int]]:
    """Every child of each of ``parents`` counted by phase (shown or not): one aggregate. The
    child sessions are found by their parent index (a child session's ``parent_session_id`` is
    its executions' parent: a follow-up is refused for another parent's child), so the count
    reads the children's rows; a join from the executions made PostgreSQL read every session
    (a hash join over 100,000 sessions for 3,000 children, bench/console.py)."""
    has_execution = exists().where(E.parent_session_id == S.parent_session_id, E.child_session_id == S.id)
    rows = s.execute(
        select(S.parent_session_id, S.phase, func.count())
        .where(S.parent_session_id.in_(parents), has_execution)
        .group_by(S.parent_session_id, S.phase)
    ).all()
    out: dict[int, dict[str, int]] = {}
    for parent, phase, n in rows:
        if parent is None:  # never: the WHERE names the parents
            continue
        key = external_phase(phase) or NOT_STARTED
        by_phase = out.setdefault(parent, {})
        by_phase[key] = by_phase.get(key, 0) + int(n)
    return out


def session_tree(s: Session, session_id: int, *, children_offset: int = 0) -> dict[str, Any] | None:
    """The session and its descendants, level by level: one query per level and table, so a
    parent with 3,000 children costs the same few statements as one with two, and reads no
    more rows than it shows. The session's own children are shown a page (CHILDREN_PAGE) at a
    time from ``children_offset``; a child's children, the first NESTED_PAGE. Each node says
    how many children it has by phase (``children_total``, ``children_by_phase``), shown or
    not. Rows are read as Core rows (no ORM identity map: the console never writes them). A
    child's rounds are its executions' counters; the top session's are its model replies."""
    root = s.execute(select(S.__table__).where(S.id == session_id)).one_or_none()
    if root is None:
        return None
    now = utcnow()
    mine = s.execute(select(E.__table__).where(E.child_session_id == session_id).order_by(E.id)).all()
    own = [_execution(e, now, root) for e in mine]
    top = _node(root, own, _assistant_rounds(s, session_id), now)
    top["children_offset"] = children_offset
    level = {session_id: top}
    for depth in range(MAX_TREE_DEPTH):
        if not level:
            break
        parents = list(level)
        by_phase = _children_by_phase(s, parents)
        for parent_id, node in level.items():
            node["children_by_phase"] = by_phase.get(parent_id, {})
            node["children_total"] = sum(node["children_by_phase"].values())
        per_parent = CHILDREN_PAGE if depth == 0 else NESTED_PAGE
        shown = _page_of_children(s, parents, offset=children_offset if depth == 0 else 0, per_parent=per_parent)
        if not shown:
            break
        execs = s.execute(
            select(E.__table__).where(E.parent_session_id.in_(parents), E.child_session_id.in_(shown)).order_by(E.id)
        ).all()
        sessions = {r.id: r for r in s.execute(select(S.__table__).where(S.id.in_(shown))).all()}
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
    for node in level.values():  # below the deepest level read: nothing is known of children
        node.setdefault("children_by_phase", {})
        node.setdefault("children_total", 0)
    return top


def _walk(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node["children"]:
        yield from _walk(child)


#: Phases in which a session still moves on its own (or waits for a person): its page updates.
LIVE_PHASES = (Phase.RUNNING, Phase.RESUMING, Phase.IDLE, Phase.WAITING_APPROVAL)


def tree_figures(s: Session, session_id: int) -> tuple[dict[str, int], bool]:
    """Figures of the whole tree (MAX_TREE_DEPTH levels), whatever part of it is shown:
    sessions, executions, recovered executions, pending deliveries; and whether it is active
    (a session runs, is not started yet, or waits for an approval; or a result waits for its
    delivery). One statement: two aggregates over one recursive walk of the tree (PostgreSQL
    computes a recursive CTE once however often it is read), counts, not rows."""
    start = select(cast(literal(session_id), BigInteger).label("sid"), literal(0, Integer).label("depth"))
    walk = start.cte("tree", recursive=True)
    t = walk.union(
        select(E.child_session_id, walk.c.depth + 1).where(
            E.parent_session_id == walk.c.sid, walk.c.depth < MAX_TREE_DEPTH
        )
    )
    nodes = select(t.c.sid).distinct().subquery()
    below = select(nodes.c.sid).where(nodes.c.sid != session_id)
    live = or_(S.phase.is_(None), S.phase.in_(LIVE_PHASES))
    by_session = (
        select(func.count().label("sessions"), func.count().filter(live).label("live"))
        .select_from(S)
        .where(S.id.in_(select(nodes.c.sid)))
        .subquery()
    )
    pending = E.delivery_status == DeliveryStatus.PENDING
    by_execution = (
        select(
            func.count().label("executions"),
            func.count().filter(E.recoveries > 0).label("recovered"),
            func.count().filter(pending).label("pending"),
        )
        .where(E.child_session_id.in_(below), E.parent_session_id.in_(select(nodes.c.sid)))
        .subquery()
    )
    sessions, live_sessions, executions, recovered, pending_delivery = s.execute(
        select(
            by_session.c.sessions,
            by_session.c.live,
            by_execution.c.executions,
            by_execution.c.recovered,
            by_execution.c.pending,
        ).select_from(by_session.join(by_execution, literal(True)))
    ).one()
    counts = {
        "sessions": int(sessions),
        "executions": int(executions),
        "recovered": int(recovered),
        "pending_delivery": int(pending_delivery),
    }
    return counts, bool(live_sessions or pending_delivery)


def session_detail(
    s: Session, session_id: int, *, show_content: bool = False, children_offset: int = 0
) -> dict[str, Any] | None:
    """``GET /api/sessions/{id}``: the tree (its children a page at a time), the whole tree's
    figures, the timeline and whether it still runs."""
    tree = session_tree(s, session_id, children_offset=children_offset)
    if tree is None:
        return None
    counts, active = tree_figures(s, session_id)
    return {
        "session": {k: v for k, v in tree.items() if k != "children"},
        "tree": tree,
        "counts": counts,
        "active": active,
        "timeline": timeline(s, session_id, show_content=show_content),
        "content_shown": show_content,
        "actions": operator_actions(s, session_id),
        "approvals": pending_approvals(s, session_id),
        "release": session_release(s, session_id),
        "budget": tree_budget(s, session_id),
    }


def tree_budget(s: Session, session_id: int) -> dict[str, Any] | None:
    """The budget of the session's tree (one query: ``models.budget.budget_of``), per kind it
    limits: ``limit``, ``spent``, ``reserved``, ``estimated`` and ``left``; None: no budget. A
    model call is counted when it is reserved (``spent`` holds the calls in flight too)."""
    from models.budget import budget_of

    books = budget_of(s, session_id)
    if books is None:
        return None
    out: dict[str, Any] = {"root_session_id": books["root_session_id"]}
    kinds = {
        "tokens": (books["tokens"], books["spent"], books["reserved"], books["estimated"]),
        "usd": (books["usd"], books["spent_usd"], books["reserved_usd"], books["estimated_usd"]),
        "model_calls": (books["model_calls"], books["calls"], 0, 0),
    }
    for kind, (limit, spent, reserved, estimated) in kinds.items():
        if limit is None:
            out[kind] = None
            continue
        left = limit - spent - reserved - estimated
        out[kind] = {
            "limit": limit,
            "spent": spent,
            "reserved": reserved,
            "estimated": estimated,
            "left": round(left, 6) if kind == "usd" else left,
        }
    return out


#: A session's page names at most this many of its pending approval requests.
APPROVALS_SHOWN = 20


def pending_approvals(s: Session, session_id: int) -> list[dict[str, Any]]:
    """The session's approval requests still waiting for a decision, oldest first (by the
    unique (session_id, call_id) index): each one's id, call and tool, for links both ways."""
    from models.approval import ApprovalRequest as A
    from models.approval import ApprovalStatus

    rows = s.execute(
        select(A.id, A.call_id, A.tool, A.requested_at)
        .where(A.session_id == session_id, A.status == ApprovalStatus.PENDING)
        .order_by(A.id)
        .limit(APPROVALS_SHOWN)
    ).all()
    return [{"id": r.id, "call_id": r.call_id, "tool": r.tool, "requested_at": _iso(r.requested_at)} for r in rows]


def child_tasks(s: Session, session_ids: list[int]) -> dict[int, str]:
    """The task each child session of ``session_ids`` was given (its execution's description;
    ix_sae_child_session). Users' data: read only when the console shows content."""
    if not session_ids:
        return {}
    stmt = select(E.child_session_id, E.task_description).where(E.child_session_id.in_(session_ids)).order_by(E.id)
    found: dict[int, str] = {}
    for child, task in s.execute(stmt).all():
        if child is not None and task is not None:
            found.setdefault(int(child), str(task))
    return found


def children_counts(s: Session, session_ids: list[int]) -> dict[int, int]:
    """How many child sessions each of ``session_ids`` has (one grouped read of the parent index)."""
    if not session_ids:
        return {}
    stmt = (
        select(S.parent_session_id, func.count())
        .where(S.parent_session_id.in_(session_ids))
        .group_by(S.parent_session_id)
    )
    return {int(p): int(n) for p, n in s.execute(stmt).all() if p is not None}


def releases(s: Session) -> dict[str, Any]:
    """``GET /api/releases``: every release, oldest first, with its live sessions and those
    waiting for a worker of it; ``in_use``: the ids of the releases some live session still
    runs on (an old tool may be deleted once no release in use has it)."""
    from harness.views import release_list

    rows = release_list(s)
    return {"releases": rows, "in_use": [r["id"] for r in rows if r["live_sessions"]]}


#: A session's page lists its latest this many operator actions.
ACTIONS_SHOWN = 50


def operator_actions(s: Session, session_id: int) -> list[dict[str, Any]]:
    """What operators asked for on this session (cancels, redeliveries, decisions on its
    calls), oldest first, the latest ACTIONS_SHOWN."""
    from models.operator_action import latest

    return list(reversed(latest(s, limit=ACTIONS_SHOWN, session_id=session_id)))
