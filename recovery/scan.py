"""The recovery scan (docs/tasks.md, "The recovery path"): worker boot (worker_ready) and beat.

One scan at a time across all workers (the right to scan: a row with an expiry in the
database's clock, models.worker); every row decision is still a compare-and-set, so two
concurrent scans (or two beats) are harmless. In order:
1. PENDING executions of cancelled/terminal parents -> SUPPRESSED with the children cancelled;
   such parents are never resumed (R15, R21).
   Then approvals (harness.approval.backstop): overdue requests expire, those of stopped
   sessions are cancelled, and a session parked in WAITING_APPROVAL with nothing pending is
   handed back to a loop. A parked session is never dead work: the steps below skip it.
2. Dead executions, each on its own: active + PENDING whose lease lapsed
   (in the database's time), whose owner's worker name booted again (models.worker), or whose
   absolute deadline + cancel grace passed. A live sibling never holds a dead execution back:
   the barrier is delivery's (I3). Set-based, in batches walking the execution ids upwards,
   each batch one transaction of three statements on PostgreSQL: lock (the dead executions
   with their parents ``FOR UPDATE SKIP LOCKED``, then the executions), reserve (``UPDATE …
   RETURNING``: RECOVERING, epoch + 1, no owner, a reservation of two leases — except an
   unclaimed reservation of an earlier scan, which keeps its epoch: its message may just be
   late in a long queue, and bumping would make it stale over and over), release their
   parents (``UPDATE … RETURNING``: a parent whose own lease lapsed — it died before yielding —
   the same way, epoch + 1, RESUMING, no owner; a waiting one shown RESUMING).
3. Rounds whose executions are all terminal but still PENDING, whose parent waits (no owner)
   and whose last result is older than the callback grace: their delivery is asked for again.
4. NORMAL/SIDE_TASK sessions RUNNING/RESUMING with a lapsed lease and nothing pending:
   tail cleaned and resumed (R18), in batches: the rows locked first (SKIP LOCKED), then
   "nothing pending" read again by the reserving UPDATE, whose snapshot follows the locks.
   SUBAGENT sessions never take this path.
Before them, a PENDING execution whose status this code does not know is quarantined once.
No statement of a pass waits on a row lock another path holds: such a row is passed over,
counted (``skipped`` in the pass's log line, ``recovery_scan.skipped``) and left to a later
pass; the scan's transactions also carry a lock and a statement timeout (models.lease).
The work is handed to the scheduler in batches (recover_many / deliver_many); duplicate or
late messages lose their compare-and-set and do nothing.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import groupby
from operator import itemgetter
from typing import Any

from sqlalchemy import (
    BigInteger,
    DateTime,
    String,
    and_,
    any_,
    bindparam,
    case,
    cast,
    exists,
    func,
    or_,
    select,
    text,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, aggregate_order_by
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, aliased

from crashpoints import crash_point
from harness.delivery import suppress_parent
from harness.errors import BoundaryInvalid
from harness.events import publish_status
from harness.history import cleanup_incomplete_tail, validated_boundary
from harness.scheduler import Handed, Scheduler
from logfmt import log_event
from models import (
    ACTIVE_EXECUTION,
    ACTIVE_PHASES,
    STOPPED_PHASES,
    TERMINAL_EXECUTION,
    AgentSession,
    DeliveryStatus,
    ExecutionStatus,
    PendingRound,
    Phase,
    SessionType,
    SubagentExecution,
    lease,
    transaction,
)
from models.base import utcnow
from models.session import (
    not_stopped,
    parent_release,
    release_dead_parents,
    reservation_seconds,
    reserve_session,
    reserve_sessions,
    stop_session,
)
from models.worker import lease_free, record_scan, release_scan_right, renew_scan_right, take_scan_right
from recovery.errors import RecoveryError
from settings import get_settings

log = logging.getLogger(__name__)

#: Executions reserved per batch (one transaction, one renewal of the right to scan). Each
#: batch costs a few milliseconds beyond its rows (its commit, the renewal's commit, planning,
#: the scheduler's publish): at 10,000 crashed parents x 3, batches of 1,000 -> 5,000 took a
#: pass from 2.13 to 1.66 s (load 5). A batch of 5,000 holds its parents' rows some 100-150 ms
#: (load 1-2): a cancel or a finishing child of one of them waits that long at most.
BATCH = 5000

E, S = SubagentExecution, AgentSession


@dataclass
class ScanReport:
    ran: bool = True
    suppressed: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    recovering: list[int] = field(default_factory=list)
    delivering: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    resumed_sessions: list[int] = field(default_factory=list)
    #: Sessions parked for an approval that the pass handed back to a loop (harness.approval).
    approvals_resumed: list[int] = field(default_factory=list)
    #: Executions quarantined by this pass (a status this code does not know).
    quarantined: list[int] = field(default_factory=list)
    #: The pass stopped because its right to scan passed to another scanner.
    right_lost: bool = False
    #: Rows passed over because another path held their lock (a delivery, a cancel, a stalled
    #: transaction): the pass never waits for one, a later pass comes back for them.
    skipped: int = 0


class ScanRightLost(RecoveryError):
    """Raised when a pass finds that its right to scan has passed to another scanner (it was
    frozen or cut off longer than the right lasts); the pass stops where it is."""


def scan_right_seconds() -> float:
    """How long the right to scan lasts without a renewal (renewed before every batch and
    step): one scan interval, and never less than a lease."""
    return lease.scan_right_seconds()


class ScanRight:
    """The right to scan, held for one pass (models.worker.take_scan_right): taken in a short
    transaction of its own, renewed before every batch, given back at the end. Nothing is held
    between those transactions, so a frozen scanner blocks nobody and a lock never outlives
    its pass."""

    def __init__(self) -> None:
        from harness.loop import worker_id

        self.holder = f"{worker_id()}/{uuid.uuid4().hex[:8]}"[:128]
        self.seconds = scan_right_seconds()

    def take(self) -> bool:
        with transaction() as s:
            return take_scan_right(s, self.holder, self.seconds)

    def renew(self) -> None:
        """Raises ScanRightLost when the right passed to another scanner (even if it is free
        again now: this pass was frozen longer than its right lasted, and stops)."""
        with transaction() as s:
            if not renew_scan_right(s, self.holder, self.seconds):
                raise ScanRightLost(f"scan right of {self.holder} passed to another scanner")

    def release(self) -> None:
        with transaction() as s:
            release_scan_right(s, self.holder)


#: How often a pass that waits for the right to scan (a boot scan) asks for it again.
RIGHT_POLL_SECONDS = 0.1


def scan(
    scheduler: Scheduler, *, callback_grace_seconds: float | None = None, wait_for_right: float = 0.0
) -> ScanReport:
    """One pass. ``callback_grace_seconds`` (default LEASE_SECONDS) is how long terminal
    results may wait for their own delivery before the scan asks for it again. A pass that
    finds the right to scan held returns at once, or with ``wait_for_right`` (a boot scan,
    whose restarted worker's old leases must not wait for the next beat) runs right after the
    pass in flight, waiting at most that long."""
    right = ScanRight()
    deadline = time.monotonic() + wait_for_right
    while not right.take():
        if time.monotonic() >= deadline:
            log_event(log, "subagent_recovery_scan", skipped="another_scan_running")
            return ScanReport(ran=False)
        time.sleep(RIGHT_POLL_SECONDS)
    started, started_at = time.monotonic(), utcnow()
    report = ScanReport()
    try:
        crash_point("scan.holding_right")
        _step("quarantine", right, _quarantine_unknown_statuses, report)
        _step("suppress", right, _suppress_stopped_parents, report)
        _step("approvals", right, _act_on_approvals, scheduler, report)
        _step("recover", right, _recover_dead_executions, scheduler, report, right)
        _step("deliver", right, _deliver_waiting_rounds, scheduler, report, callback_grace_seconds)
        _step("resume", right, _resume_plain_sessions, scheduler, report, right)
    except ScanRightLost:
        report.right_lost = True
        log_event(log, "subagent_recovery_scan", logging.WARNING, stopped="scan_right_lost")
    finally:
        if not report.right_lost:
            try:
                right.release()
            except Exception:
                log_event(log, "scan_right_not_released", logging.WARNING, exc_info=True)
    duration_ms = int((time.monotonic() - started) * 1000)
    log_event(
        log,
        "subagent_recovery_scan",
        executions=len(report.recovering) + len(report.delivering),
        parents=len(report.parents),
        suppressed=len(report.suppressed),
        waiting=len(report.waiting),
        resumed=len(report.resumed_sessions),
        skipped=report.skipped,
        quarantined=len(report.quarantined),
        duration_ms=duration_ms,
    )
    try:
        with transaction() as s:
            record_scan(
                s,
                started_at=started_at,
                duration_ms=duration_ms,
                parents=len(report.parents),
                executions=len(report.recovering) + len(report.delivering),
                skipped=report.skipped,
            )
    except Exception:
        log_event(log, "scan_record_failed", logging.WARNING, exc_info=True)
    return report


def _step(name: str, right: ScanRight, fn: Any, *args: Any) -> None:
    """A step that fails is logged and the next one still runs (one bad row never stops a
    scan); a step starts only while the pass still holds the right to scan."""
    right.renew()
    try:
        fn(*args)
    except ScanRightLost:
        raise
    except Exception:
        log_event(log, "scan_step_failed", logging.ERROR, exc_info=True, step=name)


#: Every execution status this code knows: a row with another (a corrupt value, or one written
#: by a newer version) is quarantined.
KNOWN_STATUSES = tuple(str(status) for status in ExecutionStatus)


def _quarantine_unknown_statuses(report: ScanReport) -> None:
    """A PENDING execution whose status this code does not know would make its parent's delivery
    fail on every pass: it is quarantined ONCE (``quarantined_at``, an ERROR line naming it, the
    ``agent_recovery_quarantined_executions`` metric), and the scan leaves it and its parent
    alone from then on; the rest of the pass goes on. (Read as text: loading it as an
    ExecutionStatus is what fails.)"""
    status = cast(E.status, String())
    with scan_transaction() as s:
        rows = s.execute(
            update(E)
            .where(
                E.delivery_status == DeliveryStatus.PENDING, E.quarantined_at.is_(None), status.not_in(KNOWN_STATUSES)
            )
            .values(quarantined_at=utcnow())
            .returning(E.id, E.parent_session_id, status)
            .execution_options(synchronize_session=False)
        ).all()
    for eid, parent_id, unknown in rows:
        report.quarantined.append(int(eid))
        log_event(
            log, "execution_quarantined", logging.ERROR, execution_id=eid, parent_id=parent_id, status=str(unknown)[:32]
        )


def _not_quarantined() -> Any:
    """SQL: the parent (``S``) has no quarantined PENDING execution."""
    Q = aliased(E)
    return ~exists().where(
        Q.parent_session_id == S.id, Q.delivery_status == DeliveryStatus.PENDING, Q.quarantined_at.is_not(None)
    )


def _suppress_stopped_parents(report: ScanReport) -> None:
    with transaction() as s:
        parents = (
            s.execute(
                select(E.parent_session_id)
                .join(S, S.id == E.parent_session_id)
                .where(E.delivery_status == DeliveryStatus.PENDING, S.phase.in_(STOPPED_PHASES), _not_quarantined())
                .distinct()
            )
            .scalars()
            .all()
        )
    for parent_id in parents:
        try:
            with scan_transaction() as s:
                phase = s.execute(
                    select(S.phase).where(S.id == parent_id).with_for_update(skip_locked=True)
                ).scalar_one_or_none()
                if phase is None:  # held by another path: never waited for
                    report.skipped += 1
                elif phase in STOPPED_PHASES:  # re-checked under the lock
                    report.suppressed += suppress_parent(s, parent_id)
        except OperationalError as exc:
            _skipped_on_lock(report, exc, "suppress", parent_id=parent_id)
        except Exception:
            log_event(log, "scan_suppress_failed", logging.ERROR, exc_info=True, parent_id=parent_id)


def _dead(pass_started: datetime) -> Any:
    """SQL: an execution is dead at ``pass_started``: its lease is free (lapsed, never taken, or
    held by a replaced boot generation), or it is past its absolute deadline + cancel grace and
    still held by the OWNER of its normal run (RUNNING: a stuck worker must not hold it). A
    reservation the scan wrote (no owner) is never taken again before it lapses, overdue or
    not: its message may just wait in a queue, and re-sending it every pass would flood the
    queue with duplicates. Nor is a RECOVERING owner's live lease: a recovery checks the
    deadline before anything else and ends an overdue execution at once (taking it from that
    owner would only start the recovery over, pass after pass, under load); a recovered child
    that runs on is bounded by the same deadline inside its loop, and a dead recoverer's lease
    lapses.

    NOTE: "dead" is judged at ``pass_started``: a reservation this pass wrote lapses only after
    it, so a pass longer than its reservations never takes its own rows again."""
    settings = get_settings()
    overdue = pass_started - timedelta(
        seconds=settings.SUBAGENT_TIMEOUT_SECONDS + settings.SUBAGENT_CANCEL_GRACE_SECONDS
    )
    return and_(
        E.delivery_status == DeliveryStatus.PENDING,
        E.status.in_(ACTIVE_EXECUTION),
        _not_waiting_for_approval(),
        or_(
            lease_free(E, pass_started),
            and_(E.started_at < overdue, E.status == ExecutionStatus.RUNNING, E.lease_owner.is_not(None)),
        ),
    )


def _not_waiting_for_approval() -> Any:
    """SQL: the execution's child session does not wait for a human decision (WAITING_APPROVAL:
    never dead work; a decision, an expiry or a cancel hands it back, see _act_on_approvals)."""
    waiting = S.__table__.alias("waiting_child")
    return ~exists().where(waiting.c.id == E.child_session_id, waiting.c.phase == Phase.WAITING_APPROVAL)


def _act_on_approvals(scheduler: Scheduler, report: ScanReport) -> None:
    """The backstop of approvals (harness.approval.backstop): overdue requests expire, those of
    stopped sessions are cancelled, and every session parked with nothing pending any more (a
    decision made while every worker was down, a lost message) is handed back to a loop."""
    from harness.approval import backstop

    report.approvals_resumed += backstop(scheduler)


@dataclass(frozen=True)
class _Batch:
    rounds: list[tuple[int, int, list[Handed]]]  #: (parent, parent epoch, its executions reserved), by id
    cursor: int  #: the last execution id of the batch: the next one starts after it
    full: bool  #: the batch was full: more candidates may follow the cursor
    #: Dead rows up to the cursor passed over because another path held their parent's lock.
    passed_over: int = 0


def _candidates(dead: Any, after_id: int) -> Any:
    """SQL: up to BATCH dead executions with ids above ``after_id`` whose parent is not stopped,
    by id (read without locks: every rule is checked again under them)."""
    Parent = S.__table__.alias("parent")
    return (
        select(E.id, E.parent_session_id)
        .join(Parent, Parent.c.id == E.parent_session_id)
        .where(E.id > after_id, dead, not_stopped(Parent))
        .order_by(E.id)
        .limit(BATCH)
    )


def _reservation(now: Any, reserve_seconds: float) -> dict[str, Any]:
    """The values a reservation writes: RECOVERING, epoch + 1, no owner, a reservation of
    ``reserve_seconds``; an unclaimed reservation keeps its epoch (and its status) and is re-sent
    with a reservation twice as long as its last one (models.lease.reservation_expiry). Unclaimed:
    a reservation of an earlier pass (RECOVERING, no owner), or a first run still queued (epoch 0:
    no task ever took it; its creation reservation names its creator, or an earlier pass re-sent
    it); bumping either would
    make its queued message stale and send the work to the back of the same queue."""
    first_run = and_(E.epoch == 0, or_(E.lease_owner.is_not(None), E.resends > 0))
    unclaimed = or_(and_(E.status == ExecutionStatus.RECOVERING, E.lease_owner.is_(None)), first_run)
    return {
        "status": case((first_run, E.status), else_=ExecutionStatus.RECOVERING),
        "epoch": case((unclaimed, E.epoch), else_=E.epoch + 1),
        "resends": case((unclaimed, E.resends + 1), else_=0),
        "recoveries": case((unclaimed, E.recoveries), else_=E.recoveries + 1),
        "lease_owner": None,
        "lease_generation": None,
        "lease_expires_at": lease.reservation_expiry(E.resends, now, unclaimed, reserve_seconds),
    }


class _Reserver:
    """Reserves the batches of one pass: up to BATCH dead executions at a time with ids above
    a cursor (RECOVERING, epoch + 1, no owner; an unclaimed reservation keeps its epoch), and
    hands their parents over (models.session.parent_release), in the caller's transaction.

    The pass walks the execution ids upwards (keyset), so it visits each row at most once,
    whatever the backlog. Rows are locked in the one order every path uses:
    the parent row first, then its executions (no deadlock). A parent locked by a cancel,
    a delivery or a finishing child is skipped for this pass, never waited for; so is an
    execution locked by its own finishing child."""

    def __init__(self, pass_started: datetime, reserve_seconds: float) -> None:
        self.pass_started = pass_started
        self.reserve_seconds = reserve_seconds
        self._statements: tuple[Any, Any, Any] | None = None

    def batch(self, s: Session, after_id: int) -> _Batch:
        """PostgreSQL: three statements, each set-based and one round trip, built once per pass:
        lock (:meth:`_lock`), reserve (:meth:`_reserve`), release (:meth:`_release`)."""
        if not _pg(s):
            return _reserve_batch_in_steps(s, self.reserve_seconds, self.pass_started, after_id)
        if self._statements is None:
            self._statements = (self._lock(), self._reserve(), self._release())
        lock, reserve, release = self._statements
        _without_jit(s)
        cursor, seen, free, locked_ids, locked_epochs, locked = s.execute(lock, {"after_id": after_id}).one()
        passed_over = int(seen or 0) - int(locked or 0)
        if cursor is None:
            return _Batch([], after_id, False, passed_over)
        rounds: list[tuple[int, int, list[Handed]]] = []
        if free:
            now = utcnow()
            parents, ids, epochs = s.execute(reserve, {"ids": _id_array(free), "now": now}).one()
            if parents:
                parent_epoch = dict(zip(locked_ids, locked_epochs, strict=True))
                params = {"parent_ids": _id_array(sorted(set(parents))), "now": now}
                bumped_ids, bumped_epochs = s.execute(release, params).one()
                parent_epoch.update(zip(bumped_ids or (), bumped_epochs or (), strict=True))
                rounds = [
                    (parent_id, parent_epoch[parent_id], [Handed(eid, epoch) for _, eid, epoch in group])
                    for parent_id, group in groupby(zip(parents, ids, epochs, strict=True), key=itemgetter(0))
                ]
        return _Batch(rounds, int(cursor), seen == BATCH, passed_over)

    def _lock(self) -> Any:
        """Up to BATCH dead executions above the cursor (``after_id``) whose parent is not
        stopped, by id (the candidates, read without locks); their parent rows locked (SKIP
        LOCKED, the rule re-checked under the lock); then the executions of the parents locked
        (SKIP LOCKED). The row: the batch's cursor and size (the last candidate, how many), the
        executions locked, the locked parents and their epochs (arrays), and how many
        candidates had their parent locked.

        NOTE: a candidate whose parent is locked elsewhere is passed over (visited once) and
        counted: the next batch starts after the last candidate, and the pass walks again for
        what it passed over (:func:`_recover_dead_executions`). Lock order: the executions'
        lock takes only executions found in ``locked_parent``, whose rows exist only once their
        parent is locked, and it takes them
        after a sort on the execution id, which reads all of its input before it yields a row:
        every parent is locked before any execution of it. A row changed after the statement's
        snapshot and before its lock is re-read at the lock (READ COMMITTED), so the parent
        epochs returned are the ones in the locked rows."""
        dead = _dead(self.pass_started)
        candidate = (
            select(E.id, E.parent_session_id)
            .join(S, S.id == E.parent_session_id)
            .where(E.id > bindparam("after_id", type_=BigInteger()), dead, not_stopped())
            .order_by(E.id)
            .limit(BATCH)
            .cte("candidate")
        )
        # Each candidate's parent by its primary key (LATERAL): a join the planner chose from
        # its guess of the WITH part's size hashed every session of the table instead.
        locked_session = (
            select(S.id, S.epoch)
            .where(S.id == candidate.c.parent_session_id, not_stopped())
            .with_for_update(skip_locked=True)
            .lateral("locked_session")
        )
        parent = (
            select(candidate.c.id.label("execution_id"), locked_session.c.id, locked_session.c.epoch)
            .select_from(candidate.join(locked_session, true()))
            .cte("locked_parent")
        )
        # No condition on the execution here but its id: nothing but the ids found above can
        # drive this read (see _reserve's NOTE).
        free = (
            select(E.id)
            .where(E.id.in_(select(parent.c.execution_id)))
            .order_by(E.id)
            .with_for_update(skip_locked=True)
            .cte("free_execution")
        )
        return select(
            select(func.max(candidate.c.id)).scalar_subquery(),
            select(func.count()).select_from(candidate).scalar_subquery(),
            _array(free.c.id, free.c.id),
            _array(parent.c.id, parent.c.id),
            _array(parent.c.epoch, parent.c.id),
            select(func.count()).select_from(parent).scalar_subquery(),
        )

    def _reserve(self) -> Any:
        """The reservation of the executions the lock took (``ids``): an UPDATE whose WHERE
        states the dead rule again under the locks, RETURNING; the row: the executions
        reserved as (parent, id, epoch), three arrays in one order.

        NOTE: the ids come from Python as one array constant, never from a WITH part of the
        same statement. The planner knows nothing of a WITH part's size (after an upgrade day it
        guessed one row for a thousand): it joined the executions found by the dead rule's index
        to a WITH part of the ids in a nested loop, quadratic in the batch (a batch of 1,000:
        half a million comparisons, 100 ms). Against a constant it knows the size, drives the
        read by the primary key or hashes the constant: linear whatever it guesses."""
        now = bindparam("now", type_=DateTime(timezone=True))
        reserved = (
            update(E)
            .where(E.id == any_(_ids_param("ids")), _dead(self.pass_started))  # re-checked under the locks
            .values(**_reservation(now, self.reserve_seconds))
            .returning(E.id, E.epoch, E.parent_session_id)
            .cte("reserved")
        )
        order = (reserved.c.parent_session_id, reserved.c.id)
        return select(
            _array(reserved.c.parent_session_id, *order),
            _array(reserved.c.id, *order),
            _array(reserved.c.epoch, *order),
        )

    def _release(self) -> Any:
        """The hand-over of the parents with an execution reserved (``parent_ids``, all locked
        by :meth:`_lock`): models.session.parent_release, UPDATEs whose WHERE states their
        rules; the row: the parents whose epoch moved and their new epochs (arrays)."""
        which = S.id == any_(_ids_param("parent_ids"))
        lapsed, waiting = parent_release(which, bindparam("now", type_=DateTime(timezone=True)))
        bumped = lapsed.returning(S.id, S.epoch).cte("bumped_parent")
        shown = waiting.returning(S.id).cte("shown_parent")
        return select(_array(bumped.c.id, bumped.c.id), _array(bumped.c.epoch, bumped.c.id)).add_cte(shown)


def _ids_param(name: str) -> Any:
    """SQL: the bound parameter ``name`` as a bigint[] constant, from :func:`_id_array`'s text."""
    return cast(bindparam(name, type_=String()), ARRAY(BigInteger()))


