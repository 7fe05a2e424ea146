"""Operator actions: re-run delivery idempotently, and the status report."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import func, select

from harness.delivery import DeliveryKind, deliver_round
from harness.scheduler import Scheduler
from logfmt import log_event
from models import (
    ACTIVE_EXECUTION,
    STOPPED_PHASES,
    AgentSession,
    DeliveryStatus,
    Phase,
    SubagentExecution,
    lease,
    transaction,
)
from models.base import utcnow
from models.session import release_dead_parents
from recovery.errors import ExecutionNotFound

log = logging.getLogger(__name__)
E = SubagentExecution


class RedeliverOutcome(StrEnum):
    """How an operator's redelivery ended when it ran no delivery (otherwise: ``DeliveryKind``)."""

    NOTHING_PENDING = "nothing_pending"  #: the parent has no PENDING execution: it is left exactly as it is
    STILL_RUNNING = "still_running"  #: the execution is still active: nothing to deliver yet (the scan recovers it)
    SUPPRESSED = "suppressed"  #: the parent is stopped: its pending results were suppressed (printed as suppressed:N)


#: Who asked for a redelivery when the caller does not say (the Celery task, a script).
SYSTEM_ACTOR = "system"


def redeliver_parent(parent_id: int, scheduler: Scheduler, *, actor: str = SYSTEM_ACTOR) -> str:
    """Run the same delivery as the last child or the scan for the parent, idempotently: a parent
    with nothing PENDING is left exactly as it is (a settled WAITING_USER parent is never
    asked again); a stopped one has its pending results suppressed; a parent
    whose loop holds a live lease is busy. Returns what happened; the log line names ``actor``
    (who asked: ``cli:<user>``, ``console:<operator>``, ``system``)."""
    with transaction() as s:
        row = s.execute(
            select(AgentSession.epoch, AgentSession.phase).where(AgentSession.id == parent_id)
        ).one_or_none()
        if row is None:
            raise ExecutionNotFound(f"no session {parent_id}")
        if row.phase in STOPPED_PHASES:
            from harness.delivery import suppress_parent

            suppressed = suppress_parent(s, parent_id)
            log_event(
                log,
                "redeliver",
                parent_id=parent_id,
                actor=actor,
                outcome=RedeliverOutcome.SUPPRESSED,
                executions=len(suppressed),
            )
            return f"{RedeliverOutcome.SUPPRESSED}:{len(suppressed)}"
        pending = s.execute(
            select(func.count()).where(E.parent_session_id == parent_id, E.delivery_status == DeliveryStatus.PENDING)
        ).scalar_one()
        if not pending:
            log_event(log, "redeliver", parent_id=parent_id, actor=actor, outcome=RedeliverOutcome.NOTHING_PENDING)
            return RedeliverOutcome.NOTHING_PENDING
        epochs = release_dead_parents(s, [parent_id])
    outcome = deliver_round(parent_id, epochs[parent_id])
    if outcome.kind == DeliveryKind.RESUME and outcome.new_epoch is not None:
        scheduler.resume_parent(parent_id, outcome.new_epoch)
    # NOTE: STALE here is the epoch moving between release_dead_parents and the delivery: a
    # loop took the parent meanwhile, which the operator sees as a busy parent too.
    kind = DeliveryKind.PARENT_BUSY if outcome.kind == DeliveryKind.STALE else outcome.kind
    log_event(log, "redeliver", parent_id=parent_id, actor=actor, outcome=kind, delivered=len(outcome.delivered))
    return kind


def redeliver(execution_id: int, scheduler: Scheduler, *, actor: str = SYSTEM_ACTOR) -> str:
    """Re-run delivery for one execution. Already delivered/suppressed/legacy: nothing happens.
    Still running: nothing to deliver yet (the scan recovers it when its lease expires)."""
    with transaction() as s:
        row = s.execute(
            select(E.parent_session_id, E.status, E.delivery_status).where(E.id == execution_id)
        ).one_or_none()
    if row is None:
        raise ExecutionNotFound(f"no execution {execution_id}")
    if row.delivery_status != DeliveryStatus.PENDING:
        outcome: str = f"already_{str(row.delivery_status).lower()}"
    elif row.status in ACTIVE_EXECUTION:
        outcome = RedeliverOutcome.STILL_RUNNING
    else:
        return redeliver_parent(row.parent_session_id, scheduler, actor=actor)
    log_event(log, "redeliver", execution_id=execution_id, actor=actor, outcome=outcome)
    return outcome


