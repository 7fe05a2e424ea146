"""Is anything alive: the verdict an on-call engineer reads first (docs/console.md, "Health").

Health is red when any of these holds, each a :class:`Problem`:

1. no worker is alive (``worker_presence``: none seen within a lease, models.presence);
2. the last recovery scan started more than two scan intervals ago, or never ran;
3. an approval request has waited longer than HEALTH_APPROVAL_MAX_AGE_SECONDS;
4. the database cannot be read (the console and ``agent-recovery health`` say so themselves).

Beside the verdict: workers alive and silent, the pending approvals, and the queues' depths as
the caller read them (tasks.queues: Redis list lengths; RabbitMQ by a passive ``queue_declare``).
Every figure is a read of a one-row or small table, or of an index: nothing here grows with the
sessions.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from models.base import utcnow

#: The last scan is overdue past this many scan intervals.
OVERDUE_INTERVALS = 2


class Problem(StrEnum):
    """Why health is red."""

    NO_WORKER_ALIVE = "no_worker_alive"  #: no worker wrote its presence within a lease
    SCAN_OVERDUE = "scan_overdue"  #: the last scan started more than two intervals ago (or never)
    APPROVALS_WAITING = "approvals_waiting"  #: a request waits past HEALTH_APPROVAL_MAX_AGE_SECONDS
    DATABASE_DOWN = "database_down"  #: the database could not be read


@dataclass(frozen=True)
class Finding:
    problem: Problem
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"code": str(self.problem), "message": self.message}


def _aware(value: datetime | None) -> datetime | None:
    return value if value is None or value.tzinfo is not None else value.replace(tzinfo=UTC)


def approvals_waiting(s: Session, now: datetime) -> dict[str, Any]:
    """Pending approval requests and how long the oldest has waited (the pending partial index)."""
    from models.approval import ApprovalRequest as A
    from models.approval import ApprovalStatus
    from settings import get_settings

    count, first = s.execute(
        select(func.count(), func.min(A.requested_at)).where(A.status == ApprovalStatus.PENDING)
    ).one()
    oldest = _aware(first)
    return {
        "pending": int(count),
        "oldest_age_seconds": None if oldest is None else round((now - oldest).total_seconds(), 1),
        "max_age_seconds": get_settings().HEALTH_APPROVAL_MAX_AGE_SECONDS,
    }


def scan_age_seconds(s: Session, now: datetime) -> float | None:
    """Seconds since the last finished scan started (None: no scan has finished)."""
    from models.worker import last_scan

    row = last_scan(s)
    started = None if row is None else _aware(row.started_at)
    return None if started is None else round((now - started).total_seconds(), 1)


def findings(*, workers_alive: int, scan_age: float | None, approvals: dict[str, Any]) -> list[Finding]:
    """What makes health red, from the figures read (the one place the rule is written)."""
    from models.lease import scan_interval_seconds

    found: list[Finding] = []
    if workers_alive == 0:
        found.append(Finding(Problem.NO_WORKER_ALIVE, "no worker has been seen within a lease"))
    limit = OVERDUE_INTERVALS * scan_interval_seconds()
    if scan_age is None:
        found.append(Finding(Problem.SCAN_OVERDUE, "no recovery scan has run"))
    elif scan_age > limit:
        found.append(Finding(Problem.SCAN_OVERDUE, f"the last scan started {scan_age:.0f} s ago (over {limit:.0f} s)"))
    oldest = approvals["oldest_age_seconds"]
    if oldest is not None and oldest > approvals["max_age_seconds"]:
        found.append(
            Finding(
                Problem.APPROVALS_WAITING,
                f"an approval request has waited {oldest:.0f} s (over {approvals['max_age_seconds']:.0f} s)",
            )
        )
    return found


def verdict(s: Session, *, queues: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``ok`` (no finding), ``problems``, ``presence`` (workers alive and silent), ``scan_age_seconds``,
    ``approvals``, and ``queues`` as the caller read them from the broker (tasks.queues.queue_waits:
    each queue's depth, None where the broker could not say)."""
    from models.presence import presence

    now = utcnow()
    seen = presence(s)
    scan_age = scan_age_seconds(s, now)
    approvals = approvals_waiting(s, now)
    found = findings(workers_alive=seen["alive"], scan_age=scan_age, approvals=approvals)
    return {
        "ok": not found,
        "problems": [f.as_dict() for f in found],
        "presence": seen,
        "scan_age_seconds": scan_age,
        "approvals": approvals,
        "queues": queues or [],
    }


def database_down() -> dict[str, Any]:
    """The verdict when the database cannot be read."""
    finding = Finding(Problem.DATABASE_DOWN, "the database cannot be read")
    return {"ok": False, "problems": [finding.as_dict()]}
