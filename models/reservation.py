"""The scan's reservation of dead executions (docs/tasks.md, "The recovery path"), as transitions.

``dead_at`` is the rule that says an execution's work is lost; ``reservation_values`` what a
reservation writes (RECOVERING, epoch + 1, no owner, a reservation of two leases; an unclaimed
reservation keeps its epoch); :class:`Reserver` reserves one batch of them in the caller's
transaction and hands their parents over (models.session.parent_release). Every state change
is a compare-and-set: the reserving UPDATE's WHERE states the dead rule again under the locks,
and what it returns is what landed. recovery.scan walks the batches and sends the work.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cached_property
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
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, aggregate_order_by
from sqlalchemy.orm import Session

from models import lease
from models.base import utcnow
from models.db import built_once, is_postgresql
from models.enums import ACTIVE_EXECUTION, DeliveryStatus, ExecutionStatus, Phase
from models.execution import SubagentExecution
from models.session import AgentSession, lock_unheld_stmt, not_stopped, parent_release, release_dead_parents
from models.worker import creation_reservation_alive, lease_free
from settings import get_settings

E, S = SubagentExecution, AgentSession


def dead_at(pass_started: Any, overdue: Any = None, *, leave_from: Any = None) -> Any:
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
    it, so a pass longer than its reservations never takes its own rows again.

    ``pass_started`` is a time, or a bound parameter; then ``overdue`` is one too, whose value
    is :func:`overdue_before` of the pass's start (a statement built once for every pass).

    ``leave_from`` (an execution id, or a bound parameter): a first run with an id from there up
    whose creation reservation still runs (models.worker.creation_reservation_alive: dead only
    because its creator's name booted again) is not dead to this pass: a boot pass leaves those
    to their messages still queued in the broker (recovery.scan)."""
    if overdue is None:
        overdue = overdue_before(pass_started)
    left = () if leave_from is None else (~and_(creation_reservation_alive(E, pass_started), E.id >= leave_from),)
    return and_(
        E.delivery_status == DeliveryStatus.PENDING,
        E.status.in_(ACTIVE_EXECUTION),
        _not_waiting_for_approval(),
        or_(
            lease_free(E, pass_started),
            and_(E.started_at < overdue, E.status == ExecutionStatus.RUNNING, E.lease_owner.is_not(None)),
        ),
        *left,
    )


def newest_first_runs(s: Session, pass_started: datetime, newest: int) -> tuple[int | None, int]:
    """The ``newest`` (by id) dead executions whose creation reservation still runs (see
    :func:`dead_at`): the lowest of their ids (None: there is none) and how many they are."""
    ids = (
        select(E.id)
        .where(dead_at(pass_started), creation_reservation_alive(E, pass_started))
        .order_by(E.id.desc())
        .limit(newest)
        .subquery()
    )
    lowest, count = s.execute(select(func.min(ids.c.id), func.count()).select_from(ids)).one()
    return (None if lowest is None else int(lowest)), int(count)


def overdue_before(pass_started: datetime) -> datetime:
    """An execution started before this is past its absolute deadline + cancel grace."""
    settings = get_settings()
    return pass_started - timedelta(seconds=settings.SUBAGENT_TIMEOUT_SECONDS + settings.SUBAGENT_CANCEL_GRACE_SECONDS)


#: The pass's start and its overdue bound in the statements built once (:func:`dead_at`).
_PASS_STARTED = bindparam("pass_started", type_=DateTime(timezone=True))
#: The lowest id of the first runs a boot pass leaves (:func:`dead_at`).
_LEAVE_FROM = bindparam("leave_from", type_=BigInteger())
_OVERDUE = bindparam("overdue", type_=DateTime(timezone=True))


def _not_waiting_for_approval() -> Any:
    """SQL: the execution's child session does not wait for a human decision (WAITING_APPROVAL:
    never dead work; a decision, an expiry or a cancel hands it back: the scan's approvals step)."""
    waiting = S.__table__.alias("waiting_child")
    return ~exists().where(waiting.c.id == E.child_session_id, waiting.c.phase == Phase.WAITING_APPROVAL)


