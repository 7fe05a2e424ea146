"""The recovery scan (DESIGN §6 recovery path): boot (worker_ready) and beat.

One scan at a time across all workers (PostgreSQL advisory lock); every row decision is still
a compare-and-set, so two concurrent scans (or two beats) are harmless. In order:
1. PENDING executions of cancelled/terminal parents -> SUPPRESSED with the children cancelled;
   such parents are never resumed (spec §7.1.5, §7.7).
2. Per parent: recoverable executions (active, PENDING, lease expired — child phase NULL
   included — or past deadline + grace) and deliverable ones (terminal, PENDING, no live
   callback). When no execution of the parent is still live, the parent is taken (new epoch,
   phase RESUMING) and one chord is enqueued: recover_child per active execution, callback
   deliver_round. The database, not the broker, is the source of truth (I7).
3. NORMAL/SIDE_TASK sessions RUNNING/RESUMING with an expired lease and nothing pending:
   tail cleaned and resumed (spec R18). SUBAGENT sessions never take this path.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol

from sqlalchemy import exists, select, text
from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness.events import publish_status
from harness.history import cleanup_incomplete_tail, validated_boundary
from models import (
    ACTIVE_EXECUTION,
    ACTIVE_PHASES,
    STOPPED_PHASES,
    AgentSession,
    DeliveryStatus,
    PendingRound,
    Phase,
    SessionType,
    SubagentExecution,
    get_engine,
    transaction,
)
from models.base import utcnow
from models.session import reserve_session
from recovery.delivery import suppress_parent
from recovery.executions import deadline_passed_with_grace
from settings import get_settings

log = logging.getLogger("recovery.scan")

#: Key of the PostgreSQL advisory lock that serializes scans across workers.
SCAN_LOCK_KEY = 0x5CA11ED


class RecoveryScheduler(Protocol):
    def recover_children(self, parent_id: int, parent_epoch: int, children: Sequence[tuple[int, int]]) -> None:
        """chord(recover_child(eid, epoch)...) | deliver_round(parent_id, parent_epoch);
        with no children, deliver_round alone."""

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
    results may wait for their own chord callback before the scan delivers them itself."""
    started = time.monotonic()
    with scan_lock() as held:
        if not held:
            log.info("event=subagent_recovery_scan skipped=another_scan_running")
            return ScanReport(ran=False)
        report = ScanReport()
        _suppress_stopped_parents(report)
        _recover_parents(scheduler, report, callback_grace_seconds)
        _resume_plain_sessions(scheduler, report)
    log.info(
        "event=subagent_recovery_scan executions=%d parents=%d suppressed=%d waiting=%d resumed=%d durationMs=%d",
        len(report.recovering) + len(report.delivering),
        len(report.parents),
        len(report.suppressed),
        len(report.waiting),
        len(report.resumed_sessions),
        (time.monotonic() - started) * 1000,
    )
    return report


def _suppress_stopped_parents(report: ScanReport) -> None:
    E, S = SubagentExecution, AgentSession
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


@dataclass(frozen=True)
class _Pending:
    id: int
    status: str
    epoch: int
    lease_expires_at: datetime | None
    started_at: datetime
    completed_at: datetime | None


def _recover_parents(scheduler: RecoveryScheduler, report: ScanReport, grace_seconds: float | None) -> None:
    E = SubagentExecution
    now = utcnow()
    callback_grace = timedelta(seconds=get_settings().LEASE_SECONDS if grace_seconds is None else grace_seconds)
    with transaction() as s:
        rows = s.execute(
            select(E.parent_session_id, E.id, E.status, E.epoch, E.lease_expires_at, E.started_at, E.completed_at)
            .where(E.delivery_status == DeliveryStatus.PENDING)  # the partial index: O(pending)
            .order_by(E.parent_session_id, E.id)
        ).all()
    groups: dict[int, list[_Pending]] = defaultdict(list)
    for r in rows:
        groups[r.parent_session_id].append(
            _Pending(r.id, r.status, r.epoch, r.lease_expires_at, r.started_at, r.completed_at)
        )
    for parent_id, pending in groups.items():
        try:
            _recover_parent(scheduler, report, parent_id, pending, now, callback_grace)
        except Exception:
            log.error("event=scan_parent_failed parent=%s", parent_id, exc_info=True)


def _recover_parent(
    scheduler: RecoveryScheduler,
    report: ScanReport,
    parent_id: int,
    pending: list[_Pending],
    now: datetime,
    callback_grace: timedelta,
) -> None:
    recoverable: list[tuple[int, int]] = []
    live: list[int] = []
    for p in pending:
        if p.status in ACTIVE_EXECUTION:
            expired = p.lease_expires_at is None or p.lease_expires_at < now
            if expired or deadline_passed_with_grace(p.started_at):
                recoverable.append((p.id, p.epoch))
            else:
                live.append(p.id)
    terminal = [p for p in pending if p.status not in ACTIVE_EXECUTION]
    if live:
        report.waiting.append(parent_id)  # a child is still running under its lease
        return
    if not recoverable:
        last = max((p.completed_at for p in terminal if p.completed_at is not None), default=None)
        if last is not None and now - last < callback_grace:
            report.waiting.append(parent_id)  # its chord callback is probably on its way
            return
    with transaction() as s:
        parent = s.execute(select(AgentSession.epoch, AgentSession.phase).where(AgentSession.id == parent_id)).one()
        if parent.phase in STOPPED_PHASES:
            return  # step 1 of the next scan suppresses it
        new_epoch = take_parent(s, parent_id, parent.epoch)
    if new_epoch is None:
        report.waiting.append(parent_id)  # leased (running, or just handed over): not ours
        return
    crash_point("scan.after_take_parent")
    publish_status(parent_id, Phase.RESUMING)
    report.parents.append(parent_id)
    report.recovering += [eid for eid, _ in recoverable]
    report.delivering += [p.id for p in terminal]
    log.info(
        "event=parent_recovery_wait parent=%s childExecutions=%s",
        parent_id,
        ",".join(str(p.id) for p in pending),
    )
    scheduler.recover_children(parent_id, new_epoch, recoverable)


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


def _resume_plain_sessions(scheduler: RecoveryScheduler, report: ScanReport) -> None:
    S, E = AgentSession, SubagentExecution
    now = utcnow()
    with transaction() as s:
        rows = s.execute(
            select(S.id, S.epoch)
            .where(
                S.session_type.in_((SessionType.NORMAL, SessionType.SIDE_TASK)),
                S.phase.in_(ACTIVE_PHASES),
                (S.lease_expires_at.is_(None)) | (S.lease_expires_at < now),
                ~exists().where(E.parent_session_id == S.id, E.delivery_status == DeliveryStatus.PENDING),
                ~exists().where(PendingRound.session_id == S.id, PendingRound.closed_at.is_(None)),
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
    with transaction() as s:
        new_epoch = reserve_session(
            s, sid, expected_epoch=epoch, to_phase=Phase.RUNNING, reserve_seconds=2 * get_settings().LEASE_SECONDS
        )
        if new_epoch is not None:
            cleanup_incomplete_tail(s, sid, validated_boundary(s, sid))
        return new_epoch
