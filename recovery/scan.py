"""The recovery scan (docs/tasks.md, "The recovery path"): worker boot (worker_ready) and beat.

One scan at a time across all workers (the right to scan: a row with an expiry in the
database's clock, models.worker); every row decision is still a compare-and-set, so two
concurrent scans (or two beats) are harmless. In order:
1. PENDING executions of cancelled/terminal parents -> SUPPRESSED with the children cancelled;
   such parents are never resumed (R15, R21).
2. Rounds whose executions are all terminal but still PENDING, whose parent waits (no owner)
   and whose last result is older than the callback grace: their delivery is asked for again
   (right after the suppression: a delivery waits for no other step of the pass).
   Then approvals (harness.approval.backstop): overdue requests expire, those of stopped
   sessions are cancelled, and a session parked in WAITING_APPROVAL with nothing pending is
   handed back to a loop. A parked session is never dead work: the steps below skip it.
3. Dead executions, each on its own: active + PENDING whose lease lapsed
   (in the database's time), whose owner's worker name booted again (models.worker), or whose
   absolute deadline + cancel grace passed. A live sibling never holds a dead execution back:
   the barrier is delivery's (I3). Set-based, in batches walking the execution ids upwards,
   each batch one transaction of two statements on PostgreSQL (models.reservation): lock (the
   dead executions' parents ``FOR UPDATE SKIP LOCKED``, then the executions), then reserve
   (``UPDATE … RETURNING``: RECOVERING, epoch + 1, no owner, a reservation of two leases —
   except an unclaimed reservation of an earlier scan, which keeps its epoch: its message may
   just be late in a long queue, and bumping would make it stale over and over) and release
   their parents in the same statement (a parent whose own lease lapsed — it died before
   yielding — the same way, epoch + 1, RESUMING, no owner; a waiting one shown RESUMING).
   A batch cut at the statement timeout is tried again at half the size (BatchSize).
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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import String, and_, bindparam, case, cast, exists, func, or_, select, text, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, aliased

from crashpoints import crash_point
from harness.delivery import suppress_parent
from harness.errors import BoundaryInvalid
from harness.events import publish_status
from harness.history import cleanup_incomplete_tail, validated_boundary
from harness.scheduler import Scheduler
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
from models.base import UTCDateTime, utcnow
from models.db import built_once, is_postgresql
from models.reservation import ReservedBatch, Reserver, newest_first_runs
from models.session import (
    INVALID_BOUNDARY,
    lock_unheld_stmt,
    not_stopped,
    release_dead_parents_owned,
    reservation_seconds,
    reserve_session,
    reserve_sessions,
    stop_session,
)
from models.worker import (
    holds_scan_right,
    lease_free,
    record_scan,
    release_scan_right,
    renew_scan_right,
    take_scan_right,
)
from recovery.errors import RecoveryError

log = logging.getLogger(__name__)

#: Executions reserved per batch (one transaction). Each batch costs a few milliseconds beyond
#: its rows (its commit, planning, the scheduler's publish; once also a renewal's commit): at
#: 10,000 crashed parents x 3, batches of 1,000 -> 5,000 took a pass from 2.13 to 1.66 s (load
#: 5). A batch of 5,000 holds its parents' rows some 100-150 ms (load 1-2): a cancel or a
#: finishing child of one of them waits that long at most.
BATCH = 5000
#: A batch of the recover step that the server cuts at its statement timeout (a short lease, a
#: slow database) is tried again at half the size, down to BATCH >> MAX_HALVINGS rows.
MAX_HALVINGS = 8
#: Full batches that must fit at a reduced size before it doubles again (grows back gently).
GROW_AFTER_BATCHES = 4
#: SQLSTATE query_canceled: the server cut a statement at its statement_timeout.
STATEMENT_TIMEOUT = "57014"

E, S = SubagentExecution, AgentSession


class BatchSize:
    """The size of the recover step's batches in this process: BATCH rows, halved after a
    batch the server cut at its statement timeout (which the same size would meet again on
    every pass), doubled again after GROW_AFTER_BATCHES full batches fitted at a reduced size.
    Sizes are BATCH >> k, so the step's statements come in a few shapes only (each is built and
    compiled once per size)."""

    def __init__(self) -> None:
        self.halvings = 0
        self._fitted = 0

    def rows(self) -> int:
        return max(1, BATCH >> self.halvings)

    def halve(self) -> bool:
        """Halve the size; False when it is as small as it goes (the error stands)."""
        if self.halvings >= MAX_HALVINGS or self.rows() == 1:
            return False
        self.halvings += 1
        self._fitted = 0
        return True

    def fitted(self) -> None:
        """A full batch ran within the timeout: after GROW_AFTER_BATCHES of them, double."""
        if self.halvings == 0:
            return
        self._fitted += 1
        if self._fitted >= GROW_AFTER_BATCHES:
            self.halvings -= 1
            self._fitted = 0


_batch_size = BatchSize()


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
    #: First runs a boot pass left to their queued messages (:func:`_recover_dead_executions`).
    left_to_queue: int = 0


class ScanRightLost(RecoveryError):
    """Raised when a pass finds that its right to scan has passed to another scanner (it was
    frozen or cut off longer than the right lasts); the pass stops where it is."""


def scan_right_seconds() -> float:
    """How long the right to scan lasts without a renewal (renewed every third of it, checked
    before every batch and step): one scan interval, and never less than a lease."""
    return lease.scan_right_seconds()


class ScanRight:
    """The right to scan, held for one pass (models.worker.take_scan_right): taken in a short
    transaction of its own, renewed every third of its length (models.lease
    .scan_right_renewal_seconds), given back at the end. Between renewals, every batch and
    every step checks in its own first transaction (:func:`held_transaction`) that the right is
    still held (a read: no write, no commit), so that no batch runs once the right passed to
    another scanner.
    Nothing is held between those transactions, so a frozen scanner blocks nobody and a lock
    never outlives its pass.

    NOTE: a renewal is a write and a commit, a check a read in a transaction already open: a
    pass of 10,000 parents renewed 12 times (before every batch and step) where it now renews
    once at most. The time since the last renewal runs on the monotonic clock, from the moment
    before that renewal's transaction began; a host suspended meanwhile (its monotonic clock
    stood still) is caught by the check, which compares in the database's time."""

    def __init__(self) -> None:
        from harness.loop import worker_id

        self.holder = f"{worker_id()}/{uuid.uuid4().hex[:8]}"[:128]
        self.seconds = scan_right_seconds()
        self.renew_every = lease.scan_right_renewal_seconds()
        #: Monotonic time before the last take or renewal that landed.
        self._renewed_at = float("-inf")

    def take(self) -> bool:
        started = time.monotonic()
        with transaction() as s:
            took = take_scan_right(s, self.holder, self.seconds)
        if took:
            self._renewed_at = started
        return took

    def renew(self) -> None:
        """Raises ScanRightLost when the right passed to another scanner (even if it is free
        again now: this pass was frozen longer than its right lasted, and stops)."""
        started = time.monotonic()
        with transaction() as s:
            if not renew_scan_right(s, self.holder, self.seconds):
                raise ScanRightLost(f"scan right of {self.holder} passed to another scanner")
        self._renewed_at = started

    def renew_if_due(self) -> bool:
        """Renews when a third of the right has passed since the last renewal; True if it did.
        Raises ScanRightLost."""
        if time.monotonic() - self._renewed_at < self.renew_every:
            return False
        self.renew()
        return True

    def check(self, s: Session) -> None:
        """Raises ScanRightLost unless the right is still this pass's (in ``s``, a transaction of
        the pass: a batch's own, so that it never runs without the right)."""
        if not holds_scan_right(s, self.holder):
            raise ScanRightLost(f"scan right of {self.holder} passed to another scanner")

    def release(self) -> None:
        with transaction() as s:
            release_scan_right(s, self.holder)


