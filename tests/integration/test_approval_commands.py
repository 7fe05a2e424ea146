"""The approval commands as an operator runs them (subprocesses, real PostgreSQL): one line and
a documented exit code for every way they end (docs/console.md, "Approval commands"), UTC
timestamps whatever the database session's time zone, quiet when piped into ``head``, every
refused or repeated decision recorded; and the table's upkeep (journal_id indexed, decided
requests purged after APPROVAL_RETENTION_DAYS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from cli.approval import EXIT_BAD_ARGUMENTS, EXIT_CONFLICT, EXIT_NOT_FOUND, EXIT_UNREACHABLE
from models import transaction, utcnow
from tests.integration.test_approval_display import env as env  # the fixture
from tests.integration.test_approval_display import parked as parked  # the fixture
from tests.integration.test_approvals import cli
from tests.integration.test_approvals import runs as runs  # the fixture
from tests.integration.test_console_bounds import _pending_requests


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("agent-recovery: ")
    return lines[0]


def status_of(sid: int, call_id: str) -> str:
    with transaction() as s:
        return str(
            s.execute(
                text("SELECT status FROM approval_request WHERE session_id = :s AND call_id = :c"),
                {"s": sid, "c": call_id},
            ).scalar_one()
        )


def test_each_way_a_decision_ends_has_its_own_exit_code(env: dict[str, str], parked: tuple[int, str, Any]) -> None:
    sid, call_id, _ = parked
    assert len({0, EXIT_CONFLICT, EXIT_BAD_ARGUMENTS, EXIT_NOT_FOUND, EXIT_UNREACHABLE}) == 5
    for argv in (("approve", str(sid), "nope"), ("deny", str(sid), "nope", "--reason", "r")):
        missing = cli(*argv, env=env)
        assert missing.returncode == EXIT_NOT_FOUND, missing
        assert "no such approval request" in one_line(missing)
    bad = cli("approve", str(sid), call_id, "--arguments", "{not json", env=env)
    assert bad.returncode == EXIT_BAD_ARGUMENTS, bad
    one_line(bad)
    long_name = cli("approve", str(sid), call_id, "--by", "x" * 129, env=env)
    assert long_name.returncode == EXIT_BAD_ARGUMENTS and "--by" in one_line(long_name)
    assert status_of(sid, call_id) == "PENDING"
    down = {**env, "DATABASE_URL": "postgresql+psycopg2://postgres@127.0.0.1:1/none"}
    for argv in (
        ("approve", str(sid), call_id),
        ("deny", str(sid), call_id, "--reason", "r"),
        ("approvals",),
        ("approvals", "show", str(sid), call_id),
    ):
        unreachable = cli(*argv, env=down)
        assert unreachable.returncode == EXIT_UNREACHABLE, (argv, unreachable)
        assert "database is unreachable" in one_line(unreachable)
    assert cli("approve", str(sid), call_id, "--by", "carol", env=env).returncode == 0
    assert cli("approve", str(sid), call_id, "--by", "carol", env=env).returncode == 0  # the same decision
    conflict = cli("deny", str(sid), call_id, "--reason", "no", "--by", "dave", env=env)
    assert conflict.returncode == EXIT_CONFLICT
    one_line(conflict)


def test_a_refused_or_repeated_decision_is_recorded_with_who_tried_and_when(
    env: dict[str, str], parked: tuple[int, str, Any]
) -> None:
    sid, call_id, _ = parked
    before = utcnow()
    assert cli("approve", str(sid), call_id, "--by", "carol", env=env).returncode == 0
    assert cli("approve", str(sid), call_id, "--by", "erin", env=env).returncode == 0  # repeated
    assert cli("deny", str(sid), call_id, "--reason", "no", "--by", "dave", env=env).returncode == EXIT_CONFLICT
    shown = json.loads(cli("approvals", "show", str(sid), call_id, "--json", env=env).stdout)
    attempts = [(a["actor"], a["action"], a["outcome"]) for a in shown["attempts"]]
    assert attempts == [("carol", "approve", "decided"), ("erin", "approve", "repeated"), ("dave", "deny", "conflict")]
    for a in shown["attempts"]:
        assert a["at"].endswith("+00:00") and a["at"] >= before.isoformat()
    text_out = cli("approvals", "show", str(sid), call_id, env=env).stdout
    assert "dave" in text_out and "conflict" in text_out
    assert shown["decided_by"] == "carol"  # the first decision stands


def test_json_timestamps_are_utc_whatever_the_database_session_time_zone(
    env: dict[str, str], parked: tuple[int, str, Any]
) -> None:
    sid, call_id, _ = parked
    india = {**env, "PGTZ": "Asia/Kolkata"}
    (row,) = json.loads(cli("approvals", "--json", env=india).stdout)
    assert row["requested_at"].endswith("+00:00") and row["expires_at"].endswith("+00:00")
    shown = json.loads(cli("approvals", "show", str(sid), call_id, "--json", env=india).stdout)
    assert shown["requested_at"].endswith("+00:00")
    snap = json.loads(cli("session", "show", str(sid), "--json", env=india).stdout)
    assert snap["approvals"][0]["requested_at"].endswith("+00:00")


@pytest.mark.parametrize("json_flag", [False, True])
def test_the_list_piped_into_head_ends_without_a_traceback(db: str, json_flag: bool) -> None:
    _pending_requests(1500)
    argv = [sys.executable, "-m", "cli.main", "approvals", *(["--json"] if json_flag else [])]
    proc = subprocess.Popen(
        argv, env={**os.environ, "DATABASE_URL": db}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    assert first
    proc.stdout.close()  # as `head -1` does
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_approval_requests_are_found_by_journal_entry_through_an_index(db: str) -> None:
    with transaction() as s:
        indexes = (
            s.execute(text("SELECT indexdef FROM pg_indexes WHERE tablename = 'approval_request'")).scalars().all()
        )
    assert any("(journal_id)" in d for d in indexes), indexes


def test_decided_requests_of_closed_rounds_are_purged_after_the_retention_and_nothing_else(db: str) -> None:
    from models.approval import purge_decided

    sid = _pending_requests(4)
    old = utcnow() - timedelta(days=40)
    with transaction() as s:
        s.execute(
            text(
                "UPDATE approval_request SET status = 'DENIED', decided_at = :old, decided_by = 'x', reason = 'r'"
                " WHERE call_id IN ('call_1', 'call_2')"
            ),
            {"old": old},
        )
        s.execute(
            text(
                "UPDATE approval_request SET status = 'APPROVED', decided_at = now(), decided_by = 'x'"
                " WHERE call_id = 'call_3'"
            )
        )
    with transaction() as s:  # the round still open: nothing of it goes
        assert purge_decided(s, retention_days=30) == 0
    with transaction() as s:
        s.execute(
            text("UPDATE round_journal SET status = 'CLOSED', closed_at = now() WHERE session_id = :s"), {"s": sid}
        )
    with transaction() as s:
        assert purge_decided(s, retention_days=30) == 2
    with transaction() as s:
        left = s.execute(text("SELECT call_id FROM approval_request ORDER BY call_id")).scalars().all()
    assert left == ["call_3", "call_4"]  # recent, and pending