def _id_array(ids: Any) -> str:
    """Ids as PostgreSQL array text: ``{1,2,3}``. NOTE: one string literal for the server to
    read, not a list for the driver to adapt one element at a time (5,000 ids: 1.3 ms against
    15 ms, client and server together)."""
    return "{" + ",".join(map(str, ids)) + "}"


def _array(column: Any, *order: Any) -> Any:
    """SQL: ``(SELECT array_agg(column ORDER BY order...) FROM its WITH part)``: NULL when empty."""
    return select(func.array_agg(aggregate_order_by(column, *order))).scalar_subquery()


def _reserve_batch_in_steps(s: Session, reserve_seconds: float, pass_started: datetime, after_id: int) -> _Batch:
    """SQLite (the embedded default) has no UPDATE inside WITH: the same steps, one statement
    each. (SQLite takes its write lock at BEGIN: nothing interleaves with them.)"""
    dead = _dead(pass_started)
    candidates = s.execute(_candidates(dead, after_id)).all()
    if not candidates:
        return _Batch([], after_id, False)
    cursor = int(candidates[-1][0])
    parents = sorted({int(p) for _, p in candidates})
    locked = set(
        s.execute(select(S.id).where(S.id.in_(parents), not_stopped()).order_by(S.id).with_for_update(skip_locked=True))
        .scalars()
        .all()
    )
    by_parent: dict[int, list[Handed]] = defaultdict(list)
    if locked:
        ids = [int(i) for i, p in candidates if int(p) in locked]
        free = select(E.id).where(E.id.in_(ids)).with_for_update(skip_locked=True)
        for eid, epoch, parent_id in s.execute(
            update(E)
            .where(E.id.in_(free.scalar_subquery()), dead)  # re-checked under the locks
            .values(**_reservation(utcnow(), reserve_seconds))
            .returning(E.id, E.epoch, E.parent_session_id)
            .execution_options(synchronize_session=False)
        ).all():
            by_parent[int(parent_id)].append(Handed(int(eid), int(epoch)))
    epochs = release_dead_parents(s, list(by_parent)) if by_parent else {}
    rounds = [(pid, epochs[pid], sorted(children)) for pid, children in sorted(by_parent.items())]
    return _Batch(rounds, cursor, len(candidates) == BATCH)