#: How often a pass that waits for the right to scan (a boot scan) asks for it again.
RIGHT_POLL_SECONDS = 0.1


def scan(
    scheduler: Scheduler,
    *,
    callback_grace_seconds: float | None = None,
    wait_for_right: float = 0.0,
    leave_first_runs: int = 0,
) -> ScanReport:
    """One pass. ``callback_grace_seconds`` (default LEASE_SECONDS) is how long terminal
    results may wait for their own delivery before the scan asks for it again. A pass that
    finds the right to scan held returns at once, or with ``wait_for_right`` (a boot scan,
    whose restarted worker's old leases must not wait for the next beat) runs right after the
    pass in flight, waiting at most that long. ``leave_first_runs`` (a boot scan: how many
    messages the broker holds in the children's queue): up to that many of the newest first
    runs dead only because their creator's name booted again are left to their queued messages
    (:func:`_recover_dead_executions`); the report counts them (``left_to_queue``)."""
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
        _step("quarantine", _quarantine_unknown_statuses, report, right)
        _step("suppress", _suppress_stopped_parents, report, right)
        # NOTE: deliveries first: they only wait for this step (each is a short task), and the
        # steps after it take 30-70 ms even with nothing to do (bench/recovery.py
        # --delivered-only: scan -> first delivery). The rounds it delivers have no active
        # execution; the recover step reserves active ones only: neither finds the other's rows.
        _step("deliver", _deliver_waiting_rounds, scheduler, report, right, callback_grace_seconds)
        _step("approvals", _act_on_approvals, scheduler, report, right)
        _step("recover", _recover_dead_executions, scheduler, report, right, leave_first_runs)
        _step("resume", _resume_plain_sessions, scheduler, report, right)
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
        left_to_queue=report.left_to_queue,
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


