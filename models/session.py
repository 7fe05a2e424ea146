"""agent_session: one agent conversation; its lease, epoch and phase (docs/tables.md, docs/state-machines.md)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    and_,
    bindparam,
    case,
    insert,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.orm import Mapped, Session, mapped_column
from sqlalchemy.sql.dml import Update

import models.clock as db_clock
from models import lease
from models.base import USD, Base, BigId, StrEnumType, UTCDateTime, check_in, utcnow
from models.db import built_once, cas, ids_param
from models.enums import STOPPED_PHASES as STOPPED_PHASES_
from models.enums import ExecutionMode, FailureCode, Phase, SessionType
from models.errors import IllegalTransition
from models.journal import JOURNAL_OPEN, has_open_entry
from models.lease import reservation_expiry
from models.worker import generation_of, identity_for, lease_free, lease_takeable, still_current, still_current_as

#: The predicate of ix_agent_session_release_live (migration 0031): a session pinned to a release
#: and not stopped. The metric's query repeats it word for word, so the planner uses the index.
LIVE_BY_RELEASE = "release_id IS NOT NULL AND (phase IS NULL OR phase NOT IN ('COMPLETED', 'FAILED', 'CANCELLED'))"


class AgentSession(Base):
    __tablename__ = "agent_session"
    __table_args__ = (
        CheckConstraint(check_in("session_type", SessionType), name="session_type"),
        CheckConstraint(check_in("execution_mode", ExecutionMode), name="execution_mode"),
        CheckConstraint(check_in("phase", Phase, nullable=True), name="phase"),
        Index("ix_agent_session_parent", "parent_session_id"),
        Index("ix_agent_session_phase", "phase"),
        # Sessions waiting for the model (models.outage): status and the metric count them.
        Index(
            "ix_agent_session_model_outage",
            "model_outage_since",
            postgresql_where=text("model_outage_since IS NOT NULL"),
            sqlite_where=text("model_outage_since IS NOT NULL"),
        ),
        # Sessions waiting for a worker of their release (models.release): the metric counts them.
        Index(
            "ix_agent_session_release_wait",
            "release_wait_since",
            postgresql_where=text("release_wait_since IS NOT NULL"),
            sqlite_where=text("release_wait_since IS NOT NULL"),
        ),
        # Live sessions by release (recovery.metrics: agent_recovery_sessions_by_release).
        Index(
            "ix_agent_session_release_live",
            "release_id",
            postgresql_where=text(LIVE_BY_RELEASE),
            sqlite_where=text(LIVE_BY_RELEASE),
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    user_id: Mapped[str] = mapped_column(String(128))
    session_type: Mapped[SessionType] = mapped_column(StrEnumType(SessionType))
    parent_session_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("agent_session.id"), nullable=True)
    agent_type: Mapped[str] = mapped_column(String(64))
    execution_mode: Mapped[ExecutionMode] = mapped_column(StrEnumType(ExecutionMode), server_default=text("'CLOUD'"))
    #: NULL right after a child is created and before anything ran; recovery copes with it (R14).
    phase: Mapped[Phase | None] = mapped_column(StrEnumType(Phase), nullable=True)
    #: Messages with id <= boundary are summarized by compaction_summary.
    compaction_boundary_message_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    compaction_summary: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: The root of the budgeted tree this session belongs to (its own id for a root; a child
    #: copies its parent's at creation); NULL when its tree has no budget (models.budget).
    budget_root_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    #: The budget reservation of this session's model call in flight (0: none); a take that
    #: finds it above 0 charges it as estimated: that call's reply was never stored (models.budget).
    held_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"), default=0)
    #: Its USD estimate (models.prices), held and charged with ``held_tokens``.
    held_usd: Mapped[Decimal] = mapped_column(USD, server_default=text("0"), default=Decimal(0))
    #: A capped child's allocation (its parent agent's ``child_budget``), set aside in its tree's
    #: reserved tokens for its run; NULL: not capped (models.budget.allocate_child).
    cap_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    #: Tokens of the allocation its calls used (settled and estimated).
    cap_used_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"), default=0)
    #: Fencing token: bumped by every owner change; every write carries the epoch it was handed.
    epoch: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    #: The boot generation of ``lease_owner`` when it took the lease (models.worker).
    lease_generation: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: When the model became unreachable for this session's run (an outage longer than the
    #: client's retries); NULL while the model answers (models.outage).
    model_outage_since: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    #: Re-sends by the scan of an unclaimed reservation of this session's run (the back-off).
    resends: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    #: Why the session ended FAILED or CANCELLED (a ``FailureCode``) and a short message without
    #: content or secrets; written by the compare-and-set that stops it (docs/providers.md).
    failure_code: Mapped[str | None] = mapped_column(String(32), nullable=True)
    failure_message: Mapped[str | None] = mapped_column(String(300), nullable=True)
    #: The agent release the session runs on (models.release): set by its first run's take to
    #: that worker's release; a child takes its parent's. NULL until then (docs/releases.md).
    release_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("agent_release.id"), nullable=True)
    #: The release an operator moved this top-level session (and its tree) to, taken at its next
    #: round boundary, then NULL again (``sessions upgrade``; docs/releases.md).
    release_target_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("agent_release.id"), nullable=True)
    #: Since when the session waits for a worker of its release (a newer release whose tools the
    #: workers that took it lacked); NULL once a worker of it runs it (docs/releases.md).
    release_wait_since: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


S = AgentSession

#: Longest ``failure_message`` kept (the column's width).
MAX_FAILURE_MESSAGE_CHARS = 300


@dataclass(frozen=True)
class FailureReason:
    """Why a session stops: written with the phase, in the compare-and-set that stops it.
    ``message`` is short and holds no content of the conversation and no secret."""

    code: FailureCode
    message: str

    def values(self) -> dict[str, Any]:
        """The columns, for an UPDATE's ``values``."""
        message = " ".join(self.message.split())
        if len(message) > MAX_FAILURE_MESSAGE_CHARS:
            message = message[: MAX_FAILURE_MESSAGE_CHARS - 1] + "…"
        return {"failure_code": str(self.code), "failure_message": message}