#: Follow-up walks of a pass over the dead rows it passed over because another path held their
#: parent (a finishing sibling, a delivery, a cancel: short transactions), and the wait before
#: each. Without them such a round waited for the next scan (SCAN_INTERVAL_SECONDS): a worker
#: restarted under its name, whose boot scan met a child of a round finishing, left the rest of
#: that round to the beat, 30 s later (bench/peer_dbos.py --modes restart).
FOLLOW_UP_WALKS = 3
FOLLOW_UP_WAIT_SECONDS = 0.2


def _recover_dead_executions(scheduler: Scheduler, report: ScanReport, right: ScanRight) -> None:
    """Walk the dead executions by id, batch by batch; then, while a walk passed rows over (their
    parent was locked elsewhere), walk again after a short wait, at most FOLLOW_UP_WALKS times.
    NOTE: every walk judges "dead" at the pass's start, like the first: a row an earlier walk
    reserved is not dead then (its reservation lapses after the start), so no execution is
    reserved twice by one pass, however long it runs."""
    reserver = _Reserver(utcnow(), reservation_seconds())
    for walk in range(1 + FOLLOW_UP_WALKS):
        if walk:
            time.sleep(FOLLOW_UP_WAIT_SECONDS)
            right.renew()
        if not _walk(scheduler, report, right, reserver):
            return