def _step(name: str, fn: Any, *args: Any) -> None:
    """A step that fails is logged and the next one still runs (one bad row never stops a
    scan). A step starts only while the pass still holds the right to scan: each checks it in
    its own first transaction (:func:`held_transaction`).

    NOTE: with a short transaction of its own for the check before each step, a pass ran 7
    transactions from its start to its first hand-over, 3 of them only that check (about 1.5 ms
    each, most of it Python: a Session, its BEGIN, the read, its COMMIT)."""
    try:
        fn(*args)
    except ScanRightLost:
        raise
    except Exception:
        log_event(log, "scan_step_failed", logging.ERROR, exc_info=True, step=name)


#: Every execution status this code knows: a row with another (a corrupt value, or one written
#: by a newer version) is quarantined.
KNOWN_STATUSES = tuple(str(status) for status in ExecutionStatus)


def _quarantine_unknown_statuses(report: ScanReport, right: ScanRight) -> None:
    """A PENDING execution whose status this code does not know would make its parent's delivery
    fail on every pass: it is quarantined ONCE (``quarantined_at``, an ERROR line naming it, the
    ``agent_recovery_quarantined_executions`` metric), and the scan leaves it and its parent
    alone from then on; the rest of the pass goes on. (Read as text: loading it as an
    ExecutionStatus is what fails.)"""
    with held_transaction(right) as s:
        rows = s.execute(_quarantine_stmt(), {"b_now": utcnow()}).all()
    for eid, parent_id, unknown in rows:
        report.quarantined.append(int(eid))
        log_event(
            log, "execution_quarantined", logging.ERROR, execution_id=eid, parent_id=parent_id, status=str(unknown)[:32]
        )


@built_once
def _quarantine_stmt() -> Any:
    status = cast(E.status, String())
    return (
        update(E)
        .where(E.delivery_status == DeliveryStatus.PENDING, E.quarantined_at.is_(None), status.not_in(KNOWN_STATUSES))
        .values(quarantined_at=bindparam("b_now", type_=UTCDateTime()))
        .returning(E.id, E.parent_session_id, status)
        .execution_options(synchronize_session=False)
    )


def _not_quarantined() -> Any:
    """SQL: the parent (``S``) has no quarantined PENDING execution."""
    Q = aliased(E)
    return ~exists().where(
        Q.parent_session_id == S.id, Q.delivery_status == DeliveryStatus.PENDING, Q.quarantined_at.is_not(None)
    )


def _suppress_stopped_parents(report: ScanReport, right: ScanRight) -> None:
    with held_transaction(right, bounded=False) as s:
        parents = s.execute(_stopped_parents_stmt()).scalars().all()
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


@built_once
def _stopped_parents_stmt() -> Any:
    """The stopped parents with a PENDING execution (none quarantined)."""
    return (
        select(E.parent_session_id)
        .join(S, S.id == E.parent_session_id)
        .where(E.delivery_status == DeliveryStatus.PENDING, S.phase.in_(STOPPED_PHASES), _not_quarantined())
        .distinct()
    )


def _act_on_approvals(scheduler: Scheduler, report: ScanReport, right: ScanRight) -> None:
    """The backstop of approvals (harness.approval.backstop): overdue requests expire, those of
    stopped sessions are cancelled, and every session parked with nothing pending any more (a
    decision made while every worker was down, a lost message) is handed back to a loop."""
    from harness.approval import backstop

    report.approvals_resumed += backstop(scheduler, lambda: held_transaction(right, bounded=False))