@dataclass(frozen=True)
class ReservedBatch:
    """One batch reserved: where the walk goes on, and what landed. The rounds are built on
    first use, after the batch's transaction."""

    cursor: int  #: the last execution id of the batch: the next one starts after it
    full: bool  #: the batch was full: more candidates may follow the cursor
    #: Dead rows up to the cursor passed over because another path held their parent's lock.
    passed_over: int = 0
    #: The executions reserved as three lists in one order (by parent, then id): their parents,
    #: ids and epochs.
    reserved: tuple[list[int], list[int], list[int]] = ([], [], [])
    #: The epoch of every parent of the batch after the hand-over.
    parent_epochs: dict[int, int] = field(default_factory=dict)

    @property
    def executions(self) -> int:
        """How many executions the batch reserved."""
        return len(self.reserved[1])

    @cached_property
    def rounds(self) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """(parent, parent epoch, its executions reserved as (id, epoch)), by parent id."""
        parents, ids, epochs = self.reserved
        return [
            (parent_id, self.parent_epochs[parent_id], [(eid, epoch) for _, eid, epoch in group])
            for parent_id, group in groupby(zip(parents, ids, epochs, strict=True), key=itemgetter(0))
        ]


def _candidates(dead: Any, after_id: int, limit: int) -> Any:
    """SQL: up to ``limit`` dead executions with ids above ``after_id`` whose parent is not stopped,
    by id (read without locks: every rule is checked again under them)."""
    Parent = S.__table__.alias("parent")
    return (
        select(E.id, E.parent_session_id)
        .join(Parent, Parent.c.id == E.parent_session_id)
        .where(E.id > after_id, dead, not_stopped(Parent))
        .order_by(E.id)
        .limit(limit)
    )


def reservation_values(now: Any, reserve_seconds: float) -> dict[str, Any]:
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


class Reserver:
    """Reserves the batches of one pass: up to ``limit`` dead executions at a time with ids above
    a cursor (RECOVERING, epoch + 1, no owner; an unclaimed reservation keeps its epoch), and
    hands their parents over (models.session.parent_release), in the caller's transaction.

    The pass walks the execution ids upwards (keyset), so it visits each row at most once,
    whatever the backlog. Rows are locked in the one order every path uses:
    the parent row first, then its executions (no deadlock). A parent locked by a cancel,
    a delivery or a finishing child is skipped for this pass, never waited for; so is an
    execution locked by its own finishing child."""

    def __init__(
        self, pass_started: datetime, reserve_seconds: float, *, limit: int, leave_from: int | None = None
    ) -> None:
        self.pass_started = pass_started
        self.reserve_seconds = reserve_seconds
        self.limit = limit
        #: First runs from this id up held only by a creator that booted again are left alone
        #: (:func:`dead_at`).
        self.leave_from = leave_from
        self._pass: dict[str, Any] = {"pass_started": pass_started, "overdue": overdue_before(pass_started)}
        if leave_from is not None:
            self._pass["leave_from"] = leave_from

    def batch(self, s: Session, after_id: int) -> ReservedBatch:
        """PostgreSQL: two statements, each set-based and one round trip, built once per
        process: lock (:func:`_lock`), then reserve and release (:func:`_reserve`). The caller's
        transaction turns JIT off (recovery.scan's transactions do: its statements are too short
        to pay for compiling)."""
        if not is_postgresql(s):
            return _reserve_batch_in_steps(
                s, self.reserve_seconds, self.pass_started, after_id, self.limit, self.leave_from
            )
        leaving = self.leave_from is not None
        lock, reserve = _lock(self.limit, leaving), _reserve(self.reserve_seconds, leaving)
        cursor, seen, free, locked_ids, locked_epochs, passed = s.execute(
            lock, {"after_id": after_id, **self._pass}
        ).one()
        passed_over = int(passed or 0)
        if cursor is None:
            return ReservedBatch(after_id, False, passed_over)
        if not free:
            return ReservedBatch(int(cursor), seen == self.limit, passed_over)
        # NOTE: ``free`` is the array's text, handed back as it came (never parsed here).
        params = {"ids": free, "now": utcnow(), **self._pass}
        parents, ids, epochs, bumped_ids, bumped_epochs = s.execute(reserve, params).one()
        parent_epochs = dict(zip(locked_ids, locked_epochs, strict=True))
        parent_epochs.update(zip(bumped_ids or (), bumped_epochs or (), strict=True))
        reserved = (parents or [], ids or [], epochs or [])
        return ReservedBatch(int(cursor), seen == self.limit, passed_over, reserved, parent_epochs)