def _walk(scheduler: Scheduler, report: ScanReport, right: ScanRight, reserver: _Reserver) -> int:
    """One walk by id over the dead executions; returns how many it passed over (a parent
    locked elsewhere)."""
    cursor = 0
    passed_over = 0
    while True:
        with scan_transaction() as s:
            batch = reserver.batch(s, cursor)
            if batch.rounds:
                crash_point("scan.inside_batch")
        cursor = batch.cursor
        passed_over += batch.passed_over
        if batch.rounds:
            crash_point("scan.after_take_parent")
            logging_waits = log.isEnabledFor(logging.INFO)
            for pid, _, children in batch.rounds:
                report.parents.append(pid)
                report.recovering += [eid for eid, _ in children]
                if logging_waits:
                    log_event(log, "parent_recovery_wait", parent_id=pid, execution_ids=[eid for eid, _ in children])
            scheduler.recover_many(batch.rounds)
        if not batch.full:
            return passed_over
        right.renew()


def _deliver_waiting_rounds(scheduler: Scheduler, report: ScanReport, grace_seconds: float | None) -> None:
    now = utcnow()
    grace = timedelta(seconds=lease.lease_seconds() if grace_seconds is None else grace_seconds)
    # Only a parent with a terminal PENDING execution can have a round whose executions are all
    # terminal: the subquery reads PENDING rows only (idx_sae_pending: no index names status); the grouping reads
    # their executions only, not every PENDING row (after a big crash, all of them are active).
    finished = aliased(E)
    some_finished = select(finished.parent_session_id).where(
        finished.delivery_status == DeliveryStatus.PENDING, finished.status.in_(TERMINAL_EXECUTION)
    )
    with transaction() as s:
        rows = s.execute(
            select(E.parent_session_id, func.array_agg(E.id) if _pg(s) else func.group_concat(E.id))
            .join(S, S.id == E.parent_session_id)
            .where(E.delivery_status == DeliveryStatus.PENDING, E.parent_session_id.in_(some_finished), not_stopped())
            .group_by(E.parent_session_id)
            .having(
                and_(
                    func.sum(case((E.status.in_(ACTIVE_EXECUTION), 1), else_=0)) == 0,
                    func.sum(case((E.quarantined_at.is_not(None), 1), else_=0)) == 0,
                    or_(func.max(E.completed_at).is_(None), func.max(E.completed_at) <= now - grace),
                )
            )
        ).all()
        if not rows:
            return
        _bound_waits(s)
        wanted = [int(r[0]) for r in rows]
        # Lock first, never waiting (a delivery, a cancel or a stalled loop holds the others).
        parent_ids = list(
            s.execute(select(S.id).where(S.id.in_(wanted)).order_by(S.id).with_for_update(skip_locked=True)).scalars()
        )
        report.skipped += len(wanted) - len(parent_ids)
        epochs = release_dead_parents(s, parent_ids) if parent_ids else {}
        owners = dict(s.execute(select(S.id, S.lease_owner).where(S.id.in_(parent_ids))).all())
    batch = []
    for parent_id, ids in rows:
        if parent_id not in epochs:
            continue
        if owners.get(parent_id) is not None:
            report.waiting.append(parent_id)  # its loop still holds it (it yields with the epoch)
            continue
        report.parents.append(parent_id)
        report.delivering += [int(i) for i in (ids if isinstance(ids, list) else str(ids).split(","))]
        batch.append((int(parent_id), epochs[parent_id]))
    if batch:
        scheduler.deliver_many(batch)


