"""The recovery scan (DESIGN §6 recovery path): worker boot (worker_ready) and beat.

One scan at a time across all workers (PostgreSQL advisory lock); every row decision is still
a compare-and-set, so two concurrent scans (or two beats) are harmless. In order:
1. PENDING executions of cancelled/terminal parents -> SUPPRESSED with the children cancelled;
   such parents are never resumed (spec §7.1.5, §7.7).
2. Dead executions, each on its own (spec §7.1, issue 9): active + PENDING whose lease lapsed
   (in the database's time), whose owner's worker name booted again (models.worker), or whose
   absolute deadline + cancel grace passed. A live sibling never holds a dead execution back:
   the barrier is delivery's (I3). Set-based: one ``UPDATE … WHERE id IN (SELECT … FOR
   UPDATE SKIP LOCKED LIMIT n) RETURNING`` per batch reserves them (RECOVERING, epoch + 1,
   no owner, a reservation of two leases) — except an unclaimed reservation of an earlier
   scan, which keeps its epoch: its message may just be late in a long queue, and bumping
   would make it stale over and over. A parent whose own lease lapsed (it died before
   yielding) is released the same way (epoch + 1, RESUMING, no owner).
3. Rounds whose executions are all terminal but still PENDING, whose parent waits (no owner)
   and whose last result is older than the callback grace: their delivery is asked for again.
4. NORMAL/SIDE_TASK sessions RUNNING/RESUMING with a lapsed lease and nothing pending:
   tail cleaned and resumed (spec R18); "nothing pending" is re-checked in the take's UPDATE.
   SUBAGENT sessions never take this path.
The work is handed to the scheduler in batches (recover_many / deliver_many); duplicate or
late messages lose their compare-and-set and do nothing.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import and_, case, exists, func, or_, select, text, update
from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness.history import cleanup_incomplete_tail, validated_boundary
from models import (
    ACTIVE_EXECUTION,
    ACTIVE_PHASES,
    STOPPED_PHASES,
    AgentSession,
    DeliveryStatus,
    ExecutionStatus,
    PendingRound,
    Phase,
    SessionType,
    SubagentExecution,
    get_engine,
    transaction,
)
from models.base import utcnow
from models.session import reserve_session
from models.worker import lease_free, record_scan
from recovery.delivery import suppress_parent
from settings import get_settings

log = logging.getLogger("recovery.scan")

#: Key of the PostgreSQL advisory lock that serializes scans across workers.
SCAN_LOCK_KEY = 0x5CA11ED
#: Rows reserved per statement.
BATCH = 1000

E, S = SubagentExecution, AgentSession

#: (execution_id, epoch) pairs of one parent.
Children = Sequence[tuple[int, int]]


class RecoveryScheduler(Protocol):
    def recover_many(self, rounds: Sequence[tuple[int, int, Children]]) -> None:
        """For each (parent_id, parent_epoch, children): recover_child(eid, epoch) per child."""

    def deliver_many(self, parents: Sequence[tuple[int, int]]) -> None:
        """deliver_round(parent_id, epoch) for each."""

    def resume_parent(self, parent_id: int, epoch: int) -> None: ...


@dataclass
class ScanReport:
    ran: bool = True
    suppressed: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    recovering: list[int] = field(default_factory=list)
    delivering: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    resumed_sessions: list[int] = field(default_factory=list)


@contextmanager
def scan_lock() -> Iterator[bool]:
    """Session-level advisory lock on PostgreSQL (True when held); SQLite serializes writers
    itself, so there it is always True."""
    engine = get_engine()
    if engine.dialect.name != "postgresql":
        yield True
        return
    with engine.connect() as conn:
        got = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": SCAN_LOCK_KEY}).scalar())
        conn.commit()
        try:
            yield got
        finally:
            if got:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": SCAN_LOCK_KEY})
                conn.commit()


def scan(scheduler: RecoveryScheduler, *, callback_grace_seconds: float | None = None) -> ScanReport:
    """One pass. ``callback_grace_seconds`` (default LEASE_SECONDS) is how long terminal
    results may wait for their own delivery before the scan asks for it again."""
    started, started_at = time.monotonic(), utcnow()
    with scan_lock() as held:
        if not held:
            log.info("event=subagent_recovery_scan skipped=another_scan_running")
            return ScanReport(ran=False)
        report = ScanReport()
        _step("suppress", _suppress_stopped_parents, report)
        _step("recover", _recover_dead_executions, scheduler, report)
        _step("deliver", _deliver_waiting_rounds, scheduler, report, callback_grace_seconds)
        _step("resume", _resume_plain_sessions, scheduler, report)
    duration_ms = int((time.monotonic() - started) * 1000)
    log.info(
        "event=subagent_recovery_scan executions=%d parents=%d suppressed=%d waiting=%d resumed=%d durationMs=%d",
        len(report.recovering) + len(report.delivering),
        len(report.parents),
        len(report.suppressed),
        len(report.waiting),
        len(report.resumed_sessions),
        duration_ms,
    )
    try:
        with transaction() as s:
            record_scan(
                s,
                started_at=started_at,
                duration_ms=duration_ms,
                parents=len(report.parents),
                executions=len(report.recovering) + len(report.delivering),
            )
    except Exception:
        log.warning("event=scan_record_failed", exc_info=True)
    return report


def _step(name: str, fn: Any, *args: Any) -> None:
    """A step that fails is logged and the next one still runs (one bad row never stops a scan)."""
    try:
        fn(*args)
    except Exception:
        log.error("event=scan_step_failed step=%s", name, exc_info=True)


def _suppress_stopped_parents(report: ScanReport) -> None:
    with transaction() as s:
        parents = (
            s.execute(
                select(E.parent_session_id)
                .join(S, S.id == E.parent_session_id)
                .where(E.delivery_status == DeliveryStatus.PENDING, S.phase.in_(STOPPED_PHASES))
                .distinct()
            )
            .scalars()
            .all()
        )
    for parent_id in parents:
        try:
            with transaction() as s:
                phase = s.execute(select(S.phase).where(S.id == parent_id).with_for_update()).scalar_one()
                if phase in STOPPED_PHASES:  # re-checked under the lock
                    report.suppressed += suppress_parent(s, parent_id)
        except Exception:
            log.error("event=scan_suppress_failed parent=%s", parent_id, exc_info=True)


def _not_stopped(model: Any) -> Any:
    return or_(model.phase.is_(None), model.phase.not_in(STOPPED_PHASES))


def _reserve_batch(s: Session, reserve_seconds: float, pass_started: datetime) -> list[Any]:
    """Reserve up to BATCH dead executions; returns (id, epoch, parent_session_id) rows.

    NOTE: "dead" is judged at ``pass_started``: a reservation this pass wrote lapses only
    after it, so a pass longer than its reservations never takes its own rows again."""
    settings = get_settings()
    now = pass_started
    # Past deadline + grace: taken even from a live owner (a stuck worker must not hold it).
    overdue = now - timedelta(seconds=settings.SUBAGENT_TIMEOUT_SECONDS + settings.SUBAGENT_CANCEL_GRACE_SECONDS)
    Parent = S.__table__.alias("parent")
    candidates = (
        select(E.id)
        .join(Parent, Parent.c.id == E.parent_session_id)
        .where(
            E.delivery_status == DeliveryStatus.PENDING,
            E.status.in_(ACTIVE_EXECUTION),
            or_(lease_free(E, now), E.started_at < overdue),
            or_(Parent.c.phase.is_(None), Parent.c.phase.not_in(STOPPED_PHASES)),
        )
        .order_by(E.id)
        .limit(BATCH)
        .with_for_update(of=E, skip_locked=True)
    )
    unclaimed = and_(E.status == ExecutionStatus.RECOVERING, E.lease_owner.is_(None))
    return list(
        s.execute(
            update(E)
            .where(E.id.in_(candidates.scalar_subquery()))
            .values(
                status=ExecutionStatus.RECOVERING,
                epoch=case((unclaimed, E.epoch), else_=E.epoch + 1),
                lease_owner=None,
                lease_generation=None,
                lease_expires_at=utcnow() + timedelta(seconds=reserve_seconds),
            )
            .returning(E.id, E.epoch, E.parent_session_id)
            .execution_options(synchronize_session=False)
        ).all()
    )


def release_dead_parents(s: Session, parent_ids: Sequence[int]) -> dict[int, int]:
    """Parents whose own lease lapsed (they died before yielding): epoch + 1, RESUMING, no
    owner. Returns every given parent's current epoch, whether released now or already free;
    a parent still leased by a live loop keeps its epoch (its loop yields with it)."""
    now = utcnow()
    reserve = 2 * get_settings().LEASE_SECONDS
    s.execute(
        update(S)
        .where(
            S.id.in_(parent_ids),
            S.lease_owner.is_not(None),
            lease_free(S, now),
            _not_stopped(S),
        )
        .values(
            phase=Phase.RESUMING,
            epoch=S.epoch + 1,
            lease_owner=None,
            lease_generation=None,
            lease_expires_at=now + timedelta(seconds=reserve),
            updated_at=now,
        )
        .execution_options(synchronize_session=False)
    )
    # A waiting parent (no owner) keeps its epoch — the chord callback it was handed stays
    # valid — and shows that recovery owns its round (RESUMING, shown as RUNNING).
    s.execute(
        update(S)
        .where(S.id.in_(parent_ids), S.lease_owner.is_(None), S.phase == Phase.RUNNING)
        .values(phase=Phase.RESUMING, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    return {int(i): int(e) for i, e in s.execute(select(S.id, S.epoch).where(S.id.in_(parent_ids))).all()}


def _recover_dead_executions(scheduler: RecoveryScheduler, report: ScanReport) -> None:
    reserve_seconds = 2 * get_settings().LEASE_SECONDS
    pass_started = utcnow()
    while True:
        with transaction() as s:
            rows = _reserve_batch(s, reserve_seconds, pass_started)
            by_parent: dict[int, list[tuple[int, int]]] = defaultdict(list)
            for eid, epoch, parent_id in rows:
                by_parent[int(parent_id)].append((int(eid), int(epoch)))
            epochs = release_dead_parents(s, list(by_parent)) if by_parent else {}
        if not rows:
            return
        crash_point("scan.after_take_parent")
        rounds = [(pid, epochs[pid], sorted(children)) for pid, children in sorted(by_parent.items())]
        for pid, _, children in rounds:
            report.parents.append(pid)
            report.recovering += [eid for eid, _ in children]
            log.info(
                "event=parent_recovery_wait parent=%s childExecutions=%s",
                pid,
                ",".join(str(eid) for eid, _ in children),
            )
        scheduler.recover_many(rounds)
        if len(rows) < BATCH:
            return


def _deliver_waiting_rounds(scheduler: RecoveryScheduler, report: ScanReport, grace_seconds: float | None) -> None:
    settings = get_settings()
    now = utcnow()
    grace = timedelta(seconds=settings.LEASE_SECONDS if grace_seconds is None else grace_seconds)
    with transaction() as s:
        rows = s.execute(
            select(E.parent_session_id, func.array_agg(E.id) if _pg(s) else func.group_concat(E.id))
            .join(S, S.id == E.parent_session_id)
            .where(E.delivery_status == DeliveryStatus.PENDING, _not_stopped(S))
            .group_by(E.parent_session_id)
            .having(
                and_(
                    func.sum(case((E.status.in_(ACTIVE_EXECUTION), 1), else_=0)) == 0,
                    or_(func.max(E.completed_at).is_(None), func.max(E.completed_at) <= now - grace),
                )
            )
        ).all()
        if not rows:
            return
        parent_ids = [int(r[0]) for r in rows]
        epochs = release_dead_parents(s, parent_ids)
        owners = dict(s.execute(select(S.id, S.lease_owner).where(S.id.in_(parent_ids))).all())
    batch = []
    for parent_id, ids in rows:
        if owners.get(parent_id) is not None:
            report.waiting.append(parent_id)  # its loop still holds it (it yields with the epoch)
            continue
        report.parents.append(parent_id)
        report.delivering += [int(i) for i in (ids if isinstance(ids, list) else str(ids).split(","))]
        batch.append((int(parent_id), epochs[parent_id]))
    if batch:
        scheduler.deliver_many(batch)


def _pg(s: Session) -> bool:
    return s.get_bind().dialect.name == "postgresql"


def _nothing_pending() -> tuple[Any, ...]:
    return (
        ~exists().where(E.parent_session_id == S.id, E.delivery_status == DeliveryStatus.PENDING),
        ~exists().where(PendingRound.session_id == S.id, PendingRound.closed_at.is_(None)),
    )


def _resume_plain_sessions(scheduler: RecoveryScheduler, report: ScanReport) -> None:
    now = utcnow()
    with transaction() as s:
        rows = s.execute(
            select(S.id, S.epoch)
            .where(
                S.session_type.in_((SessionType.NORMAL, SessionType.SIDE_TASK)),
                S.phase.in_(ACTIVE_PHASES),
                lease_free(S, now),
                *_nothing_pending(),
            )
            .order_by(S.id)
        ).all()
    for sid, epoch in rows:
        try:
            new_epoch = _take_plain(sid, epoch)
        except Exception:
            log.error("event=scan_session_failed session=%s", sid, exc_info=True)
            continue
        if new_epoch is not None:
            report.resumed_sessions.append(sid)
            log.info("event=session_recovery_start session=%s epoch=%s", sid, new_epoch)
            scheduler.resume_parent(sid, new_epoch)


def _take_plain(sid: int, epoch: int) -> int | None:
    """Take a plain session; "nothing pending" is part of the UPDATE (a delegation committed
    between the SELECT and here makes it miss)."""
    with transaction() as s:
        new_epoch = reserve_session(
            s,
            sid,
            expected_epoch=epoch,
            to_phase=Phase.RUNNING,
            reserve_seconds=2 * get_settings().LEASE_SECONDS,
            extra=_nothing_pending(),
        )
        if new_epoch is not None:
            cleanup_incomplete_tail(s, sid, validated_boundary(s, sid))
        return new_epoch


def take_parent(s: Session, parent_id: int, expected_epoch: int) -> int | None:
    """Recovery owns the parent: new epoch, phase RESUMING (shown as RUNNING), and a
    reservation for the delivery it hands that epoch to. None when leased or moved on."""
    return reserve_session(
        s,
        parent_id,
        expected_epoch=expected_epoch,
        to_phase=Phase.RESUMING,
        reserve_seconds=2 * get_settings().LEASE_SECONDS,
        from_phases=(None, Phase.IDLE, Phase.RUNNING, Phase.RESUMING, Phase.WAITING_USER),
    )
