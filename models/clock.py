"""The database's clock, read cheaply: time in leases and deadlines is the database's
now(), never a worker's clock (docs/glossary.md, "Database time").

Workers on several machines disagree about the time. Every lease and deadline is written and
compared in the database's time: SQL statements use ``now()`` where they compare, and values
computed in Python use :func:`db_utcnow`: the database's ``clock_timestamp()`` read at the
last sync, plus the time elapsed since on this process's MONOTONIC clock. A step of the
worker's wall clock (NTP, an operator's ``date -s``) therefore never moves it, between syncs
or across one; only the rate of the monotonic clock matters, and it is
re-anchored every ``RESYNC_SECONDS``. The measurement error is half a round trip (well under
a millisecond on a LAN), far below any lease.

``CLOCK_SKEW_SECONDS`` (tests only) shifts this process's local wall clock, as a badly set
machine would; it is read once, on first use. It moves :func:`local_utcnow` only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, select, text

from models.db import call_in_flight, get_engine, on_dispose

RESYNC_SECONDS = 60.0

_skew: timedelta | None = None  # read from settings on first use
_lock = threading.Lock()
#: (monotonic seconds at the sync, the database's time at that instant); None before a sync.
_anchor: tuple[float, datetime] | None = None
_synced_at = float("-inf")
_syncing = False


def _wall_now() -> datetime:
    """This machine's wall clock. Tests replace it to simulate a clock step."""
    return datetime.now(UTC)


#: The monotonic clock; tests may replace it too.
monotonic: Callable[[], float] = time.monotonic
wall_now: Callable[[], datetime] = _wall_now


def local_utcnow() -> datetime:
    """This machine's wall clock (with the test skew), uncorrected."""
    global _skew
    if _skew is None:
        from settings import get_settings

        _skew = timedelta(seconds=get_settings().CLOCK_SKEW_SECONDS)
    return wall_now() + _skew


def set_local_skew(seconds: float) -> None:
    """Tests: shift this process's local clock; forces a re-sync."""
    global _skew, _synced_at
    with _lock:
        _skew = timedelta(seconds=seconds)
        _synced_at = float("-inf")


def db_utcnow() -> datetime:
    """The database's current time: its time at the last sync plus the monotonic time since.
    Before any successful sync (database unreachable), the local wall clock."""
    if monotonic() - _synced_at > RESYNC_SECONDS:
        _resync()
    anchor = _anchor
    if anchor is None:
        return local_utcnow()
    at, db_time = anchor
    return db_time + timedelta(seconds=monotonic() - at)


#: Signalled when a measurement ends (with ``_lock``).
_measured = threading.Condition(_lock)
#: The longest a caller waits for another thread's FIRST measurement of this process.
FIRST_SYNC_WAIT_SECONDS = 10.0


def _resync() -> None:
    """Measure again, unless another thread is at it. NOTE: while this process has no anchor
    yet (its first measurement, or the first after a failed one), a caller finding another
    thread's measurement in flight waits for it (at most ``FIRST_SYNC_WAIT_SECONDS``): on a
    threads pool many loops start at once, and none may compute a lease from this machine's
    own clock meanwhile. With an anchor, it goes on with the last one."""
    global _anchor, _synced_at, _syncing
    with _lock:
        if _syncing:
            if _anchor is None:
                _measured.wait_for(lambda: not _syncing, timeout=FIRST_SYNC_WAIT_SECONDS)
            return
        if monotonic() - _synced_at <= RESYNC_SECONDS:
            return
        _syncing = True
    try:
        anchor = _measure()
        with _lock:
            # A failed measurement keeps the last anchor and tries again on a later call.
            if anchor is not None:
                _anchor = anchor
                _synced_at = anchor[0]
    finally:
        with _lock:
            _syncing = False
            _measured.notify_all()


def _measure() -> tuple[float, datetime] | None:
    """(monotonic time, the database's time at that instant), or None when unreachable."""
    engine = get_engine()
    if engine.dialect.name != "postgresql":
        return monotonic(), local_utcnow()  # the embedded default: one machine, one clock
    try:
        # Database work of the caller's thread like a transaction's (its heartbeat's rule).
        with call_in_flight(), engine.connect() as conn:
            before = monotonic()
            server: datetime = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
            after = monotonic()
    except Exception:
        return None
    if server.tzinfo is None:
        server = server.replace(tzinfo=UTC)
    return before + (after - before) / 2, server


def forget() -> None:
    """Re-measure on next use (a new database URL, a forked process)."""
    global _synced_at
    with _lock:
        _synced_at = float("-inf")


on_dispose(forget)  # engines disposed: the next use measures the (maybe new) database again


def in_time(until: Any) -> Any:
    """SQL: a lease or right written to last until ``until`` (computed from this process's
    estimate of the database's time, models.clock) still lies in the database's future. A
    write that fails it is refused: the monotonic clock the estimate runs on stood still (a
    host suspended) and the write would hand out something already lapsed, which another
    scanner may take at once."""
    return until > func.now()


def refused_as_lapsed(s: Any, until: Any) -> bool:
    """After a lease write missed: True when ``until`` was already past in the database's time
    (the write was refused for it); the clock is then re-measured before its next use. Costs a
    round trip, on the failure path only. Always False off PostgreSQL (one machine, one clock)."""
    if s.get_bind().dialect.name != "postgresql":
        return False
    if until > s.execute(select(func.now())).scalar_one():
        return False
    forget()
    return True