class _Locked(Exception):
    """The row is held by another path (or gone from the rule): passed over this pass."""


@contextmanager
def scan_transaction() -> Iterator[Session]:
    """A transaction of the scan: no statement in it waits on a row lock longer than
    models.lease.lock_timeout_seconds nor runs longer than statement_timeout_seconds."""
    with transaction() as s:
        _bound_waits(s)
        yield s


def _bound_waits(s: Session) -> None:
    """PostgreSQL: the bounds of a scan statement for the rest of this transaction."""
    if _pg(s):
        lock_ms = int(lease.lock_timeout_seconds() * 1000)
        statement_ms = int(lease.statement_timeout_seconds() * 1000)
        s.execute(text(f"SET LOCAL lock_timeout = {lock_ms}; SET LOCAL statement_timeout = {statement_ms}"))


#: SQLSTATEs of a wait the server cut: lock_not_available (lock_timeout), query_canceled
#: (statement_timeout).
_CUT_WAITS = ("55P03", "57014")


def _skipped_on_lock(report: ScanReport, exc: OperationalError, step: str, **ids: Any) -> None:
    """A row whose lock wait (or statement) the server cut is passed over and counted; any other
    database error is an infrastructure fault of this row, logged, never a result."""
    code = getattr(exc.orig, "pgcode", None)
    if code in _CUT_WAITS:
        report.skipped += 1
        log_event(log, "scan_row_skipped", logging.WARNING, step=step, reason="lock_timeout", **ids)
    else:
        log_event(log, "scan_row_failed", logging.ERROR, exc_info=True, step=step, **ids)


