"""models.clock: the database's time, carried between syncs by the monotonic clock. A step of
the worker's wall clock must not move it."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, tzinfo

import pytest
from sqlalchemy import text

from models import clock, transaction


class _SteppedDatetime(datetime):
    """``datetime`` whose ``now()`` is the real wall clock plus a step the test sets."""

    step = timedelta(0)

    @classmethod
    def now(cls, tz: tzinfo | None = None) -> datetime:  # type: ignore[override]
        return datetime.now(tz) + cls.step


@pytest.fixture
def stepped_wall_clock(db: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_SteppedDatetime]]:
    _SteppedDatetime.step = timedelta(0)
    monkeypatch.setattr(clock, "datetime", _SteppedDatetime)
    clock.forget()
    yield _SteppedDatetime
    _SteppedDatetime.step = timedelta(0)
    clock.forget()


def _db_now() -> datetime:
    with transaction() as s:
        value: datetime = s.execute(text("SELECT clock_timestamp()")).scalar_one()
    return value


def test_a_wall_clock_step_forward_between_resyncs_does_not_move_the_databases_time(
    stepped_wall_clock: type[_SteppedDatetime],
) -> None:
    before = clock.db_utcnow()  # synced now
    stepped_wall_clock.step = timedelta(seconds=45)  # NTP steps this worker's clock forward
    after = clock.db_utcnow()
    assert timedelta(0) <= after - before < timedelta(seconds=2)
    assert abs(after - _db_now()) < timedelta(seconds=2)


def test_a_wall_clock_step_backward_between_resyncs_does_not_move_the_databases_time(
    stepped_wall_clock: type[_SteppedDatetime],
) -> None:
    before = clock.db_utcnow()
    stepped_wall_clock.step = timedelta(seconds=-300)
    after = clock.db_utcnow()
    assert timedelta(0) <= after - before < timedelta(seconds=2)  # time never goes back


def test_a_resync_after_a_wall_clock_step_still_gives_the_databases_time(
    stepped_wall_clock: type[_SteppedDatetime],
) -> None:
    clock.db_utcnow()
    stepped_wall_clock.step = timedelta(seconds=120)
    clock.forget()  # the next call re-measures, with the wall clock still stepped
    assert abs(clock.db_utcnow() - _db_now()) < timedelta(seconds=2)
    assert abs(clock.local_utcnow() - datetime.now(UTC)) > timedelta(seconds=100)  # the step is real


def test_the_test_skew_moves_the_local_clock_but_not_the_databases_time(
    stepped_wall_clock: type[_SteppedDatetime],
) -> None:
    try:
        clock.set_local_skew(-600)
        assert abs(clock.db_utcnow() - _db_now()) < timedelta(seconds=2)
        assert datetime.now(UTC) - clock.local_utcnow() > timedelta(seconds=590)
    finally:
        clock.set_local_skew(0)


def test_loops_that_ask_while_the_first_measurement_runs_get_the_databases_time(
    stepped_wall_clock: type[_SteppedDatetime], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A threads pool starts many loops at once: the first measures, the others must wait for
    # that measurement, never write leases computed from this machine's wrong clock.
    import threading
    import time

    measure = clock._measure
    measuring = threading.Event()

    def slow_measure() -> tuple[float, datetime] | None:
        measuring.set()
        time.sleep(0.5)
        return measure()

    monkeypatch.setattr(clock, "_measure", slow_measure)
    monkeypatch.setattr(clock, "_anchor", None)  # a process that never measured yet
    stepped_wall_clock.step = timedelta(seconds=-600)  # this machine's clock is ten minutes late
    first = threading.Thread(target=clock.db_utcnow)
    first.start()
    assert measuring.wait(timeout=10)
    seen = clock.db_utcnow()  # another loop, while the first one's measurement runs
    first.join(timeout=10)
    assert abs(seen - _db_now()) < timedelta(seconds=2)