def _reason_params(reason: FailureReason | None) -> dict[str, Any]:
    values = reason.values() if reason is not None else {"failure_code": None, "failure_message": None}
    return {"b_failure_code": values["failure_code"], "b_failure_message": values["failure_message"]}


#: The reason of a session whose compaction boundary is not a live message of it: it can never
#: get a legal history.
INVALID_BOUNDARY = FailureReason(FailureCode.INVALID_HISTORY, "the compaction boundary is not a live message")

#: The reason columns as bound parameters (``_reason_params`` fills them).
_REASON_VALUES: dict[str, Any] = {
    "failure_code": bindparam("b_failure_code"),
    "failure_message": bindparam("b_failure_message"),
}

#: Phases from which a session may be (re)started by a loop or recovery. Stopped phases never
#: come back (a cancelled parent stays stopped).
STARTABLE_PHASES: tuple[Phase | None, ...] = (
    None,
    Phase.IDLE,
    Phase.RUNNING,
    Phase.RESUMING,
    Phase.WAITING_USER,
)


def not_stopped(model: Any = None) -> Any:
    """SQL: the session (``model``: the mapped class or an alias of its table; default the
    class) is not in a stopped phase: no phase yet, or not COMPLETED/FAILED/CANCELLED. The one
    spelling of "a parent that may still get a delivery, be resumed or be written to"."""
    phase = S if model is None else model
    column = phase.c.phase if hasattr(phase, "c") else phase.phase
    return or_(column.is_(None), column.not_in(STOPPED_PHASES_))


def child_not_cancelled() -> Any:
    """SQL: a CHILD session's phase may still move: anything but CANCELLED. NOTE: a different
    rule from :func:`not_stopped`: a child's COMPLETED/FAILED phase is not final, because a
    follow-up (``delegate_followup``) reopens the child; only a cancel is."""
    return S.phase.is_distinct_from(Phase.CANCELLED)


@built_once
def lock_unheld_stmt(columns: tuple[str, ...] = (), only_not_stopped: bool = False) -> Any:
    """SQL: lock the sessions ``b_ids`` (one expanding parameter: one cached statement for any
    count) in ascending id, the lock order of sessions, leaving out a session another
    transaction holds (SKIP LOCKED: the caller never waits on it). Returns ``id``, then the
    named ``columns``. ``only_not_stopped``: a session in a stopped phase is left out too.
    The one spelling of "lock these sessions unless someone else has them"."""
    stmt = select(S.id, *(getattr(S, name) for name in columns)).where(S.id.in_(ids_param()))
    if only_not_stopped:
        stmt = stmt.where(not_stopped())
    return stmt.order_by(S.id).with_for_update(skip_locked=True)