@built_once
def _lock(limit: int, leaving: bool = False) -> Any:
    """Up to ``limit`` dead executions above the cursor (``after_id``), by id (the
    candidates, read without locks); their parent rows locked, each once, unless stopped
    (SKIP LOCKED, the rule checked under the lock); then the executions of the parents
    locked (SKIP LOCKED). The row: the batch's cursor and size (the last candidate, how
    many), the executions locked, the locked parents and their epochs (arrays), and how
    many candidates were passed over: their parent not locked here, yet not stopped.

    NOTE: a candidate whose parent is locked elsewhere is passed over (visited once) and
    counted: the next batch starts after the last candidate, and the pass walks again for
    what it passed over (recovery.scan). A candidate of a stopped parent (the pass's first
    step suppresses those; one left by a race or a quarantined sibling) is neither locked
    nor counted: the candidates read no session, which costs a lookup per candidate, and
    only those whose parent was not locked are looked at again. Lock order: the
    executions' lock reads its ids from an array that the join of the candidates with
    ``locked_parent`` builds in full (an InitPlan, evaluated before the first execution is
    read): every parent is locked before any execution. Both locks drive their reads by the
    primary key from an array (``= ANY``): no join whose plan rests on the planner's guess
    of a WITH part's size (a join of the candidates with the sessions, so planned, hashed
    every session of the table). A row changed after the statement's snapshot and before
    its lock is re-read at the lock (READ COMMITTED), so the parent epochs returned are the
    ones in the locked rows."""
    dead = dead_at(_PASS_STARTED, _OVERDUE, leave_from=_LEAVE_FROM if leaving else None)
    candidate = (
        select(E.id, E.parent_session_id)
        .where(E.id > bindparam("after_id", type_=BigInteger()), dead)
        .order_by(E.id)
        .limit(limit)
        .cte("candidate")
    )
    parent = (
        select(S.id, S.epoch)
        .where(S.id == any_(_ids(_array(candidate.c.parent_session_id.distinct()))), not_stopped())
        .with_for_update(skip_locked=True)
        .cte("locked_parent")
    )
    of_locked = candidate.join(parent, parent.c.id == candidate.c.parent_session_id)
    free = (
        select(E.id)
        .where(E.id == any_(_ids(select(func.array_agg(candidate.c.id)).select_from(of_locked).scalar_subquery())))
        .order_by(E.id)
        .with_for_update(skip_locked=True)
        .cte("free_execution")
    )
    # Passed over: a candidate whose parent is not locked here and not stopped. The parents
    # not locked (few) are looked up by primary key from an array, like the locks: a join
    # of the candidates with the sessions would be planned from a guess again.
    unlocked = (
        select(func.array_agg(candidate.c.parent_session_id.distinct()))
        .where(~exists().where(parent.c.id == candidate.c.parent_session_id))
        .scalar_subquery()
    )
    held = S.__table__.alias("held_parent")
    held_elsewhere = (
        select(func.array_agg(held.c.id)).where(held.c.id == any_(_ids(unlocked)), not_stopped(held)).scalar_subquery()
    )
    passed_over = (
        select(func.count())
        .select_from(candidate)
        .where(candidate.c.parent_session_id == any_(_ids(held_elsewhere)))
        .scalar_subquery()
    )
    return select(
        select(func.max(candidate.c.id)).scalar_subquery(),
        select(func.count()).select_from(candidate).scalar_subquery(),
        cast(_array(free.c.id, free.c.id), String()),
        _array(parent.c.id, parent.c.id),
        _array(parent.c.epoch, parent.c.id),
        passed_over,
    )


