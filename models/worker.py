"""worker_boot and recovery_scan: who is alive, and when the scan last ran (docs/tables.md).

``worker_boot`` holds one row per stable worker name (Celery's ``-n`` node name or the
``WORKER_ID`` setting) with a generation bumped at every boot. A lease written by an older
generation of the same name is known dead: its process was replaced by a newer one, so its
work is taken back at once, without waiting for the lease.

Two LIVE processes under one name (a shared ``WORKER_ID``, two ``-n worker1@%h`` on one host)
are a misconfiguration that must not cost more than one take-back: every take
of a lease by a booted process carries :func:`still_current` (no newer generation of my name
exists), so a superseded process can never take a lease nor renew one, and the scan takes each
of its leases once. Its watcher (``tasks.signals``) notices the newer generation within a third
of a lease, logs ``event=worker_name_conflict`` at ERROR, records it here
(:func:`record_conflict`, read by ``agent-recovery status`` and the metrics) and stops consuming.

``recovery_scan`` is one row (id = 1) with the last scan's start and duration, read by
``agent-recovery status`` and the metrics endpoint at scrape time (not process memory).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Integer,
    String,
    and_,
    bindparam,
    exists,
    func,
    insert,
    literal,
    not_,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, UTCDateTime
from models.clock import in_time, refused_as_lapsed
from models.db import built_once, cas


class WorkerBoot(Base):
    __tablename__ = "worker_boot"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    #: Bumped at every boot of a process with this name; leases carry the generation they had.
    generation: Mapped[int] = mapped_column(Integer)
    booted_at: Mapped[datetime] = mapped_column(UTCDateTime)
    #: Set by an OLDER live process that found this newer generation under its name (two
    #: processes share one name): the generation it was, and when it noticed.
    conflict_generation: Mapped[int | None] = mapped_column(Integer, nullable=True)
    conflict_seen_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class RecoveryScan(Base):
    __tablename__ = "recovery_scan"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    #: NULL until the first pass has finished (the row may exist for the right alone).
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    duration_ms: Mapped[int | None] = mapped_column(Integer, nullable=True)
    parents: Mapped[int | None] = mapped_column(Integer, nullable=True)
    executions: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: Rows the last pass passed over because another path held their lock.
    skipped: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: The right to scan: who holds it and until when (the database's clock).
    holder: Mapped[str | None] = mapped_column(String(128), nullable=True)
    held_until: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


def record_boot(s: Session, name: str) -> int:
    """Bump (or create) the generation of ``name``; returns the new generation. Atomic, also for
    a name's first boot: one INSERT ... ON CONFLICT DO UPDATE, so two processes booting at once
    under a new name get generations 1 and 2 (and the conflict is reported), never an
    IntegrityError that leaves one of them without a boot identity."""
    W = WorkerBoot
    insert_ = pg_insert if s.get_bind().dialect.name == "postgresql" else sqlite_insert
    first = insert_(W).values(name=name, generation=1, booted_at=func.now())
    # A new boot clears the last conflict: an older process still alive records it again.
    stmt = first.on_conflict_do_update(
        index_elements=[W.name],
        set_={
            "generation": W.generation + 1,
            "booted_at": func.now(),
            "conflict_generation": None,
            "conflict_seen_at": None,
        },
    ).returning(W.generation)
    return int(s.execute(stmt).scalar_one())


def record_scan(
    s: Session, *, started_at: datetime, duration_ms: int, parents: int, executions: int, skipped: int = 0
) -> None:
    """Upsert the single ``recovery_scan`` row (the right to scan it also holds is untouched)."""
    values = {
        "started_at": started_at,
        "duration_ms": duration_ms,
        "parents": parents,
        "executions": executions,
        "skipped": skipped,
    }
    landed = cas(s, update(RecoveryScan).where(RecoveryScan.id == 1).values(**values))
    if not landed:
        s.execute(insert(RecoveryScan).values(id=1, **values))


def last_scan(s: Session) -> RecoveryScan | None:
    return s.execute(
        select(RecoveryScan).where(RecoveryScan.id == 1, RecoveryScan.started_at.is_not(None))
    ).scalar_one_or_none()


def take_scan_right(s: Session, holder: str, seconds: float) -> bool:
    """Take the right to scan for ``holder`` until ``seconds`` from now (the database's time),
    or renew it when ``holder`` already has it. Returns False, and changes nothing, when another
    holder's right has not expired, or when the row is locked by a transaction in flight (the
    row lock is skipped, never waited for: a frozen scanner blocks nobody).

    NOTE: the right lives in a row with an expiry, not in a session-level advisory lock: a
    scanner that is SIGSTOPped, paused or cut off loses it when ``held_until`` passes, whatever
    its connection does, so another worker scans within a couple of scan intervals.
    Call it in a short transaction of its own."""
    from models.base import utcnow

    now = utcnow()
    until = now + timedelta(seconds=seconds)
    R = RecoveryScan
    free = select(R.id).where(R.id == 1).with_for_update(skip_locked=True).scalar_subquery()
    landed = cas(
        s,
        update(R)
        .where(R.id == free, or_(R.held_until.is_(None), R.held_until < now, R.holder == holder), *_in_time(s, until))
        .values(holder=holder, held_until=until),
    )
    if landed:
        return True
    if refused_as_lapsed(s, until):
        return False
    if s.execute(select(R.id).where(R.id == 1)).first() is None:
        _insert_scan_row(s)
        return take_scan_right(s, holder, seconds)
    return False


def renew_scan_right(s: Session, holder: str, seconds: float) -> bool:
    """Extend the right as its holder. False, and nothing written, when the right passed to
    another scanner or lapsed (the holder's pass must stop: it was frozen or cut off longer than
    the right lasts). True, with nothing written, when the row is locked by another scanner's
    attempt in flight while the right is still the holder's: the next renewal extends it.

    NOTE: the row lock is skipped, never waited for (a scanner frozen inside its take blocks
    nobody), and a skipped row says nothing about who holds the right: another worker's boot
    scan trying to take it locks the row for its short transaction. Taken for "lost", that
    stopped a pass 38 ms after it began and left the right held by nobody scanning until it
    lapsed (tests/crash/test_liveness.py saw recovery wait a whole scan interval). The committed
    row decides: a right that names the holder and has not lapsed is the holder's, for nobody
    can take it before it lapses."""
    from models.base import utcnow

    R = RecoveryScan
    now = utcnow()
    until = now + timedelta(seconds=seconds)
    mine = select(R.id).where(R.id == 1).with_for_update(skip_locked=True).scalar_subquery()
    if cas(s, update(R).where(R.id == mine, R.holder == holder, *_in_time(s, until)).values(held_until=until)):
        return True
    if refused_as_lapsed(s, until):
        return False  # this process's clock stood still: its pass may not go on
    return s.execute(select(R.id).where(R.id == 1, R.holder == holder, R.held_until > now)).first() is not None


def holds_scan_right(s: Session, holder: str) -> bool:
    """True when the committed right names ``holder`` and has not lapsed (the database's time).
    A plain read: it takes no lock and waits for none, so a batch checks its right in its own
    transaction before it locks a row, at the cost of one round trip."""
    from models.base import utcnow

    return s.execute(_holds_stmt(), {"b_holder": holder, "b_now": utcnow()}).first() is not None


@built_once
def _holds_stmt() -> Any:
    R = RecoveryScan.__table__.c
    return select(R.id).where(
        R.id == 1, R.holder == bindparam("b_holder"), R.held_until > bindparam("b_now", type_=UTCDateTime())
    )


def _in_time(s: Session, until: datetime) -> tuple[ColumnElement[bool], ...]:
    """PostgreSQL: the right written lasts past the database's now() (models.clock.in_time)."""
    return (in_time(literal(until, UTCDateTime())),) if s.get_bind().dialect.name == "postgresql" else ()


def _insert_scan_row(s: Session) -> None:
    """The right's row (migration 0007 writes it; a truncated table gets it back here)."""
    from sqlalchemy.dialects import postgresql, sqlite

    dialect = postgresql if s.get_bind().dialect.name == "postgresql" else sqlite
    s.execute(dialect.insert(RecoveryScan).values(id=1).on_conflict_do_nothing(index_elements=["id"]))


def release_scan_right(s: Session, holder: str) -> bool:
    """Give the right back (as its holder). False when it had already passed to another."""
    R = RecoveryScan
    return bool(cas(s, update(R).where(R.id == 1, R.holder == holder).values(holder=None, held_until=None)))


#: (stable name, boot generation) of this process, set at worker boot; None elsewhere.
_identity: tuple[str, int] | None = None


def set_identity(name: str, generation: int) -> None:
    global _identity
    _identity = (name, generation)


def identity() -> tuple[str, int] | None:
    return _identity


def generation_of(owner: str | None) -> int | None:
    """The boot generation to write beside a lease held by ``owner`` (None: not a booted name)."""
    if _identity is not None and owner == _identity[0]:
        return _identity[1]
    return None


def boot(name: str) -> int:
    """Record a boot of ``name`` (new generation) and make it this process's identity."""
    from models.db import transaction

    with transaction() as s:
        generation = record_boot(s, name)
    set_identity(name, generation)
    return generation


def still_current(owner: str | None = None) -> tuple[ColumnElement[bool], ...]:
    """SQL conditions for a take or renewal of a lease by this process (for ``owner``, when
    given): no newer boot generation of this process's name exists. Empty when the process has
    no boot identity, or takes for another owner. Spread into a WHERE: ``*still_current(owner)``.

    NOTE: checked in the same UPDATE that takes the lease, so a process superseded by a newer
    boot under its name can never write a lease after that boot committed; the scan takes
    each of its older leases back once (``lease_free``), and nothing of its ever becomes
    takeable again."""
    return still_current_as(identity_for(owner))


def identity_for(owner: str | None = None) -> tuple[str, int] | None:
    """This process's boot identity when ``still_current(owner)`` applies to it, else None:
    the shape key of a statement built once (models.db.built_once) that checks it."""
    me = _identity
    if me is None or (owner is not None and owner != me[0]):
        return None
    return me


def still_current_as(me: tuple[str, int] | None) -> tuple[ColumnElement[bool], ...]:
    """``still_current`` for the identity ``me`` (see ``identity_for``)."""
    if me is None:
        return ()
    name, generation = me
    W = WorkerBoot
    return (not_(exists().where(W.name == name, W.generation > generation)),)


def superseded(s: Session) -> bool:
    """True when this process has a boot identity and a newer process booted under its name."""
    me = _identity
    return me is not None and newer_generation(s, me[0], me[1]) is not None


def newer_generation(s: Session, name: str, generation: int) -> int | None:
    """The generation of ``name`` when it is newer than ``generation`` (another process booted
    under this name), else None."""
    current = s.execute(select(WorkerBoot.generation).where(WorkerBoot.name == name)).scalar_one_or_none()
    return int(current) if current is not None and current > generation else None


def record_conflict(s: Session, name: str, generation: int) -> bool:
    """Record that ``generation`` of ``name`` still lives beside a newer one (refreshes the time
    seen). False when nothing was recorded: no newer generation exists any more."""
    W = WorkerBoot
    rows = cas(
        s,
        update(W)
        .where(W.name == name, W.generation > generation)
        .values(conflict_generation=generation, conflict_seen_at=func.now()),
    )
    return rows == 1


def check_name(name: str, generation: int) -> int | None:
    """One tick of the name watcher: the newer generation of ``name`` when a newer process booted
    under it (the conflict is then recorded, or its time seen refreshed), else None."""
    from models.db import transaction

    with transaction() as s:
        newer = newer_generation(s, name, generation)
        if newer is not None:
            record_conflict(s, name, generation)
    return newer


def name_conflicts(s: Session) -> list[WorkerBoot]:
    """Worker names under which an older live process saw a newer one, by name."""
    W = WorkerBoot
    return list(s.execute(select(W).where(W.conflict_seen_at.is_not(None)).order_by(W.name)).scalars())


def lease_takeable(model: Any, now: Any) -> ColumnElement[bool]:
    """SQL: the rule of every take (a loop, a child, a recovery) handed an epoch: the lease is
    free (``lease_free``), or it is a reservation left unowned for the epoch's holder (the
    scan's or a delivery's hand-over, a fresh submit)."""
    return or_(lease_free(model, now), model.lease_owner.is_(None))


def creation_reservation_alive(model: Any, now: Any) -> ColumnElement[bool]:
    """SQL: the row holds the reservation written at its creation and nothing since: epoch 0
    (no task ever took it), never re-sent, naming its creator, and not lapsed at ``now``. Such
    a row is free (``lease_free``) only because its creator's name booted again: its first
    message was published right after the creation committed, unless the creator died in that
    window or the broker lost the message since. (A boot scan that sees the broker still
    holding the children's messages leaves such rows to those messages: recovery.scan.)"""
    return and_(
        model.epoch == 0,
        model.resends == 0,
        model.lease_owner.is_not(None),
        model.lease_expires_at.is_not(None),
        model.lease_expires_at >= now,
    )


def lease_free(model: Any, now: Any = None) -> ColumnElement[bool]:
    """SQL: the row's lease is free to take over: none, expired in the DATABASE's time, or
    held by an older boot generation of a worker name that has booted again (its process
    is gone: the supervisor replaced it)."""
    from models.base import utcnow

    now = utcnow() if now is None else now  # the database's time (models.clock), portable to SQLite
    W = WorkerBoot
    replaced = exists().where(
        W.name == model.lease_owner,
        model.lease_generation.is_not(None),
        W.generation > model.lease_generation,
    )
    return or_(
        model.lease_expires_at.is_(None), model.lease_expires_at < now, and_(model.lease_owner.is_not(None), replaced)
    )