def reservation_seconds() -> float:
    """How long a reservation waits for the task it was handed: models.lease.reservation_seconds
    (kept here for its callers)."""
    return lease.reservation_seconds()


def set_child_phase(s: Session, child_id: int, to_phase: Phase, *, reason: FailureReason | None = None) -> None:
    """Move a child session's phase as the holder of its execution's epoch (the caller's
    transaction carries the execution's compare-and-set); a cancelled child stays cancelled
    (and keeps its reason). ``reason``: why it stops (FAILED, CANCELLED), written with the phase;
    any other phase clears the reason of an earlier end."""
    params = {"b_sid": child_id, "b_now": utcnow(), **_reason_params(reason)}
    cas(s, _child_phase_stmt(to_phase), params)


@built_once
def _child_phase_stmt(to_phase: Phase) -> Any:
    return (
        update(S)
        .where(S.id == bindparam("b_sid"), child_not_cancelled())
        .values(phase=to_phase, updated_at=bindparam("b_now"), **_REASON_VALUES)
        .execution_options(synchronize_session=False)
    )


def create_child_session(
    s: Session, *, parent_id: int, agent_type: str, execution_mode: ExecutionMode, user_id: str | None = None
) -> int:
    """Insert a child (SUBAGENT) session of ``parent_id`` in the caller's transaction; its id.
    Without ``user_id`` the child takes its parent's, read by the INSERT itself (no trip); the
    child always takes its parent's release that way (docs/releases.md)."""
    now = utcnow()
    values: dict[str, Any] = dict(
        b_release_parent=parent_id,
        session_type=SessionType.SUBAGENT,
        parent_session_id=parent_id,
        agent_type=agent_type,
        execution_mode=execution_mode,
        phase=None,  # set to RUNNING by the task that runs it (recovery copes with NULL: R14)
        started_at=now,
        updated_at=now,
    )
    if user_id is None:
        values["b_parent"] = parent_id
    else:
        values["user_id"] = user_id
    values["b_budget_parent"] = parent_id
    return int(s.execute(_insert_child_stmt(user_id is None), values).scalar_one())


@built_once
def _insert_child_stmt(user_from_parent: bool) -> Any:
    sessions = cast(Table, AgentSession.__table__)
    stmt = insert(sessions).values(
        release_id=select(S.release_id).where(S.id == bindparam("b_release_parent")).scalar_subquery()
    )
    if user_from_parent:
        stmt = stmt.values(user_id=select(S.user_id).where(S.id == bindparam("b_parent")).scalar_subquery())
    # A child draws from its parent's tree budget, if any: read by the INSERT itself (no trip).
    parent = select(S.budget_root_id).where(S.id == bindparam("b_budget_parent")).scalar_subquery()
    return stmt.values(budget_root_id=parent).returning(sessions.c.id)


def cancel_child(s: Session, child_id: int, *, reason: FailureReason | None = None) -> None:
    """A suppressed execution's child session -> CANCELLED, unless already stopped; with
    ``reason`` (default: its parent was stopped)."""
    reason = reason or FailureReason(FailureCode.PARENT_STOPPED, "the parent session was stopped")
    s.execute(
        update(S)
        .where(S.id == child_id, not_stopped())
        .values(phase=Phase.CANCELLED, updated_at=utcnow(), **reason.values())
        .execution_options(synchronize_session=False)
    )


#: Phases a child session may be in for a follow-up to take it (its previous execution ended).
FOLLOWUP_FROM = (Phase.IDLE, Phase.COMPLETED, Phase.FAILED)


def reopen_child_for_followup(s: Session, child_id: int) -> bool:
    """A follow-up takes the child: phase IDLE/COMPLETED/FAILED -> RUNNING. False, and nothing
    written, when the child is busy (RUNNING/RESUMING, or never ran) or cancelled."""
    return (
        cas(
            s,
            update(S)
            .where(S.id == child_id, S.phase.in_(FOLLOWUP_FROM))
            .values(phase=Phase.RUNNING, updated_at=utcnow(), failure_code=None, failure_message=None),
        )
        == 1
    )


