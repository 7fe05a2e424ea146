"""The database's clock, read cheaply (DESIGN §6: "time in leases and deadlines is the
database's now(), never a worker's clock").

Workers on several machines disagree about the time. Every lease and deadline is written and
compared in the database's time: SQL statements use ``now()`` where they compare, and values
computed in Python use :func:`db_utcnow`, the local clock corrected by the offset to the
database's ``clock_timestamp()``. The offset is measured on first use and re-measured every
``RESYNC_SECONDS`` (an NTP step on the worker is absorbed within that); the measurement error
is half a round trip (well under a millisecond on a LAN), far below any lease.

``CLOCK_SKEW_SECONDS`` (tests only) shifts this process's local clock, as a badly set machine
would; it is read once, on first use.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

RESYNC_SECONDS = 60.0

_skew: timedelta | None = None  # read from settings on first use
_lock = threading.Lock()
_offset = timedelta(0)
_synced_at = float("-inf")
_syncing = False


def local_utcnow() -> datetime:
    """This machine's clock (with the test skew), uncorrected."""
    global _skew
    if _skew is None:
        from settings import get_settings

        _skew = timedelta(seconds=get_settings().CLOCK_SKEW_SECONDS)
    return datetime.now(UTC) + _skew


def set_local_skew(seconds: float) -> None:
    """Tests: shift this process's local clock; forces a re-sync."""
    global _skew, _synced_at
    with _lock:
        _skew = timedelta(seconds=seconds)
        _synced_at = float("-inf")


def db_utcnow() -> datetime:
    """The database's current time, from the local clock and the measured offset."""
    if time.monotonic() - _synced_at > RESYNC_SECONDS:
        _resync()
    return local_utcnow() + _offset


def _resync() -> None:
    global _offset, _synced_at, _syncing
    with _lock:
        if _syncing or time.monotonic() - _synced_at <= RESYNC_SECONDS:
            return
        _syncing = True
    try:
        offset = _measure()
        with _lock:
            if offset is not None:
                _offset = offset
            # A failed measurement keeps the last offset and tries again on a later call.
            _synced_at = time.monotonic() if offset is not None else _synced_at
    finally:
        with _lock:
            _syncing = False


def _measure() -> timedelta | None:
    from sqlalchemy import text

    from models.db import get_engine

    engine = get_engine()
    if engine.dialect.name != "postgresql":
        return timedelta(0)  # the embedded default: one machine, one clock
    try:
        with engine.connect() as conn:
            before = local_utcnow()
            server: datetime = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
            after = local_utcnow()
    except Exception:
        return None
    return server - (before + (after - before) / 2)


def forget() -> None:
    """Re-measure on next use (a new database URL, a forked process)."""
    global _synced_at
    with _lock:
        _synced_at = float("-inf")