#: Follow-up walks of a pass over the dead rows it passed over because another path held their
#: parent (a finishing sibling, a delivery, a cancel: short transactions), and the wait before
#: the first (doubled before each next: 0.05, 0.1, 0.2, 0.4 s, 0.75 s in all). Without them such
#: a round waited for the next scan (SCAN_INTERVAL_SECONDS): a worker restarted under its name,
#: whose boot scan met a child of a round finishing, left the rest of that round to the beat,
#: 30 s later (bench/peer_dbos.py --modes restart). NOTE: the wait holds a pool process of the
#: worker that restarts; the lock it waits out is a finishing child's transaction (milliseconds),
#: so the first wait is short: 0.2 s at every walk held it 0.2 s at least, 0.6 s at most.
FOLLOW_UP_WALKS = 4
FOLLOW_UP_WAIT_SECONDS = 0.05


def _recover_dead_executions(
    scheduler: Scheduler, report: ScanReport, right: ScanRight, leave_first_runs: int = 0
) -> None:
    """Walk the dead executions by id, batch by batch; then, while a walk passed rows over (their
    parent was locked elsewhere), walk again after a short wait (doubled each time), at most
    FOLLOW_UP_WALKS times.
    NOTE: every walk judges "dead" at the pass's start, like the first: a row an earlier walk
    reserved is not dead then (its reservation lapses after the start), so no execution is
    reserved twice by one pass, however long it runs.

    ``leave_first_runs`` (a boot pass: the messages the broker holds in the children's queue):
    a worker restarted under its name makes every child it created and nobody took yet dead at
    once (models.worker.creation_reservation_alive): it might have died between the creation's
    commit and the message's publish. Mostly it did not, and the broker still holds those
    messages (only the worker died): re-sent at boot, each ran twice, once for nothing (a
    restart with 20 open rounds of 3: 55-57 recovery.recover_child tasks that found their row
    taken, on the pool the work needs). So the boot pass leaves the NEWEST first runs, as many
    as the queue holds messages: a queue is consumed oldest first, so the oldest are those the
    dead process had fetched (lost with it until the broker's visibility timeout), re-sent at
    once. Its task then sends a plain pass BEHIND the queued messages
    (tasks.recovery.scan_task), which re-sends whatever is still untaken when it runs: every
    message queued before it has been fetched by then. A follow-up pass that never comes (a
    crash, a broker down) costs a beat's pass at most (SCAN_INTERVAL_SECONDS): the rows stay
    dead to every pass that does not leave them."""
    started = utcnow()
    leave_from = None
    if leave_first_runs > 0:
        with scan_transaction() as s:
            leave_from, report.left_to_queue = newest_first_runs(s, started, leave_first_runs)
    reserver = Reserver(started, reservation_seconds(), limit=_batch_size.rows(), leave_from=leave_from)
    passed_over = 0
    for walk in range(1 + FOLLOW_UP_WALKS):
        if walk:
            time.sleep(FOLLOW_UP_WAIT_SECONDS * 2 ** (walk - 1))
        passed_over = _walk(scheduler, report, right, reserver)
        if not passed_over:
            return
    # Every walk visits all the rows still dead: the last one's count is what this pass left.
    report.skipped += passed_over


def _walk(scheduler: Scheduler, report: ScanReport, right: ScanRight, reserver: Reserver) -> int:
    """One walk by id over the dead executions; returns how many it passed over (a parent
    locked elsewhere). Each batch is one transaction, which checks the right to scan before it
    locks a row (unless the right was just renewed): a pass whose right passed to another
    scanner stops at its next batch. A batch the server cuts at its statement timeout is tried
    again at half the size (:class:`BatchSize`).

    NOTE: the batches are handed to the scheduler on the walk's own thread. Sent from a thread
    of their own while the next batch was reserved, a pass of 10,000 parents took as long or
    longer (0.76-0.82 s against 0.73-0.74, load 1) and cost more CPU (0.24-0.27 s against
    0.19-0.20): the two threads took turns at the GIL."""
    cursor = 0
    passed_over = 0
    while True:
        reserver.limit = _batch_size.rows()
        try:
            with held_transaction(right) as s:
                batch = reserver.batch(s, cursor)
                if batch.executions:
                    crash_point("scan.inside_batch")
        except OperationalError as exc:
            # Rolled back, nothing reserved: the same rows again, fewer at a time.
            if getattr(exc.orig, "pgcode", None) != STATEMENT_TIMEOUT or not _batch_size.halve():
                raise
            log_event(log, "scan_batch_halved", logging.WARNING, rows=_batch_size.rows(), after_id=cursor)
            continue
        if batch.full:
            _batch_size.fitted()
        cursor = batch.cursor
        passed_over += batch.passed_over
        if batch.executions:
            crash_point("scan.after_take_parent")
            _hand_over(scheduler, report, batch)
        if not batch.full:
            return passed_over