def fence_session(s: Session, sid: int, *, epoch: int, lease_seconds: float) -> bool:
    """Inside a loop's write transaction: renew the lease of the epoch's owner unless the
    session was stopped meanwhile (or this process was replaced under its name). The UPDATE
    locks the row, so a concurrent cancel lands either before it (False) or after the write.
    False, and nothing written, when the epoch moved on, the session is stopped or unowned, or
    (PostgreSQL) the lease it would write is already past in the database's time: this
    process's clock stood still (a suspended host), and the clock is measured again
    (models.clock.in_time)."""
    until = utcnow() + timedelta(seconds=lease_seconds)
    params = {"b_sid": sid, "b_epoch": epoch, "b_until": until}
    pg = s.get_bind().dialect.name == "postgresql"
    if cas(s, _fence_stmt(identity_for(), pg), params) == 1:
        return True
    db_clock.refused_as_lapsed(s, until)
    return False


def _held_by(me: tuple[str, int] | None) -> tuple[Any, ...]:
    """SQL: session ``b_sid`` is held at epoch ``b_epoch`` by a live owner, is not stopped, and
    this process (``me``) was not replaced under its worker name."""
    return (
        S.id == bindparam("b_sid"),
        S.epoch == bindparam("b_epoch"),
        S.lease_owner.is_not(None),
        not_stopped(),
        *still_current_as(me),
    )


@built_once
def _fence_stmt(me: tuple[str, int] | None, pg: bool) -> Any:
    in_time = (db_clock.in_time(bindparam("b_until", type_=UTCDateTime())),) if pg else ()
    return (
        update(S)
        .where(*_held_by(me), *in_time)
        .values(lease_expires_at=bindparam("b_until"))
        .execution_options(synchronize_session=False)
    )


def parent_release(which: Any, now: Any, until: Any = None) -> tuple[Update, Update]:
    """The scan's hand-over of parents as its two compare-and-sets, over the parents ``which``
    names (SQL on agent_session, e.g. ``AgentSession.id.in_(ids)``; ``now``: the database's
    time, a value or a bound parameter): ``lapsed`` gives a parent whose own lease lapsed (it
    died before yielding) epoch + 1, RESUMING and an unowned reservation of
    :func:`reservation_seconds`; ``waiting`` shows a waiting parent (no owner, RUNNING) as
    RESUMING and keeps its epoch (the callback it was handed stays valid). A parent still leased
    by a live loop matches neither and keeps its epoch (its loop yields with it). The two never
    match the same row (an owner or none). Returned as statements, so that
    :func:`release_dead_parents` runs them and the scan runs them in one WITH (recovery.scan),
    one rule in one place. ``until``: the reservation's end (default ``now`` +
    :func:`reservation_seconds`), a value or a bound parameter."""
    until = now + timedelta(seconds=reservation_seconds()) if until is None else until
    lapsed = (
        update(S)
        .where(which, S.lease_owner.is_not(None), lease_free(S, now), not_stopped())
        .values(
            phase=Phase.RESUMING,
            epoch=S.epoch + 1,
            lease_owner=None,
            lease_generation=None,
            lease_expires_at=until,
            updated_at=now,
        )
    )
    waiting = (
        update(S)
        .where(which, S.lease_owner.is_(None), S.phase == Phase.RUNNING)
        .values(phase=Phase.RESUMING, updated_at=now)
    )
    return lapsed, waiting


def release_dead_parents(s: Session, parent_ids: Any) -> dict[int, int]:
    """The scan's hand-over of parents whose rounds it recovers or delivers (the rules of
    :func:`parent_release`). Returns every given parent's current epoch; a parent still leased
    by a live loop keeps its epoch (its loop yields with it)."""
    return {pid: epoch for pid, (epoch, _) in release_dead_parents_owned(s, parent_ids).items()}


def release_dead_parents_owned(s: Session, parent_ids: Any) -> dict[int, tuple[int, str | None]]:
    """:func:`release_dead_parents`, with each parent's lease owner after the hand-over (None:
    handed over; a name: a live loop holds it and yields with its epoch): {id: (epoch, owner)}.
    Three statements built once, the ids and times bound."""
    ids = [int(i) for i in parent_ids]
    now = utcnow()
    params = {"b_ids": ids, "b_now": now, "b_until": now + timedelta(seconds=reservation_seconds())}
    lapsed, waiting, read = _release_stmts()
    s.execute(lapsed, params)
    s.execute(waiting, params)
    return {int(i): (int(e), owner) for i, e, owner in s.execute(read, {"b_ids": ids}).all()}


@built_once
def _release_stmts() -> tuple[Any, Any, Any]:
    which = S.id.in_(ids_param())
    now, until = bindparam("b_now", type_=UTCDateTime()), bindparam("b_until", type_=UTCDateTime())
    lapsed, waiting = (stmt.execution_options(synchronize_session=False) for stmt in parent_release(which, now, until))
    return lapsed, waiting, select(S.id, S.epoch, S.lease_owner).where(which)