def _pg(s: Session) -> bool:
    return s.get_bind().dialect.name == "postgresql"


def _without_jit(s: Session) -> None:
    """No JIT compiling for the rest of this transaction (PostgreSQL).

    NOTE: the planner costs lease_free's EXISTS as if it ran for every row it filters (it runs
    only for a live lease), so a scan statement over some ten thousand rows crosses
    jit_above_cost and PostgreSQL compiles it first: measured at 10,000 crashed parents, 13-34
    ms of JIT for the 60-110 ms query of the resume step, and up to 72 ms for one reservation
    batch that runs in 110. Compiling never pays for statements this short."""
    if _pg(s):
        s.execute(text("SET LOCAL jit = off"))


def _nothing_pending() -> tuple[Any, ...]:
    return (
        ~exists().where(E.parent_session_id == S.id, E.delivery_status == DeliveryStatus.PENDING),
        ~exists().where(PendingRound.session_id == S.id, PendingRound.closed_at.is_(None)),
    )


#: Plain sessions reserved per batch of the resume step (one transaction, one renewal of the
#: right to scan).
RESUME_BATCH = 1000


def _resume_plain_sessions(scheduler: Scheduler, report: ScanReport, right: ScanRight) -> None:
    """Batch by batch, walking the session ids upwards: the right to scan renewed before each
    batch (the step stops where it is when the right passed to another scanner), then in one
    transaction: the candidates (read without locks), their rows locked SKIP LOCKED (a row held
    elsewhere is passed over and counted), the reservation of those locked as ONE UPDATE whose
    WHERE states the rule again with "nothing pending" (read after the locks: a delegation
    that committed meanwhile is seen), and the tails of those reserved cleaned."""
    now = utcnow()
    cursor = 0
    while True:
        with scan_transaction() as s:
            _without_jit(s)
            candidates = list(
                s.execute(
                    select(S.id)
                    .where(
                        S.id > cursor,
                        S.session_type.in_((SessionType.NORMAL, SessionType.SIDE_TASK)),
                        S.phase.in_(ACTIVE_PHASES),
                        lease_free(S, now),
                        *_nothing_pending(),
                    )
                    .order_by(S.id)
                    .limit(RESUME_BATCH)
                ).scalars()
            )
            if not candidates:
                return
            locked = list(
                s.execute(
                    select(S.id).where(S.id.in_(candidates)).order_by(S.id).with_for_update(skip_locked=True)
                ).scalars()
            )
            report.skipped += len(candidates) - len(locked)
            reserved = reserve_sessions(s, locked, to_phase=Phase.RUNNING, extra=_nothing_pending())
            failed = [sid for sid, epoch in reserved if not _clean_tail(s, sid, epoch)]
        for sid in failed:
            log_event(log, "session_stopped", logging.ERROR, session_id=sid, reason="invalid_compaction_boundary")
            publish_status(sid, Phase.FAILED)
        for sid, new_epoch in reserved:
            if sid in failed:
                continue
            report.resumed_sessions.append(sid)
            log_event(log, "session_recovery_start", session_id=sid, epoch=new_epoch)
            scheduler.resume_parent(sid, new_epoch)
        if len(candidates) < RESUME_BATCH:
            return
        cursor = candidates[-1]
        right.renew()


