"""Recovery health as the console shows it: the verdict (recovery.health: red when no worker
is alive, the scan is overdue or an approval waits too long), the figures of the Prometheus
metrics (the same collector, :class:`recovery.metrics.RecoveryCollector`, so a page and a
scrape never disagree), plus what a person needs beside them: who holds the right to scan and
until when, and each worker name (the latest booted, at most models.presence.LISTED) with its
boot generation, any conflict, and whether it is alive."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.base import utcnow
from models.presence import LISTED
from models.worker import RecoveryScan, WorkerBoot
from recovery.metrics import PREFIX, RecoveryCollector
from settings import get_settings

_collector: RecoveryCollector | None = None
_lock = threading.Lock()


def collector() -> RecoveryCollector:
    """One collector per process: its settled counters are recounted at most once a minute."""
    global _collector
    with _lock:
        if _collector is None:
            _collector = RecoveryCollector()
        return _collector


def metrics() -> dict[str, Any]:
    """The metrics as JSON: a family without labels is its value; one with labels is a list of
    ``{labels..., "value": v}``. Names drop the ``agent_recovery_`` prefix."""
    out: dict[str, Any] = {}
    for family in collector().collect():
        name = family.name.removeprefix(PREFIX + "_")
        samples = [smp for smp in family.samples if not smp.name.endswith("_created")]
        if len(samples) == 1 and not samples[0].labels:
            out[name] = samples[0].value
        else:
            out[name] = [{**smp.labels, "value": smp.value} for smp in samples]
    return out


def _scan(s: Session) -> dict[str, Any]:
    row = s.get(RecoveryScan, 1)
    now = utcnow()
    if row is None:
        return {"last_started_at": None, "duration_ms": None, "holder": None, "held_until": None, "held": False}
    held = row.holder is not None and row.held_until is not None and row.held_until > now
    return {
        "last_started_at": None if row.started_at is None else row.started_at.isoformat(),
        "age_seconds": None if row.started_at is None else round((now - row.started_at).total_seconds(), 1),
        "duration_ms": row.duration_ms,
        "parents": row.parents,
        "executions": row.executions,
        "holder": row.holder if held else None,
        "held_until": row.held_until.isoformat() if held and row.held_until else None,
        "held": held,
    }


def _workers(s: Session) -> list[dict[str, Any]]:
    lease = timedelta(seconds=get_settings().LEASE_SECONDS)
    now = utcnow()
    return [
        {
            "name": w.name,
            "generation": w.generation,
            "booted_at": w.booted_at.isoformat(),
            "conflict_generation": w.conflict_generation,
            "conflict_seen_at": None if w.conflict_seen_at is None else w.conflict_seen_at.isoformat(),
            "conflict_live": w.conflict_seen_at is not None and now - w.conflict_seen_at <= lease,
        }
        for w in s.execute(select(WorkerBoot).order_by(WorkerBoot.booted_at.desc()).limit(LISTED)).scalars()
    ]


#: What a worker's row of health takes from its presence (models.presence).
_PRESENCE_FIELDS = ("alive", "last_seen_at", "seen_seconds_ago", "hostname", "pid", "release_id")


def health(s: Session) -> dict[str, Any]:
    """``GET /api/health``: the metrics, the scan, each worker name (its boot generation, and
    from its presence whether it is alive), and the verdict (recovery.health: ``ok``,
    ``problems``, ``presence``, ``approvals``, ``queues``)."""
    from recovery.health import verdict
    from tasks.queues import queue_waits

    figures = metrics()
    found = verdict(s, queues=queue_waits())
    seen = {w["name"]: w for w in found["presence"]["workers"]}
    workers = _workers(s)
    for w in workers:
        here = seen.get(w["name"], {})
        w.update({k: here.get(k) for k in _PRESENCE_FIELDS})
        w["alive"] = bool(w["alive"])
    workers.sort(key=lambda w: (not w["alive"], w["seen_seconds_ago"] is None, w["seen_seconds_ago"] or 0, w["name"]))
    return {
        "database_up": bool(figures.get("database_up")),
        "metrics": figures,
        "scan": _scan(s),
        "workers": workers,
        **found,
    }