def phase_in(phases: tuple[Phase | None, ...]) -> Any:
    """SQL: the session's phase is one of ``phases`` (None: no phase yet)."""
    named = [p for p in phases if p is not None]
    clause = S.phase.in_(named)
    return or_(clause, S.phase.is_(None)) if None in phases else clause


def take_session(
    s: Session,
    sid: int,
    *,
    expected_epoch: int,
    owner: str,
    lease_seconds: float,
    to_phase: Phase,
    from_phases: tuple[Phase | None, ...] = STARTABLE_PHASES,
) -> int | None:
    """Take the session for ``owner``: phase -> to_phase, epoch + 1, new lease, and the count of
    re-sent reservations back to 0 (the one it took was claimed).

    Returns the new epoch, or None when the epoch moved on, a live lease is held (an unowned
    reservation is left for the epoch's holder: ``models.worker.lease_takeable``), the phase
    is not one it may start from (a stopped session is never taken), or (PostgreSQL) the lease
    it would write is already past in the database's time (this process's clock stood still:
    it is measured again).
    """
    taken = take_session_facts(
        s,
        sid,
        expected_epoch=expected_epoch,
        owner=owner,
        lease_seconds=lease_seconds,
        to_phase=to_phase,
        from_phases=from_phases,
        facts=(),
    )
    return None if taken is None else expected_epoch + 1


def take_session_facts(
    s: Session,
    sid: int,
    *,
    expected_epoch: int,
    owner: str,
    lease_seconds: float,
    to_phase: Phase,
    from_phases: tuple[Phase | None, ...] = STARTABLE_PHASES,
    facts: tuple[str, ...],
) -> Any:
    """``take_session`` that also returns the session's columns named in ``facts`` as the take
    wrote them (one statement: ``UPDATE ... RETURNING``): the row (``row.epoch`` the new
    epoch), or None when the take did not land (the same cases as ``take_session``)."""
    if to_phase in STOPPED_PHASES_:
        raise IllegalTransition(f"take_session cannot move session {sid} to stopped phase {to_phase}")
    now = utcnow()
    params = {
        "b_sid": sid,
        "b_epoch": expected_epoch,
        "b_now": now,
        "b_owner": owner,
        "b_generation": generation_of(owner),
        "b_until": now + timedelta(seconds=lease_seconds),
    }
    pg = s.get_bind().dialect.name == "postgresql"
    stmt = _take_stmt(to_phase, from_phases, identity_for(owner), pg, facts)
    row = s.execute(stmt, params).one_or_none()
    if row is not None:
        return row
    db_clock.refused_as_lapsed(s, params["b_until"])  # a clock that stood still is measured again
    return None


@built_once
def _take_stmt(
    to_phase: Phase, from_phases: tuple[Phase | None, ...], me: tuple[str, int] | None, pg: bool, facts: tuple[str, ...]
) -> Any:
    in_time = (db_clock.in_time(bindparam("b_until", type_=UTCDateTime())),) if pg else ()
    stmt = (
        update(S)
        .where(
            S.id == bindparam("b_sid"),
            S.epoch == bindparam("b_epoch"),
            phase_in(from_phases),
            *still_current_as(me),
            lease_takeable(S, bindparam("b_now")),
            *in_time,
        )
        .values(
            phase=to_phase,
            epoch=S.epoch + 1,
            lease_owner=bindparam("b_owner"),
            lease_generation=bindparam("b_generation"),
            lease_expires_at=bindparam("b_until"),
            # A taken reservation was claimed: a later one, lost, is re-sent after the first window.
            resends=0,
            updated_at=bindparam("b_now"),
        )
        .returning(S.epoch, *(_fact(name) for name in facts))
        .execution_options(synchronize_session=False)
    )
    if JOURNAL_OPEN in facts:
        # NOTE: with an expression that is not a column in its RETURNING, the statement's first
        # two executions each compiled it (SQLAlchemy 2.1: the first compile's cache entry was
        # not found by the second), so the pool processes' warm-up (models.warmup), which runs
        # each statement once, left the first run's take to compile it. Compiled once here, it
        # is compiled once more at its first execution and then found.
        stmt.compile()
    return stmt


