"""worker_presence: which workers are alive now (docs/tables.md, docs/console.md "Health").

One row per stable worker name (the name of ``worker_boot``), written by the worker's MAIN
process: at its start and at every tick of its name watcher (``tasks.signals.NameWatcher``,
every third of a lease), never on a round's path. A worker is alive while its row was written
within ``silent_after_seconds`` (a lease: three ticks missed); after that it is silent, and
health says so. A process that found a newer process under its own name stops writing (the row
is the newer one's).

Rows of names not seen for PRESENCE_RETENTION_DAYS are deleted at each worker's start, so a
deployment that names each pod anew keeps a small table.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import BigInteger, Integer, String, delete, func, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, UTCDateTime, utcnow

#: A name not seen for this long is forgotten (its row deleted at the next worker start).
PRESENCE_RETENTION_DAYS = 7


class WorkerPresence(Base):
    __tablename__ = "worker_presence"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    #: The release (agent_release.id) of the worker's configuration; NULL when it could not be
    #: stored (the database was down at the first tick, or the worker has no agents file).
    release_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    #: When this process started (a restart under the same name moves it).
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    #: The database's time of the last write: alive while recent.
    last_seen_at: Mapped[datetime] = mapped_column(UTCDateTime)


def silent_after_seconds() -> float:
    """A worker not seen for this long is silent: a lease, three of its watcher's ticks."""
    from settings import get_settings

    return float(get_settings().LEASE_SECONDS)


def record_seen(
    s: Session, *, name: str, hostname: str, pid: int, started_at: datetime, release_id: int | None
) -> None:
    """This process is alive under ``name``: one INSERT ... ON CONFLICT DO UPDATE."""
    from sqlalchemy.dialects import postgresql, sqlite

    dialect = postgresql if s.get_bind().dialect.name == "postgresql" else sqlite
    W = WorkerPresence
    values = {"hostname": hostname[:255], "pid": pid, "release_id": release_id, "started_at": started_at}
    stmt = dialect.insert(W).values(name=name, last_seen_at=func.now(), **values)
    s.execute(stmt.on_conflict_do_update(index_elements=[W.name], set_={**values, "last_seen_at": func.now()}))


def forget_old(s: Session, days: float = PRESENCE_RETENTION_DAYS) -> int:
    """Delete the rows of names not seen for ``days``; returns how many."""
    W = WorkerPresence
    rows: Any = s.execute(delete(W).where(W.last_seen_at < utcnow() - timedelta(days=days)))
    return int(rows.rowcount or 0)


def alive_by_release(s: Session) -> dict[int | None, list[str]]:
    """The names of the workers alive now, by the release of their configuration (sorted; NULL
    for workers whose release is not known): which workers run which release."""
    W = WorkerPresence
    since = utcnow() - timedelta(seconds=silent_after_seconds())
    found: dict[int | None, list[str]] = {}
    for name, release in s.execute(select(W.name, W.release_id).where(W.last_seen_at >= since).order_by(W.name)):
        found.setdefault(None if release is None else int(release), []).append(str(name))
    return found


#: Health lists at most this many workers (alive first, then the latest silent ones).
LISTED = 100


def presence(s: Session) -> dict[str, Any]:
    """Workers alive and silent: the counts, and the rows (alive first, newest seen first; at
    most LISTED), each with ``alive`` and ``seen_seconds_ago``."""
    W = WorkerPresence
    now = utcnow()
    since = now - timedelta(seconds=silent_after_seconds())
    alive = func.count().filter(W.last_seen_at >= since)
    counts = s.execute(select(alive, func.count())).one()
    rows = s.execute(select(W).order_by(W.last_seen_at.desc(), W.name).limit(LISTED)).scalars()
    return {
        "alive": int(counts[0]),
        "silent": int(counts[1]) - int(counts[0]),
        "silent_after_seconds": silent_after_seconds(),
        "workers": [
            {
                "name": w.name,
                "hostname": w.hostname,
                "pid": w.pid,
                "release_id": w.release_id,
                "started_at": w.started_at.isoformat(),
                "last_seen_at": w.last_seen_at.isoformat(),
                "seen_seconds_ago": round(max(0.0, (now - w.last_seen_at).total_seconds()), 1),
                "alive": w.last_seen_at >= since,
            }
            for w in rows
        ],
    }
