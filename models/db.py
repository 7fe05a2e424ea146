"""Engine and the unit-of-work helper: one Session per transaction."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

from sqlalchemy import CursorResult, Engine, Executable, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from settings import get_settings

_lock = threading.Lock()
_engines: dict[str, Engine] = {}


def _make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # Embedded default only: WAL lets readers and one writer across processes coexist.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=60000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            # Take the write lock at BEGIN so that two writers serialize instead of deadlocking.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10)


def get_engine(url: str | None = None) -> Engine:
    """The process's engine for ``url`` (default: DATABASE_URL)."""
    url = url or get_settings().DATABASE_URL
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            engine = _engines[url] = _make_engine(url)
        return engine


def dispose_engines() -> None:
    """Forget pooled connections, e.g. in a forked worker child (never share sockets)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose(close=False)
        _engines.clear()
    from models.clock import forget

    forget()


@contextmanager
def transaction(url: str | None = None) -> Iterator[Session]:
    """One Session, one transaction: commit on success, roll back on any exception."""
    factory = sessionmaker(bind=get_engine(url), expire_on_commit=False)
    with factory() as session, session.begin():
        yield session


def dialect_name(url: str | None = None) -> str:
    return get_engine(url).dialect.name


def cas(s: Session, stmt: Executable) -> int:
    """Run one conditional UPDATE (a compare-and-set); the rowcount says whether it landed."""
    result = s.execute(stmt.execution_options(synchronize_session=False))
    return int(cast("CursorResult[Any]", result).rowcount)