def _fact(name: str) -> Any:
    """A column of the session to return, or JOURNAL_OPEN: whether it has an open round journal
    entry (a run whose take returns False has no round in flight to read).

    NOTE: the subquery sees the statement's snapshot, so an entry committed after it would be
    missed. None can be: only an owner of the session's epoch writes one, in a transaction whose
    fence (:func:`fence_session`) needs that owner on the row and renews its lease there. A run
    is sent the epoch a hand-over wrote, with no owner, which no fence passes; and a take that
    waited for a fence's commit re-checks the row it committed, finds the lease live, and does
    not land."""
    return has_open_entry(S.id) if name == JOURNAL_OPEN else getattr(S, name)


def reserve_session(
    s: Session,
    sid: int,
    *,
    expected_epoch: int,
    to_phase: Phase,
    reserve_seconds: float,
    from_phases: tuple[Phase | None, ...] = (Phase.RUNNING, Phase.RESUMING),
    extra: tuple[Any, ...] = (),
) -> int | None:
    """The scan's takeover: when the lease has expired, set ``to_phase`` and leave an unowned
    reservation for the task it hands the epoch to. A session held by an owner gets a new
    epoch (its loop is fenced out); an unclaimed reservation (no owner: a queued run, a fresh
    submit or a hand-over after delivery) KEEPS its epoch, so the message already in the queue
    stays valid and the parent is not sent to the back of the queue by every pass
    (docs/glossary.md, "Reservation"). Returns the epoch to hand over, or None when the session moved on, is leased, or
    is not in ``from_phases``. ``extra`` conditions are checked in the same UPDATE (e.g.
    "nothing pending"). An unclaimed reservation re-sent lasts twice as long as the last one
    (2, 4, ... reservations: models.lease.reservation_expiry), as an execution's does: its run
    may just wait in a long queue, and re-sending every reservation doubled the queue each time."""
    now = utcnow()
    unclaimed = S.lease_owner.is_(None)
    epoch = s.execute(
        update(S)
        .where(
            S.id == sid,
            S.epoch == expected_epoch,
            phase_in(from_phases),
            lease_free(S, now),
            *extra,
        )
        .values(
            phase=to_phase,
            epoch=case((unclaimed, S.epoch), else_=S.epoch + 1),
            resends=case((unclaimed, S.resends + 1), else_=0),
            lease_owner=None,
            lease_generation=None,
            lease_expires_at=reservation_expiry(S.resends, now, unclaimed, reserve_seconds),
            updated_at=now,
        )
        .returning(S.epoch)
        .execution_options(synchronize_session=False)
    ).scalar_one_or_none()
    return None if epoch is None else int(epoch)


def reserve_sessions(
    s: Session,
    ids: list[int],
    *,
    to_phase: Phase,
    from_phases: tuple[Phase | None, ...] = (Phase.RUNNING, Phase.RESUMING),
    extra: tuple[Any, ...] = (),
) -> list[tuple[int, int]]:
    """:func:`reserve_session` for many sessions in ONE statement (the scan's step over plain
    sessions, batch by batch): the sessions of ``ids`` whose lease is free, in ``from_phases``
    and meeting ``extra``, reserved by the same rules (an owner's session gets a new epoch; an
    unclaimed reservation keeps its epoch and doubles its window). Returns (id, epoch to hand
    over) of those reserved, by id. Call it once the rows are locked, so that ``extra`` is read
    in a snapshot taken after the locks."""
    if not ids:
        return []
    now = utcnow()
    unclaimed = S.lease_owner.is_(None)
    rows = s.execute(
        update(S)
        .where(S.id.in_(ids), phase_in(from_phases), lease_free(S, now), *extra)
        .values(
            phase=to_phase,
            epoch=case((unclaimed, S.epoch), else_=S.epoch + 1),
            resends=case((unclaimed, S.resends + 1), else_=0),
            lease_owner=None,
            lease_generation=None,
            lease_expires_at=reservation_expiry(S.resends, now, unclaimed),
            updated_at=now,
        )
        .returning(S.id, S.epoch)
        .execution_options(synchronize_session=False)
    ).all()
    return sorted((int(i), int(e)) for i, e in rows)


def renew_session_lease(s: Session, sid: int, epoch: int, lease_seconds: float) -> bool:
    """Extend the lease of the epoch's owner; False when a newer owner exists, or (PostgreSQL)
    when the lease it would write is already past in the database's time (this process's
    clock stood still: it is measured again)."""
    until = utcnow() + timedelta(seconds=lease_seconds)
    in_time = (db_clock.in_time(until),) if s.get_bind().dialect.name == "postgresql" else ()
    rows = cas(
        s,
        update(S)
        .where(S.id == sid, S.epoch == epoch, S.lease_owner.is_not(None), *still_current(), *in_time)
        .values(lease_expires_at=until),
    )
    if rows == 1:
        return True
    db_clock.refused_as_lapsed(s, until)
    return False


