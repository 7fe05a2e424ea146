"""The pool's disconnect handling (models.db): a connection idle longer than the bypass window
is pinged at checkout and replaced when dead; one that died inside the window fails its
statement as an infrastructure error (never a result), and the next transaction gets a new
connection. Real PostgreSQL; the backend is killed with pg_terminate_backend."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import create_engine, text

from harness.errors import is_infrastructure_error
from models import transaction
from models.db import PING_AFTER_IDLE_SECONDS, get_engine


def _backend_pid() -> int:
    with transaction() as s:
        return int(s.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _terminate(url: str, pid: int) -> None:
    admin = create_engine(url)
    try:
        with admin.connect() as conn:
            assert conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar_one() is True
    finally:
        admin.dispose()
    time.sleep(0.1)  # the backend is gone


def test_a_connection_killed_while_idle_is_replaced_at_checkout(db: str) -> None:
    get_engine().dispose()
    first = _backend_pid()
    _terminate(db, first)
    time.sleep(PING_AFTER_IDLE_SECONDS + 0.1)
    second = _backend_pid()  # no error: the ping found it dead and the pool reconnected
    assert second != first


def test_a_connection_killed_inside_the_bypass_window_fails_as_an_infrastructure_error(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import models.db

    monkeypatch.setattr(models.db, "PING_AFTER_IDLE_SECONDS", 60.0)  # however slow the machine
    get_engine().dispose()
    first = _backend_pid()
    _terminate(db, first)
    with pytest.raises(Exception) as failed:
        _backend_pid()  # checked out within the window: not pinged, the statement fails
    assert is_infrastructure_error(failed.value)
    assert _backend_pid() != first  # the invalidated connection is gone from the pool