def _hand_over(scheduler: Scheduler, report: ScanReport, batch: ReservedBatch) -> None:
    rounds = batch.rounds
    report.parents.extend(pid for pid, _, _ in rounds)
    report.recovering.extend(batch.reserved[1])  # the rounds' ids, in the rounds' order
    if log.isEnabledFor(logging.INFO):
        for pid, _, children in rounds:
            log_event(log, "parent_recovery_wait", parent_id=pid, execution_ids=[eid for eid, _ in children])
    scheduler.recover_many(rounds)


def _deliver_waiting_rounds(
    scheduler: Scheduler, report: ScanReport, right: ScanRight, grace_seconds: float | None
) -> None:
    grace = timedelta(seconds=lease.lease_seconds() if grace_seconds is None else grace_seconds)
    with held_transaction(right, bounded=False) as s:
        pg = is_postgresql(s)
        rows = s.execute(_waiting_rounds_stmt(pg), {"b_cutoff": utcnow() - grace}).all()
        if not rows:
            return
        _bound_waits(s)
        wanted = [int(r[0]) for r in rows]
        # Lock first, never waiting (a delivery, a cancel or a stalled loop holds the others).
        parent_ids = list(s.execute(lock_unheld_stmt(), {"b_ids": wanted}).scalars())
        report.skipped += len(wanted) - len(parent_ids)
        released = release_dead_parents_owned(s, parent_ids) if parent_ids else {}
    batch = []
    for parent_id, ids in rows:
        if parent_id not in released:
            continue
        epoch, owner = released[parent_id]
        if owner is not None:
            report.waiting.append(parent_id)  # its loop still holds it (it yields with the epoch)
            continue
        report.parents.append(parent_id)
        report.delivering += [int(i) for i in (ids if isinstance(ids, list) else str(ids).split(","))]
        batch.append((int(parent_id), epoch))
    if batch:
        scheduler.deliver_many(batch)


@built_once
def _waiting_rounds_stmt(pg: bool) -> Any:
    """The parents whose rounds wait for their delivery: (parent id, its PENDING executions'
    ids), each execution terminal, none quarantined, the last completed before ``b_cutoff`` (the
    callback grace). Only a parent with a terminal PENDING execution can have a round whose
    executions are all terminal: the subquery reads PENDING rows only (idx_sae_pending: no index
    names status); the grouping reads their executions only, not every PENDING row (after a big
    crash, all of them are active)."""
    finished = aliased(E)
    some_finished = select(finished.parent_session_id).where(
        finished.delivery_status == DeliveryStatus.PENDING, finished.status.in_(TERMINAL_EXECUTION)
    )
    cutoff = bindparam("b_cutoff", type_=UTCDateTime())
    return (
        select(E.parent_session_id, func.array_agg(E.id) if pg else func.group_concat(E.id))
        .join(S, S.id == E.parent_session_id)
        .where(E.delivery_status == DeliveryStatus.PENDING, E.parent_session_id.in_(some_finished), not_stopped())
        .group_by(E.parent_session_id)
        .having(
            and_(
                func.sum(case((E.status.in_(ACTIVE_EXECUTION), 1), else_=0)) == 0,
                func.sum(case((E.quarantined_at.is_not(None), 1), else_=0)) == 0,
                or_(func.max(E.completed_at).is_(None), func.max(E.completed_at) <= cutoff),
            )
        )
    )


class _Locked(Exception):
    """The row is held by another path (or gone from the rule): passed over this pass."""


@contextmanager
def scan_transaction() -> Iterator[Session]:
    """A transaction of the scan: no statement in it waits on a row lock longer than
    models.lease.lock_timeout_seconds nor runs longer than statement_timeout_seconds."""
    with transaction() as s:
        _bound_waits(s)
        yield s