def release_session(
    s: Session, sid: int, *, epoch: int, to_phase: Phase | None = None, reason: FailureReason | None = None
) -> bool:
    """Drop the lease (and optionally move the phase) as the epoch's owner. ``reason``: why
    the session stops (with ``to_phase`` FAILED), written by the same compare-and-set.

    A session that was cancelled meanwhile keeps CANCELLED (and its reason): a stopped phase is
    never overwritten. Returns False when a newer owner exists.
    """
    params = {"b_sid": sid, "b_epoch": epoch, "b_now": utcnow()}
    if reason is not None:
        params.update(_reason_params(reason))
    rows = cas(s, _release_stmt(to_phase, reason is not None), params)
    if rows == 1:
        return True
    if to_phase is not None:
        # The phase may have been stopped by a cancel: still drop our lease.
        s.execute(
            update(S)
            .where(S.id == sid, S.epoch == epoch)
            .values(lease_owner=None, lease_expires_at=None)
            .execution_options(synchronize_session=False)
        )
    return False


@built_once
def _release_stmt(to_phase: Phase | None, with_reason: bool = False) -> Any:
    values: dict[str, Any] = {"lease_owner": None, "lease_expires_at": None, "updated_at": bindparam("b_now")}
    conditions = [S.id == bindparam("b_sid"), S.epoch == bindparam("b_epoch")]
    if with_reason:
        values.update(_REASON_VALUES)
    if to_phase is not None:
        values["phase"] = to_phase
        conditions.append(phase_in(STARTABLE_PHASES))
    return update(S).where(*conditions).values(**values).execution_options(synchronize_session=False)


def end_run(s: Session, sid: int, *, epoch: int, to_phase: Phase, reason: FailureReason | None = None) -> bool:
    """The epoch's owner ends its run (its last write's transaction): lease dropped and phase
    moved in ONE compare-and-set that is also the fence (``fence_session``'s conditions: owned
    at this epoch, not stopped, this process not replaced under its name). ``reason``: why
    the session stops (``to_phase`` FAILED), written by the same statement. False, nothing
    written, when any of them fails: the caller asks the fence why (cancelled or lost)."""
    params = {"b_sid": sid, "b_epoch": epoch, "b_now": utcnow()}
    if reason is not None:
        params.update(_reason_params(reason))
    return cas(s, _end_run_stmt(to_phase, identity_for(), reason is not None), params) == 1


@built_once
def _end_run_stmt(to_phase: Phase, me: tuple[str, int] | None, with_reason: bool = False) -> Any:
    values: dict[str, Any] = {
        "phase": to_phase,
        "lease_owner": None,
        "lease_expires_at": None,
        "updated_at": bindparam("b_now"),
    }
    if with_reason:
        values.update(_REASON_VALUES)
    return (
        update(S)
        .where(*_held_by(me), phase_in(STARTABLE_PHASES))
        .values(**values)
        .execution_options(synchronize_session=False)
    )


def hand_over(s: Session, sid: int, *, epoch: int, to_phase: Phase, reserve_seconds: float = 0) -> int | None:
    """As the epoch's holder, bump the epoch and leave an unowned reservation so that only a
    task handed the new epoch takes the session (the scan waits for the reservation to
    expire). Returns the new epoch or None when we no longer hold it."""
    now = utcnow()
    until = now + timedelta(seconds=reserve_seconds) if reserve_seconds else None
    rows = cas(s, _hand_over_stmt(to_phase), {"b_sid": sid, "b_epoch": epoch, "b_now": now, "b_until": until})
    return epoch + 1 if rows == 1 else None


@built_once
def _hand_over_stmt(to_phase: Phase) -> Any:
    return (
        update(S)
        .where(S.id == bindparam("b_sid"), S.epoch == bindparam("b_epoch"), phase_in(STARTABLE_PHASES))
        .values(
            phase=to_phase,
            epoch=S.epoch + 1,
            lease_owner=None,
            lease_expires_at=bindparam("b_until"),
            updated_at=bindparam("b_now"),
        )
        .execution_options(synchronize_session=False)
    )


