"""Who did what (docs/console.md, "Audit"): every console action and sign-in, and every
decision, is a row of operator_action; a session's page lists its own, and
``agent-recovery audit`` lists them all. A real loopback server, the real PostgreSQL schema,
the command in a subprocess."""

from __future__ import annotations

import json
from typing import Any

import requests
from sqlalchemy import text

from models import transaction
from tests.helpers import make_execution, make_session
from tests.integration.test_approval_display import env as env  # the fixture
from tests.integration.test_approval_display import parked as parked  # the fixture
from tests.integration.test_approvals import Runs, cli
from tests.integration.test_approvals import runs as runs  # the fixture
from tests.integration.test_console_api import TOKEN, Serve, client, login_csrf
from tests.integration.test_console_api import console as console  # the fixture


def actions() -> list[tuple[Any, ...]]:
    with transaction() as s:
        return [
            tuple(r)
            for r in s.execute(
                text(
                    "SELECT actor, action, session_id, execution_id, request_id, outcome FROM operator_action"
                    " ORDER BY id"
                )
            )
        ]


def test_console_actions_sign_ins_and_decisions_are_recorded_once_each(
    console: Serve, parked: tuple[int, str, Any], runs: Runs
) -> None:
    sid_waiting, _call, _ = parked
    base = console()
    browser = requests.Session()
    csrf = login_csrf(browser, base)
    browser.post(f"{base}/login", data={"operator": "mallory", "token": "guess", "csrf": csrf}, timeout=10)
    browser.post(f"{base}/login", data={"operator": "alice", "token": TOKEN, "csrf": csrf}, timeout=10)
    http = client(base, operator="alice")
    sid = make_session()
    eid = make_execution(sid)
    assert http.post(f"{base}/api/executions/{eid}/redeliver", timeout=10).status_code == 409
    assert http.post(f"{base}/api/sessions/{sid}/cancel", timeout=10).status_code == 200
    request_id = http.get(f"{base}/api/approvals", timeout=10).json()["approvals"][0]["id"]
    assert http.post(f"{base}/api/approvals/{request_id}/approve", json={}, timeout=10).status_code == 200
    assert actions() == [
        ("console:mallory", "sign_in", None, None, None, "wrong_token"),
        ("console:alice", "sign_in", None, None, None, "signed_in"),
        ("console:alice", "redeliver", sid, eid, None, "still_running"),
        ("console:alice", "cancel", sid, None, None, "cancelled"),
        ("console:alice", "approve", sid_waiting, None, request_id, "decided"),
    ]
    d = http.get(f"{base}/api/sessions/{sid}", timeout=10).json()
    assert [(a["actor"], a["action"], a["outcome"]) for a in d["actions"]] == [
        ("console:alice", "redeliver", "still_running"),
        ("console:alice", "cancel", "cancelled"),
    ]
    page = http.get(f"{base}/sessions/{sid}", timeout=10).text
    assert 'id="actions"' in page and "console:alice" in page and "cancelled" in page


def test_the_audit_command_lists_every_action_newest_first(
    console: Serve, parked: tuple[int, str, Any], env: dict[str, str]
) -> None:
    sid_waiting, call_id, _ = parked
    assert cli("approve", str(sid_waiting), call_id, "--by", "carol", env=env).returncode == 0
    base = console()
    sid = make_session()
    assert client(base, operator="bob").post(f"{base}/api/sessions/{sid}/cancel", timeout=10).status_code == 200
    listed = cli("audit", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [(r["actor"], r["action"], r["outcome"]) for r in rows] == [
        ("console:bob", "cancel", "cancelled"),
        ("carol", "approve", "decided"),
    ]
    assert rows[0]["session_id"] == sid and rows[0]["at"].endswith("+00:00")
    assert rows[1]["call_id"] == call_id
    plain = cli("audit", "--limit", "1", env=env)
    assert plain.returncode == 0 and len(plain.stdout.strip().splitlines()) == 1
    assert "console:bob cancel" in plain.stdout and f"session {sid}" in plain.stdout