@contextmanager
def held_transaction(right: ScanRight, *, bounded: bool = True) -> Iterator[Session]:
    """A transaction of a step that runs only while the pass holds the right to scan: renewed
    before it when due, otherwise checked in it (a read, no transaction of its own); raises
    ScanRightLost. ``bounded``: a :func:`scan_transaction` (its statements' waits bounded),
    otherwise a plain one (a read that locks nothing)."""
    renewed = right.renew_if_due()
    with scan_transaction() if bounded else transaction() as s:
        if not renewed:
            right.check(s)
        yield s


def _bound_waits(s: Session) -> None:
    """PostgreSQL: the bounds of a scan statement for the rest of this transaction, and no JIT
    compiling; one round trip.

    NOTE: the planner costs lease_free's EXISTS as if it ran for every row it filters (it runs
    only for a live lease), so a scan statement over some ten thousand rows crosses
    jit_above_cost and PostgreSQL compiles it first: measured at 10,000 crashed parents, 13-34
    ms of JIT for the 60-110 ms query of the resume step, and up to 72 ms for one reservation
    batch that runs in 110. Compiling never pays for statements this short."""
    if is_postgresql(s):
        lock_ms = int(lease.lock_timeout_seconds() * 1000)
        statement_ms = int(lease.statement_timeout_seconds() * 1000)
        bounds = f"SET LOCAL lock_timeout = {lock_ms}; SET LOCAL statement_timeout = {statement_ms}"
        s.execute(text(f"{bounds}; SET LOCAL jit = off"))


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


def _nothing_pending() -> tuple[Any, ...]:
    return (
        ~exists().where(E.parent_session_id == S.id, E.delivery_status == DeliveryStatus.PENDING),
        ~exists().where(PendingRound.session_id == S.id, PendingRound.closed_at.is_(None)),
    )


#: Plain sessions reserved per batch of the resume step (one transaction).
RESUME_BATCH = 1000


def _resume_plain_sessions(scheduler: Scheduler, report: ScanReport, right: ScanRight) -> None:
    """Batch by batch, walking the session ids upwards, in one transaction each: the right to
    scan checked (renewed before, when due; the step stops where it is when the right passed to
    another scanner), the candidates (read without locks), their rows locked SKIP LOCKED (a row held
    elsewhere is passed over and counted), the reservation of those locked as ONE UPDATE whose
    WHERE states the rule again with "nothing pending" (read after the locks: a delegation
    that committed meanwhile is seen), and the tails of those reserved cleaned."""
    now = utcnow()
    cursor = 0
    while True:
        with held_transaction(right) as s:
            stmt = _plain_candidates_stmt(RESUME_BATCH)
            candidates = list(s.execute(stmt, {"b_cursor": cursor, "b_now": now}).scalars())
            if not candidates:
                return
            locked = list(s.execute(lock_unheld_stmt(), {"b_ids": candidates}).scalars())
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


@built_once
def _plain_candidates_stmt(limit: int) -> Any:
    """The resume step's candidates: plain sessions above ``b_cursor`` with an active phase,
    a lease free at ``b_now`` and nothing pending (read without locks), ``limit`` at most."""
    return (
        select(S.id)
        .where(
            S.id > bindparam("b_cursor"),
            S.session_type.in_((SessionType.NORMAL, SessionType.SIDE_TASK)),
            S.phase.in_(ACTIVE_PHASES),
            lease_free(S, bindparam("b_now", type_=UTCDateTime())),
            *_nothing_pending(),
        )
        .order_by(S.id)
        .limit(limit)
    )


def _clean_tail(s: Session, sid: int, epoch: int) -> bool:
    """The incomplete tail of a session just reserved is cleaned (in a savepoint). A session
    whose compaction boundary is invalid can never get a legal history: it ends FAILED (as the
    holder of the reservation just written) instead of a take that fails on every pass; False."""
    try:
        with s.begin_nested():
            cleanup_incomplete_tail(s, sid, validated_boundary(s, sid))
        return True
    except BoundaryInvalid:
        stop_session(s, sid, epoch=epoch, to_phase=Phase.FAILED, reason=INVALID_BOUNDARY)
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
            stopped = stop_session(
                s, sid, epoch=epoch, to_phase=Phase.FAILED, require_free=True, reason=INVALID_BOUNDARY
            )
        if stopped:
            log_event(log, "session_stopped", logging.ERROR, session_id=sid, reason="invalid_compaction_boundary")
            publish_status(sid, Phase.FAILED)
        return None
