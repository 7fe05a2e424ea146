"""An operator's cancel or approval decision whose row another path holds (a lock timeout,
SQLSTATE 55P03): the CLI and the console try again a few times, then say plainly that the row
is busy (the CLI: a message and exit code 3; the console: a 409 ``busy`` with a message),
never "the database is unreachable", a 503 or a traceback. Real PostgreSQL, a real loopback
console."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event, text

from cli.main import EXIT_BUSY, main
from models import Phase, get_engine
from tests.helpers import make_session, phase_of
from tests.integration import test_console_api as console_case
from tests.integration.test_approvals import requests
from tests.integration.test_console_api import Serve, _parked_request, client
from tests.types import ModelFactory

#: The console on a real loopback server, and the approvals' tools (fixtures).
console = console_case.console
approval_tools = console_case.approval_tools


@contextmanager
def _lock_waits_cut_after(ms: int) -> Iterator[None]:
    """Every transaction of this process (the CLI's, the console's) waits at most ``ms`` for a
    row lock (the engine's own bound is half a lease)."""
    engine = get_engine()

    def bound(conn: Any) -> None:
        conn.exec_driver_sql(f"SET LOCAL lock_timeout = {ms}")

    event.listen(engine, "begin", bound)
    try:
        yield
    finally:
        event.remove(engine, "begin", bound)


@contextmanager
def _held(table: str, row_id: int, *, release_after: float | None = None) -> Iterator[None]:
    """Another connection holds the row (FOR UPDATE) until the block ends, or for
    ``release_after`` seconds."""
    holder = get_engine().connect()
    holder.begin()
    holder.execute(text(f"SELECT id FROM {table} WHERE id = {row_id} FOR UPDATE"))
    timer = threading.Timer(release_after, holder.rollback) if release_after is not None else None
    if timer is not None:
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.join()
        else:
            holder.rollback()
        holder.close()


def test_a_cli_cancel_of_a_row_held_through_every_attempt_says_it_is_busy_with_its_own_exit_code(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    sid = make_session()
    with _held("agent_session", sid), _lock_waits_cut_after(100):
        code = main(["cancel", str(sid)])
    err = capsys.readouterr().err
    assert code == EXIT_BUSY == 5, err
    assert f"session {sid} is busy" in err and "try again" in err, err
    assert "unreachable" not in err and "Traceback" not in err
    assert phase_of(sid) == Phase.RUNNING


def test_a_cli_cancel_whose_row_is_freed_between_attempts_lands(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    sid = make_session()
    with _held("agent_session", sid, release_after=0.15), _lock_waits_cut_after(100):
        code = main(["cancel", str(sid)])
    assert code == 0, capsys.readouterr().err
    assert phase_of(sid) == Phase.CANCELLED


def test_a_cli_decision_on_a_request_held_through_every_attempt_says_it_is_busy(
    model_factory: ModelFactory, approval_tools: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    sid, call_id = _parked_request(model_factory)
    (req,) = requests()
    with _held("approval_request", req.id), _lock_waits_cut_after(100):
        code = main(["approve", str(sid), call_id, "--by", "alice"])
    err = capsys.readouterr().err
    assert code == EXIT_BUSY == 5, err
    assert "busy" in err and "unreachable" not in err, err
    assert requests()[0].status == "PENDING"


def test_the_console_answers_a_cancel_and_a_decision_on_a_busy_row_with_a_409_that_says_so(
    console: Serve, model_factory: ModelFactory, approval_tools: Any
) -> None:
    sid, _call_id = _parked_request(model_factory)
    (req,) = requests()
    base = console()
    http = client(base)
    with _held("agent_session", sid), _lock_waits_cut_after(100):
        cancelled = http.post(f"{base}/api/sessions/{sid}/cancel", timeout=30)
    assert cancelled.status_code == 409, cancelled.text
    assert cancelled.json()["outcome"] == "busy" and "busy" in cancelled.json()["message"]
    with _held("approval_request", req.id), _lock_waits_cut_after(100):
        decided = http.post(f"{base}/api/approvals/{req.id}/approve", json={}, timeout=30)
    assert decided.status_code == 409, decided.text
    assert decided.json()["outcome"] == "busy" and "busy" in decided.json()["message"]
    assert phase_of(sid) == Phase.WAITING_APPROVAL
    assert requests()[0].status == "PENDING"