def hand_over_many(
    s: Session, epochs: dict[int, int], *, to_phase: Phase, reserve_seconds: float = 0
) -> dict[int, int]:
    """``hand_over`` for several sessions in ONE statement (session id -> the epoch its caller
    holds). Returns {session id: new epoch} for those it landed on; a session missing from it
    is no longer held at that epoch (nothing written for it)."""
    if not epochs:
        return {}
    now = utcnow()
    until = now + timedelta(seconds=reserve_seconds) if reserve_seconds else None
    params: dict[str, Any] = {"b_now": now, "b_until": until}
    for n, (sid, epoch) in enumerate(epochs.items()):
        params[f"s{n}"], params[f"e{n}"] = sid, epoch
    rows = s.execute(_hand_over_many_stmt(to_phase, len(epochs)), params).all()
    return {int(sid): int(epoch) for sid, epoch in rows}


@built_once
def _hand_over_many_stmt(to_phase: Phase, n: int) -> Any:
    pairs = [
        and_(S.id == bindparam(f"s{i}", type_=BigInteger()), S.epoch == bindparam(f"e{i}", type_=Integer()))
        for i in range(n)
    ]
    return (
        update(S)
        .where(or_(*pairs), phase_in(STARTABLE_PHASES))
        .values(
            phase=to_phase,
            epoch=S.epoch + 1,
            lease_owner=None,
            lease_expires_at=bindparam("b_until"),
            updated_at=bindparam("b_now"),
        )
        .returning(S.id, S.epoch)
        .execution_options(synchronize_session=False)
    )


def set_phase(
    s: Session,
    sid: int,
    *,
    to_phase: Phase,
    from_phases: tuple[Phase | None, ...],
    epoch: int | None = None,
    reason: FailureReason | None = None,
) -> bool:
    """One compare-and-set on the phase; stopped phases are never left. ``reason``: why the
    session stops, written by the same statement."""
    if any(p in STOPPED_PHASES_ for p in from_phases):
        raise IllegalTransition(f"session {sid}: a stopped phase never goes back (to {to_phase})")
    stmt = _set_phase_stmt(to_phase, from_phases, epoch is not None, reason is not None)
    params = {"b_sid": sid, "b_epoch": epoch, "b_now": utcnow()}
    if reason is not None:
        params.update(_reason_params(reason))
    return cas(s, stmt, params) == 1


@built_once
def _set_phase_stmt(
    to_phase: Phase, from_phases: tuple[Phase | None, ...], at_epoch: bool, with_reason: bool = False
) -> Any:
    conditions = [S.id == bindparam("b_sid"), phase_in(from_phases)]
    if at_epoch:
        conditions.append(S.epoch == bindparam("b_epoch"))
    values: dict[str, Any] = {"phase": to_phase, "updated_at": bindparam("b_now")}
    if with_reason:
        values.update(_REASON_VALUES)
    return update(S).where(*conditions).values(**values).execution_options(synchronize_session=False)


def stop_session(
    s: Session,
    sid: int,
    *,
    epoch: int,
    to_phase: Phase = Phase.FAILED,
    require_free: bool = False,
    reason: FailureReason | None = None,
) -> bool:
    """The epoch's holder stops the session for good (``to_phase`` is a stopped phase) and
    drops the lease. With ``require_free`` it only lands while no live lease is held (the scan
    stopping a session nobody runs). Returns False, and writes nothing, when the epoch moved on,
    the session is already stopped, or (with ``require_free``) a live loop holds it."""
    if to_phase not in STOPPED_PHASES_:
        raise IllegalTransition(f"stop_session moves session {sid} to a stopped phase, not {to_phase}")
    conditions = [S.id == sid, S.epoch == epoch, phase_in(STARTABLE_PHASES)]
    if require_free:
        conditions.append(lease_free(S))
    values = {"phase": to_phase, "lease_owner": None, "lease_expires_at": None, "updated_at": utcnow()}
    if reason is not None:
        values.update(reason.values())
    return cas(s, update(S).where(*conditions).values(**values)) == 1


def request_cancel(s: Session, sid: int, *, actor: str = "system") -> bool:
    """Any process may ask: phase -> CANCELLED unless already stopped (a session waiting for an
    approval too), with the reason ``cancelled_by`` naming ``actor``. The loop honours it."""
    return set_phase(
        s,
        sid,
        to_phase=Phase.CANCELLED,
        from_phases=(*STARTABLE_PHASES, Phase.WAITING_APPROVAL),
        reason=FailureReason(FailureCode.CANCELLED_BY, f"cancelled by {actor}"),
    )
