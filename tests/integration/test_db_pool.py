"""The pool's disconnect handling (models.db): a connection idle longer than the bypass window
is pinged at checkout and replaced when dead; one that died inside the window fails its
statement as an infrastructure error (never a result), and the next transaction gets a new
connection. Real PostgreSQL; the backend is killed with pg_terminate_backend."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from harness.errors import is_infrastructure_error
from models import transaction
from models.db import PING_AFTER_IDLE_SECONDS, get_engine
from tests.helpers import yielded_with_children
from tests.types import ModelFactory


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


# --- the pool's size: from the loops a process runs, within what PostgreSQL accepts ----------


@pytest.fixture
def pool_settings(db: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Set DB_POOL_* (and other) variables for this test; the process's sizing is restored."""
    import models.db
    from settings import get_settings

    def setenv(**values: str) -> None:
        for key, value in values.items():
            monkeypatch.setenv(key, value)
        get_settings.cache_clear()
        models.db.dispose_engines()

    yield setenv
    monkeypatch.setattr(models.db, "_cap", None)
    models.db.size_for_loops(1)
    for key in ("DB_POOL_SIZE", "DB_POOL_MAX_OVERFLOW", "LEASE_SECONDS"):
        monkeypatch.delenv(key, raising=False)
    get_settings.cache_clear()
    models.db.dispose_engines()


def _limits() -> tuple[int, int]:
    pool: Any = get_engine().pool
    return pool.size(), pool._max_overflow


def test_the_pool_is_sized_from_the_loops_a_process_runs_unless_the_settings_say(
    pool_settings: Callable[..., None],
) -> None:
    from models.db import size_for_loops

    size_for_loops(64)  # a threads pool of 64: a quarter kept, an eighth more in bursts
    assert _limits() == (18, 10)
    size_for_loops(256)  # the Procfile's 256: capped at 20 kept, 10 more in bursts
    assert _limits() == (20, 10)
    size_for_loops(1)  # a prefork pool process: its loop and its heartbeat, two in a burst
    assert _limits() == (2, 2)
    pool_settings(DB_POOL_SIZE="7", DB_POOL_MAX_OVERFLOW="0")
    assert _limits() == (7, 0)


def test_a_worker_never_holds_more_connections_than_postgresql_accepts(pool_settings: Callable[..., None]) -> None:
    from models.db import fit_to_server

    with transaction() as s:
        accepted = int(s.execute(text("SHOW max_connections")).scalar_one()) - int(
            s.execute(text("SHOW superuser_reserved_connections")).scalar_one()
        )
    pool_settings(DB_POOL_SIZE=str(accepted), DB_POOL_MAX_OVERFLOW=str(accepted))
    processes = 5
    cap = fit_to_server(processes)
    size, overflow = _limits()
    assert cap is not None and (size + overflow) * processes <= accepted
    assert size >= 1


def test_a_loop_that_waits_too_long_for_a_connection_writes_no_result(
    pool_settings: Callable[..., None], model_factory: ModelFactory
) -> None:
    # One connection in the pool, held by another thread: the child's take waits half a lease
    # for it, then its task ends as an infrastructure fault; the execution keeps no result and
    # its lease (never taken here) is the scan's to hand out again.
    from harness.child import start_child
    from tests.helpers import executions_of
    from tests.integration.test_faults import TWO

    model = model_factory(TWO)
    sid, _, children, deps = yielded_with_children(model.base_url)
    pool_settings(DB_POOL_SIZE="1", DB_POOL_MAX_OVERFLOW="0", LEASE_SECONDS="3")
    holder = get_engine().raw_connection()  # the pool's one connection, out, no transaction open
    try:
        started = time.monotonic()
        assert start_child(*children[0], deps) == "infra_error"
        assert time.monotonic() - started >= 1.4  # it waited (half a lease) before giving up
    finally:
        holder.close()
    first = executions_of(sid)[0]
    assert first.status == "RUNNING" and first.result is None and first.error is None
    assert start_child(*children[1], deps) == "completed"  # a free connection: work goes on