def _clean_tail(s: Session, sid: int, epoch: int) -> bool:
    """The incomplete tail of a session just reserved is cleaned (in a savepoint). A session
    whose compaction boundary is invalid can never get a legal history: it ends FAILED (as the
    holder of the reservation just written) instead of a take that fails on every pass; False."""
    try:
        with s.begin_nested():
            cleanup_incomplete_tail(s, sid, validated_boundary(s, sid))
        return True
    except BoundaryInvalid:
        stop_session(s, sid, epoch=epoch, to_phase=Phase.FAILED)
        return False


def _take_plain(sid: int, epoch: int) -> int | None:
    """Take ONE plain session (the resume step's rules for a single row; the step itself
    reserves in batches); "nothing pending" is part of the UPDATE (a delegation committed
    between the SELECT and here makes it miss). A session whose compaction boundary is invalid
    can never get a legal history: it ends FAILED instead of a take that rolls
    back on every pass."""
    try:
        with scan_transaction() as s:
            # Lock first, skipping a row another path holds; "nothing pending" is then read by
            # a LATER statement, whose snapshot is taken after the lock: a delegation that
            # committed while the scan looked is seen. (Checked in the take's own UPDATE after
            # waiting on the row, the subqueries kept the snapshot of before the wait, and the
            # released row of a parent whose round just committed looked free.)
            if s.execute(select(S.id).where(S.id == sid).with_for_update(skip_locked=True)).first() is None:
                raise _Locked(sid)
            new_epoch = reserve_session(
                s,
                sid,
                expected_epoch=epoch,
                to_phase=Phase.RUNNING,
                reserve_seconds=reservation_seconds(),
                extra=_nothing_pending(),
            )
            if new_epoch is not None:
                cleanup_incomplete_tail(s, sid, validated_boundary(s, sid))
            return new_epoch
    except BoundaryInvalid:
        with transaction() as s:
            stopped = stop_session(s, sid, epoch=epoch, to_phase=Phase.FAILED, require_free=True)
        if stopped:
            log_event(log, "session_stopped", logging.ERROR, session_id=sid, reason="invalid_compaction_boundary")
            publish_status(sid, Phase.FAILED)
        return None
