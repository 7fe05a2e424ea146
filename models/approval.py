"""approval_request: a tool call that waits for a human decision, and every transition of it.

A request is written in the transaction that journals the model's reply (harness.approval), one
per call that needs approval; it names the session, the call (the journal's call id), the tool,
the arguments and their SHA-256, the agent that asked, when, and when it expires. Its life:

    PENDING -> APPROVED | DENIED    a human decided (compare-and-set: the first decision wins)
    PENDING -> EXPIRED              nobody decided before ``expires_at``: a denial, reason "expired"
    PENDING -> CANCELLED            its session (or a parent above it) was cancelled

A decided request never changes again. While a session has a PENDING request in its open
round it may be parked in ``WAITING_APPROVAL`` (no lease, no worker slot); the transaction that
decides its last pending request hands it back to a loop (``unpark_session`` /
``unpark_execution``: a reservation and a new epoch, as the scan's hand-over writes).
Every helper is one statement; the compare-and-set ones say what "nothing done" means.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    ForeignKey,
    Index,
    String,
    Text,
    UniqueConstraint,
    and_,
    bindparam,
    delete,
    exists,
    func,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, BigId, StrEnumType, UTCDateTime, check_in, utcnow
from models.db import built_once, cas, transaction
from models.enums import ACTIVE_EXECUTION, STOPPED_PHASES, DeliveryStatus, ExecutionStatus, Phase, SessionType
from models.execution import SubagentExecution
from models.session import AgentSession, set_child_phase

E = SubagentExecution
S = AgentSession


class ApprovalStatus(StrEnum):
    PENDING = "PENDING"  #: waits for a human decision
    APPROVED = "APPROVED"  #: a human said yes: the tool runs (with ``approved_arguments`` when set)
    DENIED = "DENIED"  #: a human said no: the model gets ``denied by NAME: REASON``
    EXPIRED = "EXPIRED"  #: nobody decided in time: a denial with the reason ``expired``
    CANCELLED = "CANCELLED"  #: the session was cancelled while the request waited; never decided


#: Statuses that answer the request: the call's TOOL result can be written.
DECIDED = (ApprovalStatus.APPROVED, ApprovalStatus.DENIED, ApprovalStatus.EXPIRED, ApprovalStatus.CANCELLED)
#: Who "decides" an expiry or a cancel.
SYSTEM = "system"


class ApprovalRequest(Base):
    __tablename__ = "approval_request"
    __table_args__ = (
        CheckConstraint(check_in("status", ApprovalStatus), name="status"),
        CheckConstraint("(status = 'PENDING') = (decided_at IS NULL)", name="pending_has_no_decision"),
        # One request per call of a session: a second decision can only be a compare-and-set.
        UniqueConstraint("session_id", "call_id", name="uq_approval_request_call"),
        # The pending list and the scan's backstop read the pending ones only.
        # A gated round reads its requests by journal entry (requests_of).
        Index("ix_approval_request_journal", "journal_id"),
        Index(
            "ix_approval_request_pending",
            "requested_at",
            postgresql_where=text("status = 'PENDING'"),
            sqlite_where=text("status = 'PENDING'"),
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    session_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("agent_session.id"))
    #: The child's execution when a subagent asked (its resumption takes that execution).
    execution_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("subagent_execution.id"), nullable=True)
    #: The round whose calls asked; None for a budget request (harness.budget_request), asked
    #: before any round.
    journal_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("round_journal.id"), nullable=True)
    #: The journal's call id of the call (harness.approval.call_id_of).
    call_id: Mapped[str] = mapped_column(String(128))
    tool: Mapped[str] = mapped_column(String(128))
    agent_type: Mapped[str] = mapped_column(String(64))
    #: The model's argument text, as journaled.
    arguments: Mapped[str] = mapped_column(Text)
    #: SHA-256 of ``arguments``: the decision is bound to exactly these arguments.
    arguments_sha256: Mapped[str] = mapped_column(String(64))
    status: Mapped[ApprovalStatus] = mapped_column(StrEnumType(ApprovalStatus))
    requested_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    decided_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    decided_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    #: The approver's note, or the denial's reason.
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: Edited arguments an approval ran the tool with (validated against the tool's schema).
    approved_arguments: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: The session's grant that approved this request when it was written (``approval_grant``).
    grant_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("approval_grant.id"), nullable=True)
    #: When the webhook (APPROVAL_WEBHOOK_URL) took this request's notification (None: not yet,
    #: or no webhook).
    notified_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class ApprovalGrant(Base):
    """ "This tool for the rest of this session": an approver's yes for every later call of one
    tool in one session. Written in the transaction of the approval that grants it; a request
    written while it exists is written APPROVED, naming it."""

    __tablename__ = "approval_grant"
    __table_args__ = (UniqueConstraint("session_id", "tool", name="uq_approval_grant_session_tool"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    session_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("agent_session.id"))
    tool: Mapped[str] = mapped_column(String(128))
    granted_by: Mapped[str] = mapped_column(String(128))
    granted_at: Mapped[datetime] = mapped_column(UTCDateTime)
    #: The request whose approval granted it (no foreign key: a purge may delete that request).
    request_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


A = ApprovalRequest
G = ApprovalGrant


def fingerprint(arguments: str) -> str:
    return hashlib.sha256(arguments.encode("utf-8")).hexdigest()


def canonical(arguments: str | dict[str, Any]) -> str:
    """Argument text as canonical JSON (keys sorted, no spaces): two texts that differ only in
    key order or spacing are the same arguments. Text that is not JSON is returned as it is."""
    if isinstance(arguments, str):
        try:
            value: Any = json.loads(arguments)
        except ValueError:
            return arguments
    else:
        value = arguments
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def same_arguments(row: ApprovalRequest, arguments: str) -> bool:
    """True when ``arguments`` are the request's: the model's as asked, or the approver's edit
    (which the journal carries once the approved call is under way), compared as canonical JSON."""
    if fingerprint(arguments) == row.arguments_sha256:
        return True
    asked = canonical(arguments)
    return asked == canonical(row.arguments) or (
        row.approved_arguments is not None and asked == canonical(row.approved_arguments)
    )


@dataclass(frozen=True)
class NewRequest:
    """One call of a journaled reply that needs approval; ``timeout_seconds`` (None: the
    caller's default) is how long its request waits."""

    call_id: str
    tool: str
    arguments: str
    timeout_seconds: float | None = None


@dataclass(frozen=True)
class Requested:
    """A request as written, in plain values (what the webhook and the ``approval_requested``
    signal carry: never its arguments). ``grant_id`` set: written APPROVED by that grant."""

    id: int
    session_id: int
    call_id: str
    tool: str
    agent_type: str
    requested_at: datetime
    expires_at: datetime
    grant_id: int | None = None


def record_requests(
    s: Session,
    *,
    session_id: int,
    journal_id: int | None,
    agent_type: str,
    execution_id: int | None,
    calls: list[NewRequest],
    timeout_seconds: float,
    not_after: datetime | None = None,
) -> list[Requested]:
    """Insert a request per call, in the caller's transaction (the one that journals the reply):
    PENDING, or APPROVED by the session's grant for its tool when there is one ("this tool for
    the rest of this session": decided by the grant's approver, naming it). A request expires
    its call's ``timeout_seconds`` (else ``timeout_seconds``) after it was asked, or at
    ``not_after`` (a child's absolute deadline) when that comes first."""
    now = utcnow()
    grants = grants_of(s, session_id, {c.tool for c in calls})
    rows = []
    for call in calls:
        expires = now + timedelta(seconds=call.timeout_seconds or timeout_seconds)
        if not_after is not None:
            expires = min(expires, not_after)
        grant = grants.get(call.tool)
        row = ApprovalRequest(
            session_id=session_id,
            execution_id=execution_id,
            journal_id=journal_id,
            call_id=call.call_id,
            tool=call.tool,
            agent_type=agent_type,
            arguments=call.arguments,
            arguments_sha256=fingerprint(call.arguments),
            status=ApprovalStatus.PENDING if grant is None else ApprovalStatus.APPROVED,
            requested_at=now,
            expires_at=expires,
        )
        if grant is not None:
            row.decided_at, row.decided_by, row.grant_id = now, grant.granted_by, grant.id
            row.reason = GRANTED
        s.add(row)
        rows.append(row)
    s.flush()
    return [
        Requested(r.id, session_id, r.call_id, r.tool, agent_type, r.requested_at, r.expires_at, r.grant_id)
        for r in rows
    ]


#: The reason of a request approved by its session's grant when it was written.
GRANTED = "approved for this session"


def grants_of(s: Session, session_id: int, tools: set[str]) -> dict[str, ApprovalGrant]:
    """The session's grants for ``tools``, by tool (no read when ``tools`` is empty)."""
    if not tools:
        return {}
    return {g.tool: g for g in s.execute(select(G).where(G.session_id == session_id, G.tool.in_(tools))).scalars()}


def grant(s: Session, request: ApprovalRequest, *, by: str) -> ApprovalGrant:
    """ "This tool for the rest of this session", granted by the approval of ``request``: one row
    per session and tool (a second grant for the same pair keeps the first: INSERT ... ON
    CONFLICT DO NOTHING). Returns the grant that stands."""
    from sqlalchemy.dialects.postgresql import insert as pg_insert
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    dialect = s.get_bind().dialect.name
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    s.execute(
        insert(G)
        .values(
            session_id=request.session_id,
            tool=request.tool,
            granted_by=by,
            granted_at=utcnow(),
            request_id=request.id,
        )
        .on_conflict_do_nothing(index_elements=["session_id", "tool"])
    )
    return s.execute(select(G).where(G.session_id == request.session_id, G.tool == request.tool)).scalar_one()


def approve_by_grant(s: Session, g: ApprovalGrant) -> list[str]:
    """PENDING -> APPROVED for the other requests of the grant's session and tool (calls of the
    same reply that wait beside the one that granted it), each decided by the grant. Returns
    their call ids; empty, nothing done: none was pending."""
    now = utcnow()
    return list(
        s.execute(
            update(A)
            .where(A.session_id == g.session_id, A.tool == g.tool, A.status == ApprovalStatus.PENDING)
            .values(
                status=ApprovalStatus.APPROVED, decided_at=now, decided_by=g.granted_by, reason=GRANTED, grant_id=g.id
            )
            .returning(A.call_id)
            .execution_options(synchronize_session=False)
        ).scalars()
    )


def mark_notified(s: Session, request_id: int) -> bool:
    """Record that the webhook took the request's notification. False, nothing done: no such
    request (purged), or it was recorded already (a retry that raced the first)."""
    return cas(s, update(A).where(A.id == request_id, A.notified_at.is_(None)).values(notified_at=utcnow())) == 1


def requests_of(s: Session, journal_id: int, *, lock: bool = False) -> dict[str, ApprovalRequest]:
    """The requests of one journal entry by call id (locked FOR UPDATE with ``lock``: the park
    and a decision lock the request rows first, then the session or execution)."""
    stmt = select(A).where(A.journal_id == journal_id).order_by(A.id)
    if lock:
        stmt = stmt.with_for_update()
    return {r.call_id: r for r in s.execute(stmt).scalars()}


def request_of(s: Session, session_id: int, call_id: str) -> ApprovalRequest | None:
    return s.execute(select(A).where(A.session_id == session_id, A.call_id == call_id)).scalar_one_or_none()


class DecisionOutcome(StrEnum):
    """What a decision (``decide``) ended in."""

    DECIDED = "decided"  #: this decision landed: it is the one that stands
    REPEATED = "repeated"  #: the same decision stood already: nothing done
    CONFLICT = "conflict"  #: another decision (an expiry, a cancel) stands: nothing done
    NOT_FOUND = "not_found"  #: no request for that session and call: nothing done


@dataclass(frozen=True)
class Decision:
    """A human's answer to one request. ``arguments`` (approvals only): the edited arguments
    the tool runs with instead of the model's, as JSON text or a dict (a Python caller's, or
    ``celery call``'s); ``harness.approval.decide`` records them as canonical JSON text."""

    approve: bool
    by: str
    reason: str = ""
    arguments: str | dict[str, Any] | None = None
    #: An approval only: every later call of the request's tool in its session is approved too
    #: (``grant``), and the other pending requests of that tool in the session with it.
    for_session: bool = False

    @property
    def status(self) -> ApprovalStatus:
        return ApprovalStatus.APPROVED if self.approve else ApprovalStatus.DENIED


def close_stale(s: Session, *, session_id: int | None = None, call_id: str | None = None) -> list[int]:
    """PENDING -> CANCELLED for requests whose session is stopped, and PENDING -> EXPIRED for
    requests past ``expires_at`` (the database's time); all of them, or one request. Returns
    the sessions whose requests changed (the scan hands the waiting ones back to a loop)."""
    params: dict[str, Any] = {"b_now": utcnow()}
    if session_id is not None:
        params["b_sid"] = session_id
    if call_id is not None:
        params["b_call"] = call_id
    cancel, expire = _close_stale_stmts(session_id is not None, call_id is not None)
    changed = set(s.execute(cancel, params).scalars())
    changed.update(s.execute(expire, params).scalars())
    return sorted(int(i) for i in changed)


@built_once
def _close_stale_stmts(one_session: bool, one_call: bool) -> tuple[Any, Any]:
    """:func:`close_stale`'s two compare-and-sets, built once per shape (every scan runs them)."""
    now = bindparam("b_now", type_=UTCDateTime())
    which: list[Any] = [A.status == ApprovalStatus.PENDING]
    if one_session:
        which.append(A.session_id == bindparam("b_sid"))
    if one_call:
        which.append(A.call_id == bindparam("b_call"))
    stopped = exists().where(S.id == A.session_id, S.phase.in_(STOPPED_PHASES))
    cancel = (
        update(A)
        .where(*which, stopped)
        .values(status=ApprovalStatus.CANCELLED, decided_at=now, decided_by=SYSTEM, reason="cancelled")
        .returning(A.session_id)
        .execution_options(synchronize_session=False)
    )
    expire = (
        update(A)
        .where(*which, A.expires_at <= now)
        .values(status=ApprovalStatus.EXPIRED, decided_at=now, decided_by=SYSTEM, reason="expired")
        .returning(A.session_id)
        .execution_options(synchronize_session=False)
    )
    return cancel, expire


def cancel_for_tree(s: Session, session_id: int) -> int:
    """PENDING -> CANCELLED for the requests of a stopped session and of its child sessions that
    are stopped (a cancel of the parent cancels its children first). Returns how many."""
    Child = S.__table__.alias("child")
    in_tree = or_(
        A.session_id == session_id,
        A.session_id.in_(select(Child.c.id).where(Child.c.parent_session_id == session_id)),
    )
    stopped = exists().where(S.id == A.session_id, S.phase.in_(STOPPED_PHASES))
    return cas(
        s,
        update(A)
        .where(A.status == ApprovalStatus.PENDING, in_tree, stopped)
        .values(status=ApprovalStatus.CANCELLED, decided_at=utcnow(), decided_by=SYSTEM, reason="cancelled"),
    )


def lock_for_cancel(s: Session, session_id: int) -> None:
    """Before a cancel of ``session_id`` moves its phase: lock its PENDING requests and those of
    its child sessions, then the executions it runs as a child, in the lock order of a decision
    and a park (the request rows, then the execution, then the session): a cancel racing a
    decision or a park waits for it instead of deadlocking with it."""
    Child = S.__table__.alias("child")
    in_tree = or_(
        A.session_id == session_id,
        A.session_id.in_(select(Child.c.id).where(Child.c.parent_session_id == session_id)),
    )
    s.execute(select(A.id).where(A.status == ApprovalStatus.PENDING, in_tree).order_by(A.id).with_for_update())
    s.execute(select(E.id).where(E.child_session_id == session_id).order_by(E.id).with_for_update())


def free_cancelled_child(s: Session, child_session_id: int) -> int:
    """In the transaction that cancels a child session: its execution parked for an approval
    (active, PENDING, no owner) gets no lease end, so the next scan recovers it at once, and a
    recovery ends a cancelled child as CANCELLED without running it (recovery.child). Returns
    how many (0, nothing done: the session is no child, not cancelled, or its execution is held
    by a loop, which notices the cancel itself, or ended)."""
    cancelled = exists().where(S.id == child_session_id, S.phase == Phase.CANCELLED)
    return cas(
        s,
        update(E)
        .where(
            E.child_session_id == child_session_id,
            E.status.in_(ACTIVE_EXECUTION),
            E.delivery_status == DeliveryStatus.PENDING,
            E.lease_owner.is_(None),
            cancelled,
        )
        .values(lease_expires_at=None),
    )


def free_cancelled_parked(s: Session) -> int:
    """The scan's backstop of :func:`free_cancelled_child`: every execution still parked (no
    owner, its lease end the expiry of one of its requests, which the cancel closed) whose
    child session was cancelled gets no lease end, so the same pass recovers it. A scan's
    reservation is never taken for a park: its lease end is no request's expiry."""
    cancelled = exists().where(S.id == E.child_session_id, S.phase == Phase.CANCELLED)
    parked = exists().where(
        A.execution_id == E.id, A.status == ApprovalStatus.CANCELLED, A.expires_at == E.lease_expires_at
    )
    # NOTE: SKIP LOCKED: a scan statement never waits on a row another path holds (a take, a
    # cancel); such a row is freed by a later pass, or ended by the path that holds it.
    freed = (
        select(E.id)
        .where(
            E.status.in_(ACTIVE_EXECUTION),
            E.delivery_status == DeliveryStatus.PENDING,
            E.lease_owner.is_(None),
            E.lease_expires_at.is_not(None),
            cancelled,
            parked,
        )
        .with_for_update(skip_locked=True)
    )
    return cas(s, update(E).where(E.id.in_(freed.scalar_subquery())).values(lease_expires_at=None))


def session_cancelled(s: Session, session_id: int) -> bool:
    """True when the session was cancelled (a park never parks it then)."""
    phase = s.execute(select(S.phase).where(S.id == session_id)).scalar_one_or_none()
    return phase == Phase.CANCELLED


def decide(
    s: Session, session_id: int, call_id: str, decision: Decision
) -> tuple[DecisionOutcome, ApprovalRequest | None]:
    """The compare-and-set of a decision: PENDING -> APPROVED/DENIED, with who, when and why.
    The first decision wins. A request whose session was cancelled, or that expired, is closed
    first (so such a decision is a CONFLICT naming that). A repeat of the decision that stands
    (same status, same arguments) is REPEATED; anything else is CONFLICT. Returns the request
    as it stands after."""
    close_stale(s, session_id=session_id, call_id=call_id)
    edited = canonical(decision.arguments) if decision.approve and decision.arguments is not None else None
    rows = cas(
        s,
        update(A)
        .where(A.session_id == session_id, A.call_id == call_id, A.status == ApprovalStatus.PENDING)
        .values(
            status=decision.status,
            decided_at=utcnow(),
            decided_by=decision.by,
            reason=decision.reason or None,
            approved_arguments=edited,
        ),
    )
    row = request_of(s, session_id, call_id)
    if row is None:
        return DecisionOutcome.NOT_FOUND, None
    s.refresh(row)
    if rows == 1:
        return DecisionOutcome.DECIDED, row
    stands = canonical(row.approved_arguments) if row.approved_arguments else None  # rows of any release
    if row.status == decision.status and stands == edited:
        return DecisionOutcome.REPEATED, row
    return DecisionOutcome.CONFLICT, row


@dataclass(frozen=True)
class PendingFilter:
    """Which pending requests a listing shows (None: any); ``after`` is the id of the last
    request of the previous page (pages are oldest first)."""

    tool: str | None = None
    agent_type: str | None = None
    session_id: int | None = None
    after: int | None = None
    limit: int | None = None


def _pending_where(f: PendingFilter) -> list[Any]:
    where: list[Any] = [A.status == ApprovalStatus.PENDING, S.phase.not_in(STOPPED_PHASES)]
    if f.tool is not None:
        where.append(A.tool == f.tool)
    if f.agent_type is not None:
        where.append(A.agent_type == f.agent_type)
    if f.session_id is not None:
        where.append(A.session_id == f.session_id)
    return where


def pending(s: Session, f: PendingFilter = PendingFilter()) -> list[ApprovalRequest]:
    """The PENDING requests of sessions that are not stopped, oldest first (by request time,
    then id), filtered and paged by ``f``."""
    stmt = select(A).join(S, S.id == A.session_id).where(*_pending_where(f))
    if f.after is not None:
        last_at = select(A.requested_at).where(A.id == f.after).scalar_subquery()
        stmt = stmt.where(tuple_(A.requested_at, A.id) > tuple_(last_at, f.after))
    stmt = stmt.order_by(A.requested_at, A.id)
    if f.limit is not None:
        stmt = stmt.limit(f.limit)
    return list(s.execute(stmt).scalars())


def pending_count(s: Session, f: PendingFilter = PendingFilter()) -> int:
    """How many PENDING requests ``f`` names (its page ignored)."""
    stmt = select(func.count()).select_from(A).join(S, S.id == A.session_id).where(*_pending_where(f))
    return int(s.execute(stmt).scalar_one())


#: Longest argument text a listing's one-line summary shows for one request.
SUMMARY_CHARS = 60


def summary(arguments: str) -> str:
    """The arguments on one line, cut to SUMMARY_CHARS and ending in "…" when cut (a listing's
    one-line view; the whole arguments go beside it, see ``parsed``)."""
    flat = " ".join(arguments.split())
    return flat if len(flat) <= SUMMARY_CHARS else flat[: SUMMARY_CHARS - 1] + "…"


def parsed(arguments: str | None) -> Any:
    """Argument text as the JSON value it holds (an object, as journaled), or the text itself
    when it is not JSON: shown whole either way, never cut."""
    if arguments is None:
        return None
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def listing(s: Session, *, with_arguments: bool = True, f: PendingFilter = PendingFilter()) -> list[dict[str, Any]]:
    """The pending requests as the CLI's ``approvals --json`` and the console's
    ``/api/approvals`` show them, oldest first (one shape, a public one): ``arguments`` is the
    whole JSON object, ``summary`` its one-line view. ``with_arguments`` False leaves both out
    (the console shows users' data only when told); ``f`` filters and pages them."""
    now = utcnow()
    rows = []
    found = pending(s, f)
    sessions = {
        sid: (user, parent)
        for sid, user, parent in s.execute(
            select(S.id, S.user_id, S.parent_session_id).where(S.id.in_({r.session_id for r in found}))
        )
    }
    for r in found:
        row: dict[str, Any] = {
            "id": r.id,
            "session_id": r.session_id,
            "call_id": r.call_id,
            "tool": r.tool,
            "agent_type": r.agent_type,
            "execution_id": r.execution_id,
            "user_id": sessions.get(r.session_id, (None, None))[0],
            "parent_session_id": sessions.get(r.session_id, (None, None))[1],
            "requested_at": r.requested_at.isoformat(),
            "expires_at": r.expires_at.isoformat(),
            "age_seconds": round((now - r.requested_at).total_seconds(), 1),
        }
        if with_arguments:
            row["arguments"] = parsed(r.arguments)
            row["summary"] = summary(r.arguments)
        rows.append(row)
    return rows


def described(r: ApprovalRequest) -> dict[str, Any]:
    """One request whole, decided or not (``agent-recovery approvals show --json``)."""
    return {
        "id": r.id,
        "session_id": r.session_id,
        "call_id": r.call_id,
        "tool": r.tool,
        "agent_type": r.agent_type,
        "execution_id": r.execution_id,
        "status": str(r.status),
        "requested_at": r.requested_at.isoformat(),
        "expires_at": r.expires_at.isoformat(),
        "decided_at": r.decided_at.isoformat() if r.decided_at else None,
        "decided_by": r.decided_by,
        "reason": r.reason,
        "arguments": parsed(r.arguments),
        "approved_arguments": parsed(r.approved_arguments),
        "grant_id": r.grant_id,
        "notified_at": r.notified_at.isoformat() if r.notified_at else None,
    }


def purge_decided(s: Session, *, retention_days: float, batch: int = 1000) -> int:
    """Delete up to ``batch`` decided requests decided more than ``retention_days`` ago whose
    round is closed (no open journal entry reads them again); returns how many. A request
    waiting, or of a round still open, is never deleted. The invariants' checks read the
    requests there are: a purged one is simply no longer checked."""
    from models.journal import JournalStatus, RoundJournal

    cutoff = utcnow() - timedelta(days=retention_days)
    closed = select(RoundJournal.id).where(RoundJournal.status != JournalStatus.OPEN)
    doomed = (
        select(A.id)
        .where(
            A.status != ApprovalStatus.PENDING,
            A.decided_at < cutoff,
            or_(A.journal_id.in_(closed), A.journal_id.is_(None)),  # NULL: a budget request, no round
        )
        .limit(batch)
        .scalar_subquery()
    )
    result = s.execute(delete(A).where(A.id.in_(doomed)).execution_options(synchronize_session=False))
    return int(cast("CursorResult[Any]", result).rowcount)


def purge_decided_all(retention_days: float, *, batch: int = 1000) -> int:
    """``purge_decided`` batch after batch, one transaction each, until none is left."""
    total = 0
    while True:
        with transaction() as s:
            done = purge_decided(s, retention_days=retention_days, batch=batch)
        total += done
        if done < batch:
            return total


def waiting_for_approval(session: Any) -> Any:
    """SQL over ``agent_session``: the session is parked for a human decision."""
    return session.phase == Phase.WAITING_APPROVAL


def _nothing_pending_for(session: Any) -> Any:
    return ~exists().where(A.session_id == session, A.status == ApprovalStatus.PENDING)


def park_session(s: Session, sid: int, *, epoch: int) -> bool:
    """The loop holding ``epoch`` parks its session: RUNNING/RESUMING -> WAITING_APPROVAL, the
    lease dropped, the epoch kept (a decision hands it over with a new one). The caller holds
    the round's request rows (``requests_of(lock=True)``) and saw one PENDING. False, nothing
    done: the epoch moved on, or the session was stopped."""
    return (
        cas(
            s,
            update(S)
            .where(S.id == sid, S.epoch == epoch, S.phase.in_((Phase.RUNNING, Phase.RESUMING)))
            .values(
                phase=Phase.WAITING_APPROVAL,
                lease_owner=None,
                lease_generation=None,
                lease_expires_at=None,
                updated_at=utcnow(),
            ),
        )
        == 1
    )


def park_execution(s: Session, eid: int, child_session_id: int, *, epoch: int, until: datetime) -> bool:
    """The child loop holding ``epoch`` parks its execution: no owner (status and epoch kept),
    the child session WAITING_APPROVAL, which the scan's dead rule excludes. ``until`` (the
    earliest expiry of its pending requests) is kept as the lease's end: the execution counts
    as work nobody picks up only once a request is overdue and the backstop has not acted on
    it. False, nothing done: the epoch moved on, or the execution ended or was suppressed."""
    rows = cas(
        s,
        update(E)
        .where(
            E.id == eid,
            E.epoch == epoch,
            E.status.in_(ACTIVE_EXECUTION),
            E.delivery_status == DeliveryStatus.PENDING,
        )
        .values(lease_owner=None, lease_generation=None, lease_expires_at=until),
    )
    if rows == 1:
        set_child_phase(s, child_session_id, Phase.WAITING_APPROVAL)
    return rows == 1


def restate_parked_lease(s: Session, eid: int, child_session_id: int, *, epoch: int) -> bool:
    """Set a parked execution's lease end to its earliest pending request's expiry again (a
    heartbeat of the parking loop that was already in flight may have renewed it after the
    park). False, nothing done: no longer parked at ``epoch``, or nothing pending."""
    earliest = (
        select(func.min(A.expires_at))
        .where(A.session_id == child_session_id, A.status == ApprovalStatus.PENDING)
        .scalar_subquery()
    )
    parked = exists().where(S.id == child_session_id, S.phase == Phase.WAITING_APPROVAL)
    return (
        cas(
            s,
            update(E)
            .where(E.id == eid, E.epoch == epoch, E.lease_owner.is_(None), parked, earliest.is_not(None))
            .values(lease_expires_at=earliest),
        )
        == 1
    )


def unpark_session(s: Session, sid: int, *, reserve_seconds: float) -> int | None:
    """Hand a parked NORMAL/SIDE_TASK session whose requests are all decided back to a loop:
    WAITING_APPROVAL -> RUNNING, epoch + 1, an unowned reservation (the scan resumes it if the
    message is lost). Returns the epoch to hand over; None, nothing done: not parked, a
    request still pending, or a child session (``unpark_execution``)."""
    now = utcnow()
    epoch = s.execute(
        update(S)
        .where(
            S.id == sid,
            S.phase == Phase.WAITING_APPROVAL,
            S.session_type != SessionType.SUBAGENT,
            _nothing_pending_for(S.id),
        )
        .values(
            phase=Phase.RUNNING,
            epoch=S.epoch + 1,
            lease_owner=None,
            lease_generation=None,
            lease_expires_at=now + timedelta(seconds=reserve_seconds),
            updated_at=now,
        )
        .returning(S.epoch)
        .execution_options(synchronize_session=False)
    ).scalar_one_or_none()
    return None if epoch is None else int(epoch)


def unpark_execution(s: Session, child_session_id: int, *, reserve_seconds: float) -> tuple[int, int, int] | None:
    """Hand a parked child whose requests are all decided back to recovery: its active PENDING
    execution -> RECOVERING, epoch + 1, an unowned reservation (the scan recovers it if the
    message is lost), the child session RESUMING. Returns (parent, execution, epoch); None,
    nothing done: not parked, a request still pending, or no active execution."""
    now = utcnow()
    parked = exists().where(S.id == child_session_id, S.phase == Phase.WAITING_APPROVAL, _nothing_pending_for(S.id))
    row = s.execute(
        update(E)
        .where(
            E.child_session_id == child_session_id,
            E.status.in_(ACTIVE_EXECUTION),
            E.delivery_status == DeliveryStatus.PENDING,
            E.lease_owner.is_(None),
            parked,
        )
        .values(
            status=ExecutionStatus.RECOVERING,
            epoch=E.epoch + 1,
            lease_owner=None,
            lease_generation=None,
            lease_expires_at=now + timedelta(seconds=reserve_seconds),
        )
        .returning(E.parent_session_id, E.id, E.epoch)
        .execution_options(synchronize_session=False)
    ).one_or_none()
    if row is None:
        return None
    set_child_phase(s, child_session_id, Phase.RESUMING)
    return int(row[0]), int(row[1]), int(row[2])


def parked_ready(s: Session) -> list[tuple[int, SessionType]]:
    """Sessions parked in WAITING_APPROVAL with nothing pending any more (the scan's backstop:
    a decision whose hand-over was lost, or one that landed while the loop was parking)."""
    return [(int(r[0]), SessionType(r[1])) for r in s.execute(_parked_ready_stmt()).all()]


@built_once
def _parked_ready_stmt() -> Any:
    return select(S.id, S.session_type).where(and_(S.phase == Phase.WAITING_APPROVAL, _nothing_pending_for(S.id)))