def _stale_field_keys() -> int | None:
    """IN_PROGRESS field keys past their lease (None when the field schema is not there)."""
    from fieldrecovery.store import stale_count

    try:
        return stale_count()
    except Exception:
        log_event(log, "status_field_unavailable", logging.WARNING, exc_info=True)
        return None


def status_report() -> dict[str, Any]:
    """Counts by status/delivery, parents waiting, the oldest pending age, expired leases."""
    now = utcnow()
    with transaction() as s:
        counts = s.execute(
            select(E.status, E.delivery_status, func.count()).group_by(E.status, E.delivery_status)
        ).all()
        waiting = s.execute(
            select(func.count(func.distinct(E.parent_session_id))).where(E.delivery_status == DeliveryStatus.PENDING)
        ).scalar_one()
        oldest: datetime | None = s.execute(
            select(func.min(E.started_at)).where(E.delivery_status == DeliveryStatus.PENDING)
        ).scalar_one()
        expired_exec = s.execute(
            select(func.count()).where(
                E.delivery_status == DeliveryStatus.PENDING,
                E.status.in_(ACTIVE_EXECUTION),
                (E.lease_expires_at.is_(None)) | (E.lease_expires_at < now),
            )
        ).scalar_one()
        # Work nobody is picking up: lapsed more than one scan interval ago.
        unpicked = s.execute(
            select(func.count()).where(
                E.delivery_status == DeliveryStatus.PENDING,
                E.status.in_(ACTIVE_EXECUTION),
                E.lease_expires_at < now - timedelta(seconds=lease.scan_interval_seconds()),
            )
        ).scalar_one()
        S = AgentSession
        expired_sessions = s.execute(
            select(func.count()).where(
                S.phase.in_((Phase.RUNNING, Phase.RESUMING)), S.lease_expires_at.is_not(None), S.lease_expires_at < now
            )
        ).scalar_one()
    if oldest is not None and oldest.tzinfo is None:
        from datetime import UTC

        oldest = oldest.replace(tzinfo=UTC)
    return {
        "executions": [
            {"status": str(st), "delivery_status": str(ds), "count": int(n)} for st, ds, n in sorted(counts, key=str)
        ],
        "parents_waiting": int(waiting),
        "oldest_pending_age_seconds": None if oldest is None else round((now - oldest).total_seconds(), 1),
        "expired_execution_leases": int(expired_exec),
        "expired_session_leases": int(expired_sessions),
        "expired_leases_not_picked_up": int(unpicked),
        "stale_field_keys": _stale_field_keys(),
        "worker_name_conflicts": worker_name_conflicts(),
        "sessions_waiting_for_model": _waiting_for_model(),
        **_approvals(now),
    }


def _approvals(now: datetime) -> dict[str, Any]:
    """Tool calls waiting for a human decision, and how long the oldest has waited."""
    from models.approval import ApprovalRequest as A
    from models.approval import ApprovalStatus

    with transaction() as s:
        count, oldest = s.execute(
            select(func.count(), func.min(A.requested_at)).where(A.status == ApprovalStatus.PENDING)
        ).one()
    if oldest is not None and oldest.tzinfo is None:
        from datetime import UTC

        oldest = oldest.replace(tzinfo=UTC)
    return {
        "approvals_pending": int(count),
        "oldest_pending_approval_age_seconds": None if oldest is None else round((now - oldest).total_seconds(), 1),
    }


def _waiting_for_model() -> int:
    """Active sessions whose run ended in a model outage: resumed after a back-off."""
    from models.outage import waiting_for_model

    with transaction() as s:
        return waiting_for_model(s)


def worker_name_conflicts() -> list[dict[str, Any]]:
    """Worker names under which an older process saw a newer one boot. ``live``:
    the older process still reported it within the last lease (its watcher refreshes it every
    third of a lease), so two processes run under that name right now."""
    from models.worker import name_conflicts

    window = timedelta(seconds=lease.lease_seconds())
    now = utcnow()  # the database's time (models.clock)
    with transaction() as s:
        rows = name_conflicts(s)
        out = [
            {
                "worker": r.name,
                "generation": int(r.generation),
                "older_generation": r.conflict_generation,
                "seen_at": r.conflict_seen_at.isoformat() if r.conflict_seen_at else None,
                "live": bool(r.conflict_seen_at is not None and now - r.conflict_seen_at <= window),
            }
            for r in rows
        ]
    return out