@built_once
def _reserve(reserve_seconds: float, leaving: bool = False) -> Any:
    """The reservation of the executions the lock took (``ids``): an UPDATE whose WHERE
    states the dead rule again under the locks, RETURNING; then the hand-over of their
    parents (all locked by :func:`_lock`): models.session.parent_release, UPDATEs whose
    WHERE states their rules. One statement, whose snapshot follows the locks (the dead
    rule's subqueries see what committed before them). The row: the executions reserved
    as (parent, id, epoch), three arrays in one order; the parents whose epoch moved and
    their new epochs (arrays).

    NOTE: the ids come from Python as one array constant, never from a join with a WITH
    part of the same statement. The planner knows nothing of a WITH part's size (after an
    upgrade day it guessed one row for a thousand): it joined the executions found by the
    dead rule's index to a WITH part of the ids in a nested loop, quadratic in the batch (a
    batch of 1,000: half a million comparisons, 100 ms). Against a constant it knows the
    size, drives the read by the primary key or hashes the constant: linear whatever it
    guesses. The parents are read the same way, by the primary key from an array of the
    reserved rows' parents (``= ANY``, no join)."""
    now = bindparam("now", type_=DateTime(timezone=True))
    dead = dead_at(_PASS_STARTED, _OVERDUE, leave_from=_LEAVE_FROM if leaving else None)
    reserved = (
        update(E)
        .where(E.id == any_(_ids_param("ids")), dead)  # re-checked under the locks
        .values(**reservation_values(now, reserve_seconds))
        .returning(E.id, E.epoch, E.parent_session_id)
        .cte("reserved")
    )
    which = S.id == any_(_ids(_array(reserved.c.parent_session_id.distinct())))
    lapsed, waiting = parent_release(which, now)
    bumped = lapsed.returning(S.id, S.epoch).cte("bumped_parent")
    shown = waiting.returning(S.id).cte("shown_parent")
    order = (reserved.c.parent_session_id, reserved.c.id)
    return select(
        _array(reserved.c.parent_session_id, *order),
        _array(reserved.c.id, *order),
        _array(reserved.c.epoch, *order),
        _array(bumped.c.id, bumped.c.id),
        _array(bumped.c.epoch, bumped.c.id),
    ).add_cte(shown)


def _ids_param(name: str) -> Any:
    """SQL: the bound parameter ``name`` as a bigint[] constant, from :func:`_id_array`'s text."""
    return cast(bindparam(name, type_=String()), ARRAY(BigInteger()))


def _ids(array: Any) -> Any:
    """SQL: an array of ids computed in the statement (an ``array_agg`` subquery), as one value
    for ``= ANY`` (bare, ``= ANY (SELECT ...)`` would compare each id with the whole array)."""
    return cast(array, ARRAY(BigInteger()))


def _id_array(ids: Any) -> str:
    """Ids as PostgreSQL array text: ``{1,2,3}``. NOTE: one string literal for the server to
    read, not a list for the driver to adapt one element at a time (5,000 ids: 1.3 ms against
    15 ms, client and server together)."""
    return "{" + ",".join(map(str, ids)) + "}"


def _array(column: Any, *order: Any) -> Any:
    """SQL: ``(SELECT array_agg(column ORDER BY order...) FROM its WITH part)``: NULL when empty
    (no ``order``: in no order)."""
    aggregated = aggregate_order_by(column, *order) if order else column
    return select(func.array_agg(aggregated)).scalar_subquery()


def _reserve_batch_in_steps(
    s: Session,
    reserve_seconds: float,
    pass_started: datetime,
    after_id: int,
    limit: int,
    leave_from: int | None = None,
) -> ReservedBatch:
    """SQLite (the embedded default) has no UPDATE inside WITH: the same steps, one statement
    each. (SQLite takes its write lock at BEGIN: nothing interleaves with them.)"""
    dead = dead_at(pass_started, leave_from=leave_from)
    candidates = s.execute(_candidates(dead, after_id, limit)).all()
    if not candidates:
        return ReservedBatch(after_id, False)
    cursor = int(candidates[-1][0])
    parents = sorted({int(p) for _, p in candidates})
    locked = set(s.execute(lock_unheld_stmt((), True), {"b_ids": parents}).scalars())
    by_parent: dict[int, list[tuple[int, int]]] = defaultdict(list)
    if locked:
        ids = [int(i) for i, p in candidates if int(p) in locked]
        free = select(E.id).where(E.id.in_(ids)).with_for_update(skip_locked=True)
        for eid, epoch, parent_id in s.execute(
            update(E)
            .where(E.id.in_(free.scalar_subquery()), dead)  # re-checked under the locks
            .values(**reservation_values(utcnow(), reserve_seconds))
            .returning(E.id, E.epoch, E.parent_session_id)
            .execution_options(synchronize_session=False)
        ).all():
            by_parent[int(parent_id)].append((int(eid), int(epoch)))
    epochs = release_dead_parents(s, list(by_parent)) if by_parent else {}
    rows = [(pid, eid, epoch) for pid, children in sorted(by_parent.items()) for eid, epoch in sorted(children)]
    reserved = ([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
    return ReservedBatch(cursor, len(candidates) == limit, 0, reserved, epochs)
