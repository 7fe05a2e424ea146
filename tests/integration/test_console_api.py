"""The console's JSON API and forms on a real loopback server, reading the real PostgreSQL schema:
every view, every action, and every way an action is refused (no token, wrong CSRF token,
read-only mode, a compare-and-set that did not land)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import requests
from markupsafe import escape
from sqlalchemy import text

from console.auth import ConsoleConfig, ConsoleConfigError, load_config
from models import DeliveryStatus, ExecutionStatus, Phase, Role, SessionType, transaction
from models.base import utcnow
from tests.console_server import serve
from tests.helpers import (
    add_message,
    children_done_delivery_lost,
    executions_of,
    make_execution,
    make_session,
    one_child_script,
    phase_of,
)
from tests.integration import test_approvals as approval_case
from tests.integration.test_approvals import Runs
from tests.types import ModelFactory

TOKEN = "s3cret-console-token-for-tests"
SECRET_TASK = "the user's private task text"
#: The same text as a page shows it (autoescaped).
SECRET_TASK_HTML = str(escape(SECRET_TASK))

Serve = Callable[..., str]
#: The approvals' tools (``refund`` needs a human decision), as the fixture ``runs``.
approval_tools = approval_case.runs


@pytest.fixture
def console(db: str, redis_url: str) -> Iterator[Serve]:
    """Start consoles (real uvicorn on 127.0.0.1) with a given configuration; stopped after."""
    stack = []

    def start(*, token: str = TOKEN, read_only: bool = False, show_content: bool = False) -> str:
        ctx = serve(ConsoleConfig(token=token, read_only=read_only, show_content=show_content))
        stack.append(ctx)
        return ctx.__enter__()

    yield start
    for ctx in reversed(stack):
        ctx.__exit__(None, None, None)


def client(base: str, *, token: str | None = TOKEN, operator: str = "alice") -> requests.Session:
    """An API client: the bearer token, and the CSRF token fetched from ``/api/csrf``."""
    http = requests.Session()
    if token:
        http.headers["Authorization"] = f"Bearer {token}"
    http.headers["X-Console-Operator"] = operator
    csrf = http.get(f"{base}/api/csrf", timeout=10).json()["csrf"]
    http.headers["X-CSRF-Token"] = csrf
    return http


def login_csrf(browser: requests.Session, base: str) -> str:
    """The CSRF token of the sign-in form (``browser`` keeps its cookie)."""
    page = browser.get(f"{base}/login", timeout=10).text
    return page.split('name="csrf" value="', 1)[1].split('"', 1)[0]


# --- who may see -------------------------------------------------------------------------------


def test_a_request_without_the_token_is_answered_401_on_the_api_and_the_pages(console: Serve) -> None:
    base = console()
    sid = make_session()
    for path in ("/api/sessions", f"/api/sessions/{sid}", "/api/health", "/api/approvals"):
        bare = requests.get(base + path, timeout=10)
        assert bare.status_code == 401, path
        assert bare.json() == {"error": "unauthorized"}
        wrong = requests.get(base + path, headers={"Authorization": "Bearer nope"}, timeout=10)
        assert wrong.status_code == 401, path
        assert requests.get(base + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).status_code == 200
    for path in ("/", f"/sessions/{sid}", "/health", "/approvals"):
        page = requests.get(base + path, timeout=10)
        assert page.status_code == 401
        assert "Console token" in page.text  # the sign-in form
    post = requests.post(f"{base}/api/sessions/{sid}/cancel", timeout=10)
    assert post.status_code == 401
    assert phase_of(sid) == Phase.RUNNING


def test_signing_in_sets_a_cookie_that_holds_no_token_and_no_page_shows_the_token(
    console: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    base = console()
    sid = make_session()
    browser = requests.Session()
    csrf = login_csrf(browser, base)
    refused = browser.post(f"{base}/login", data={"operator": "bob", "token": "wrong", "csrf": csrf}, timeout=10)
    assert refused.status_code == 401
    done = browser.post(
        f"{base}/login", data={"operator": "bob", "token": TOKEN, "csrf": csrf}, allow_redirects=False, timeout=10
    )
    assert done.status_code == 303
    cookies = "; ".join(f"{c.name}={c.value}" for c in browser.cookies)
    assert TOKEN not in cookies
    for path in ("/", f"/sessions/{sid}", f"/sessions/{sid}/live", "/health", "/approvals"):
        page = browser.get(base + path, timeout=10)
        assert page.status_code == 200, path
        assert TOKEN not in page.text
        assert TOKEN not in page.url
    assert "bob" in browser.get(base + "/", timeout=10).text
    assert TOKEN not in caplog.text


def test_without_a_token_the_console_listens_on_loopback_only() -> None:
    from settings import load_settings

    settings = load_settings(CONSOLE_TOKEN="", CONSOLE_TOKEN_FILE="")
    assert load_config(settings, "127.0.0.1").needs_token is False
    with pytest.raises(ConsoleConfigError, match="CONSOLE_TOKEN"):
        load_config(settings, "0.0.0.0")
    assert load_config(load_settings(CONSOLE_TOKEN=TOKEN), "0.0.0.0").token == TOKEN


def test_the_token_may_come_from_a_file(tmp_path: pytest.TempPathFactory) -> None:
    from pathlib import Path

    from settings import load_settings

    path = Path(str(tmp_path)) / "token"
    path.write_text(TOKEN + "\n")
    assert load_config(load_settings(CONSOLE_TOKEN="", CONSOLE_TOKEN_FILE=str(path)), "0.0.0.0").token == TOKEN


def test_on_loopback_without_a_token_reading_is_open_but_an_action_still_needs_the_csrf_token(
    console: Serve,
) -> None:
    base = console(token="")
    sid = make_session()
    assert requests.get(f"{base}/api/sessions/{sid}", timeout=10).status_code == 200
    assert requests.post(f"{base}/api/sessions/{sid}/cancel", timeout=10).status_code == 403
    assert phase_of(sid) == Phase.RUNNING
    http = client(base, token=None)
    assert http.post(f"{base}/api/sessions/{sid}/cancel", timeout=10).status_code == 200
    assert phase_of(sid) == Phase.CANCELLED


# --- the views ---------------------------------------------------------------------------------


def _age(sid: int, seconds: float) -> None:
    with transaction() as s:
        s.execute(
            text("UPDATE agent_session SET started_at = :t WHERE id = :id"),
            {"t": utcnow() - timedelta(seconds=seconds), "id": sid},
        )


def test_the_session_list_filters_by_every_field_and_pages_newest_first(console: Serve) -> None:
    base = console()
    http = client(base)
    old = make_session(phase=Phase.WAITING_USER, agent_type="main", user_id="u1")
    _age(old, 7200)
    failed = make_session(phase=Phase.FAILED, agent_type="writer", user_id="u2")
    recovered_parent = make_session(phase=Phase.RUNNING, agent_type="main", user_id="u2")
    child_exec = make_execution(recovered_parent, epoch=3, recoveries=1, status=ExecutionStatus.RECOVERING)
    child = executions_of(recovered_parent)[0].child_session_id
    resuming = make_session(phase=Phase.RESUMING, agent_type="main", user_id="u3")
    parent_with_failed_child = make_session(phase=Phase.RUNNING, user_id="u3")
    make_execution(parent_with_failed_child, status=ExecutionStatus.FAILED)
    failed_child = executions_of(parent_with_failed_child)[0].child_session_id

    def ids(**params: str) -> list[int]:
        r = http.get(f"{base}/api/sessions", params=params, timeout=10)
        assert r.status_code == 200, r.text
        return [row["id"] for row in r.json()["sessions"]]

    everyone = ids()
    assert everyone == sorted(everyone, reverse=True)  # newest first
    assert set(everyone) == {old, failed, recovered_parent, child, resuming, parent_with_failed_child, failed_child}
    assert ids(phase="RUNNING") == [parent_with_failed_child, resuming, recovered_parent]  # RESUMING shown as RUNNING
    assert ids(phase="WAITING_USER") == [old]
    assert ids(agent="writer") == [failed]
    assert ids(user="u2") == [recovered_parent, failed]
    assert ids(recovered="true") == [child, recovered_parent]
    assert old in ids(recovered="false") and child not in ids(recovered="false")
    assert ids(failed="true") == [parent_with_failed_child, failed]
    assert ids(waiting_approval="true") == []  # approvals are not installed: nobody waits
    since = (utcnow() - timedelta(seconds=3600)).isoformat()
    assert old not in ids(since=since) and failed in ids(since=since)
    assert ids(until=since) == [old]
    rows = {r["id"]: r for r in http.get(f"{base}/api/sessions", timeout=10).json()["sessions"]}
    assert rows[recovered_parent]["recovered"] is True and rows[recovered_parent]["executions"] == 1
    assert rows[resuming]["phase"] == "RUNNING"
    assert child_exec > 0

    first = http.get(f"{base}/api/sessions", params={"limit": 3}, timeout=10).json()
    assert [r["id"] for r in first["sessions"]] == everyone[:3]
    second = http.get(f"{base}/api/sessions", params={"limit": 3, "before": first["next_before"]}, timeout=10).json()
    assert [r["id"] for r in second["sessions"]] == everyone[3:6]
    last = http.get(f"{base}/api/sessions", params={"limit": 3, "before": second["next_before"]}, timeout=10).json()
    assert [r["id"] for r in last["sessions"]] == everyone[6:] and last["next_before"] is None
    bad = http.get(f"{base}/api/sessions", params={"recovered": "maybe"}, timeout=10)
    assert bad.status_code == 400 and "recovered" in bad.json()["detail"]
    page = http.get(f"{base}/", params={"failed": "true"}, timeout=10)
    assert page.status_code == 200 and f'href="/sessions/{failed}"' in page.text
    assert f'href="/sessions/{old}"' not in page.text


def _tree() -> tuple[int, int, int, int, int]:
    """A parent -> two children -> one grandchild, with a delegating round in the parent's history."""
    parent = make_session(phase=Phase.RUNNING, agent_type="main")
    add_message(parent, Role.USER, SECRET_TASK)
    calls = [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "delegate", "arguments": json.dumps({"task": SECRET_TASK})},
        },
        {"id": "call_b", "type": "function", "function": {"name": "echo", "arguments": '{"text": "hi"}'}},
    ]
    add_message(parent, Role.ASSISTANT, None, tool_calls=calls)
    add_message(parent, Role.TOOL, "echoed: hi", tool_call_id="call_b")
    e1 = make_execution(
        parent,
        tool_call_id="call_a",
        status=ExecutionStatus.RECOVERING,
        epoch=3,
        recoveries=1,
        lease_owner="w2@host",
        lease_expires_at=utcnow() + timedelta(seconds=30),
        rounds=2,
        prompt_tokens=10,
        completion_tokens=5,
        total_tokens=15,
    )
    e2 = make_execution(
        parent, tool_call_id="call_c", status=ExecutionStatus.COMPLETED, epoch=1, agent_type="researcher"
    )
    child1 = executions_of(parent)[0].child_session_id
    e3 = make_execution(child1, tool_call_id="call_g", agent_type="grandchild")
    return parent, child1, e1, e2, e3


def test_one_session_shows_its_tree_executions_and_timeline_without_content(console: Serve) -> None:
    base = console()
    http = client(base)
    parent, child1, e1, e2, e3 = _tree()
    r = http.get(f"{base}/api/sessions/{parent}", timeout=10)
    assert r.status_code == 200
    d = r.json()
    assert SECRET_TASK not in r.text and "echoed: hi" not in r.text
    tree = d["tree"]
    assert tree["session_id"] == parent and tree["phase"] == "RUNNING" and tree["rounds"] == 1
    assert [c["session_id"] for c in tree["children"]] == [child1, executions_of(parent)[1].child_session_id]
    first = tree["children"][0]
    (ex,) = first["executions"]
    assert ex["id"] == e1 and ex["status"] == "RECOVERING" and ex["delivery_status"] == "PENDING"
    assert ex["epoch"] == 3 and ex["recoveries"] == 1 and ex["lease_owner"] == "w2@host"
    assert ex["lease_expires_at"] and ex["deadline"] and ex["lease_expired"] is False
    assert first["rounds"] == 2 and first["tokens"] == 15  # its execution's counters
    assert first["age_seconds"] >= 0
    assert tree["children"][1]["executions"][0]["id"] == e2
    assert tree["children"][1]["executions"][0]["recoveries"] == 0
    assert [g["executions"][0]["id"] for g in first["children"]] == [e3]  # the grandchild
    assert d["counts"] == {"sessions": 4, "executions": 3, "recovered": 1, "pending_delivery": 3}
    assert d["active"] is True and d["content_shown"] is False
    kinds = [t["kind"] for t in d["timeline"]]
    assert kinds == ["user", "model_reply"]
    user, reply = d["timeline"]
    assert user["size"] == len(SECRET_TASK) and "content" not in user
    by_name = {c["name"]: c for c in reply["tool_calls"]}
    assert by_name["delegate"]["crash"] == "delegated" and by_name["delegate"]["result"] is None
    assert by_name["echo"]["result"]["size"] == len("echoed: hi")
    assert by_name["echo"]["crash"] in ("read_only", "idempotent", "at_most_once")
    assert http.get(f"{base}/api/sessions/999999", timeout=10).status_code == 404
    page = http.get(f"{base}/sessions/{parent}", timeout=10)
    assert page.status_code == 200 and "epoch 3" in page.text and "recovered ×1" in page.text
    assert SECRET_TASK_HTML not in page.text and SECRET_TASK not in page.text


def test_message_content_is_shown_only_when_the_console_is_told_to(console: Serve) -> None:
    base = console(show_content=True)
    http = client(base)
    parent, *_ = _tree()
    d = http.get(f"{base}/api/sessions/{parent}", timeout=10).json()
    assert d["content_shown"] is True
    assert d["timeline"][0]["content"] == SECRET_TASK
    assert SECRET_TASK_HTML in http.get(f"{base}/sessions/{parent}", timeout=10).text


def test_health_shows_the_metrics_figures_the_scan_right_holder_and_the_workers(console: Serve) -> None:
    from recovery.metrics import RecoveryCollector

    base = console()
    http = client(base)
    parent = make_session()
    make_execution(parent, lease_expires_at=utcnow() - timedelta(seconds=600), epoch=1)
    make_execution(parent, status=ExecutionStatus.COMPLETED)
    with transaction() as s:
        s.execute(text("DELETE FROM worker_boot"))
        s.execute(
            text(
                "INSERT INTO worker_boot (name, generation, booted_at, conflict_generation, conflict_seen_at)"
                " VALUES ('worker1@h', 4, now(), 3, now()), ('recovery1@h', 1, now(), NULL, NULL)"
            )
        )
        s.execute(
            text(
                "INSERT INTO recovery_scan (id, started_at, duration_ms, parents, executions, holder, held_until)"
                " VALUES (1, now(), 12, 1, 2, 'recovery1@h/abcd', now() + interval '30 seconds')"
                " ON CONFLICT (id) DO UPDATE SET started_at = now(), duration_ms = 12, parents = 1, executions = 2,"
                " holder = 'recovery1@h/abcd', held_until = now() + interval '30 seconds'"
            )
        )
    h = http.get(f"{base}/api/health", timeout=10).json()
    expected = {f.name: f for f in RecoveryCollector().collect()}
    m = h["metrics"]
    assert m["executions_lease_expired"] == expected["agent_recovery_executions_lease_expired"].samples[0].value == 1
    assert m["parents_waiting"] == 1
    assert {(r["status"], r["value"]) for r in m["executions"] if r["delivery_status"] == "pending" and r["value"]} == {
        ("running", 1.0),
        ("completed", 1.0),
    }
    assert m["worker_name_conflicts"] == 1 and m["last_scan_duration_seconds"] == 0.012
    assert "field_invocations" in m
    assert h["scan"]["holder"] == "recovery1@h/abcd" and h["scan"]["held"] is True and h["scan"]["duration_ms"] == 12
    workers = {w["name"]: w for w in h["workers"]}
    assert workers["worker1@h"]["generation"] == 4 and workers["worker1@h"]["conflict_live"] is True
    assert workers["recovery1@h"]["conflict_generation"] is None
    page = http.get(f"{base}/health", timeout=10)
    assert page.status_code == 200 and "recovery1@h/abcd" in page.text and "worker1@h" in page.text


def _parked_request(model_factory: ModelFactory) -> tuple[int, str]:
    """A parent whose tool call waits for a human decision (the session parked in
    WAITING_APPROVAL); returns its session and the request's call id."""
    from harness.parent import run_agent
    from harness.views import create_session
    from tests.helpers import RecordingScheduler, loop_deps
    from tests.integration.test_approvals import call, parent_script, requests

    model = model_factory(parent_script(call("refund", order="A-1", amount=30)))
    sid = create_session("main", "refund A-1")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "waiting_approval"
    (req,) = requests()
    return sid, req.call_id


def test_pending_approvals_are_listed_in_the_clis_shape_and_waiting_sessions_are_filtered(
    console: Serve, model_factory: ModelFactory, approval_tools: Runs
) -> None:
    sid, call_id = _parked_request(model_factory)
    base = console()
    http = client(base)
    listed = http.get(f"{base}/api/approvals", timeout=10).json()
    assert listed["installed"] is True
    (row,) = listed["approvals"]
    assert (row["session_id"], row["call_id"], row["tool"], row["agent_type"]) == (sid, call_id, "refund", "main")
    assert {"requested_at", "expires_at", "id"} <= set(row)
    assert "arguments" not in row  # users' data: only with CONSOLE_SHOW_CONTENT=true
    shown = console(show_content=True)
    shown_row = client(shown).get(f"{shown}/api/approvals", timeout=10).json()["approvals"][0]
    assert shown_row["arguments"] == {"order": "A-1", "amount": 30}
    waiting = http.get(f"{base}/api/sessions", params={"waiting_approval": "true"}, timeout=10).json()
    assert [r["id"] for r in waiting["sessions"]] == [sid]
    page = http.get(f"{base}/approvals", timeout=10)
    assert page.status_code == 200 and call_id in page.text and "refund" in page.text


def test_an_approval_from_the_console_lands_once_names_the_operator_and_a_conflicting_denial_is_refused(
    console: Serve, model_factory: ModelFactory, approval_tools: Runs
) -> None:
    from tests.integration.test_approvals import requests

    sid, call_id = _parked_request(model_factory)
    base = console()
    http = client(base, operator="alice")
    request_id = http.get(f"{base}/api/approvals", timeout=10).json()["approvals"][0]["id"]
    approved = http.post(f"{base}/api/approvals/{request_id}/approve", json={}, timeout=10)
    assert approved.status_code == 200 and approved.json()["outcome"] == "approved"
    (req,) = requests()
    assert (req.session_id, req.call_id) == (sid, call_id)
    assert (req.status, req.decided_by) == ("APPROVED", "console:alice")
    again = http.post(f"{base}/api/approvals/{request_id}/approve", json={}, timeout=10)
    assert again.status_code == 409 and again.json()["outcome"] == "repeated"
    denied = client(base, operator="bob").post(
        f"{base}/api/approvals/{request_id}/deny", json={"reason": "too late"}, timeout=10
    )
    assert denied.status_code == 409 and denied.json()["outcome"] == "conflict"  # lost its compare-and-set
    (req,) = requests()
    assert (req.status, req.decided_by) == ("APPROVED", "console:alice")  # the first decision stands
    assert approval_tools.starts == []  # the console decides; a loop (enqueued) runs the tool
    assert http.get(f"{base}/api/approvals", timeout=10).json()["approvals"] == []
    missing = http.post(f"{base}/api/approvals/{request_id + 1000}/approve", json={}, timeout=10)
    assert missing.status_code == 404


def test_a_denial_needs_a_reason_and_read_only_mode_refuses_decisions(
    console: Serve, model_factory: ModelFactory, approval_tools: Runs
) -> None:
    from tests.integration.test_approvals import requests

    _parked_request(model_factory)
    base = console()
    http = client(base)
    request_id = http.get(f"{base}/api/approvals", timeout=10).json()["approvals"][0]["id"]
    no_reason = http.post(f"{base}/api/approvals/{request_id}/deny", json={"reason": " "}, timeout=10)
    assert no_reason.status_code == 400 and no_reason.json()["outcome"] == "reason_required"
    ro = console(read_only=True)
    refused = client(ro).post(f"{ro}/api/approvals/{request_id}/approve", json={}, timeout=10)
    assert refused.status_code == 403
    (req,) = requests()
    assert req.status == "PENDING"


# --- the actions -------------------------------------------------------------------------------


def test_cancel_through_the_api_cancels_suppresses_and_logs_the_operator(
    console: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    base = console()
    http = client(base, operator="alice")
    parent = make_session()
    eid = make_execution(parent)
    r = http.post(f"{base}/api/sessions/{parent}/cancel", timeout=10)
    assert r.status_code == 200 and r.json() == {"outcome": "cancelled", "suppressed": [eid]}
    assert phase_of(parent) == Phase.CANCELLED
    assert executions_of(parent)[0].delivery_status == DeliveryStatus.SUPPRESSED
    lines = [rec.getMessage() for rec in caplog.records if "event=session_cancel" in rec.getMessage()]
    assert lines and "actor=console:alice" in lines[0] and "outcome=cancelled" in lines[0]
    assert TOKEN not in caplog.text


def test_a_cancel_that_lost_its_compare_and_set_is_409_and_changes_nothing(console: Serve) -> None:
    base = console()
    http = client(base)
    done = make_session(phase=Phase.COMPLETED)
    r = http.post(f"{base}/api/sessions/{done}/cancel", timeout=10)
    assert r.status_code == 409 and r.json()["outcome"] == "already_stopped"
    assert phase_of(done) == Phase.COMPLETED
    assert http.post(f"{base}/api/sessions/999999/cancel", timeout=10).status_code == 404


def test_an_action_with_a_wrong_or_missing_csrf_token_is_refused_and_changes_nothing(console: Serve) -> None:
    base = console()
    sid = make_session()
    http = client(base)
    for headers in ({"X-CSRF-Token": "forged"}, {"X-CSRF-Token": ""}):
        r = http.post(f"{base}/api/sessions/{sid}/cancel", headers=headers, timeout=10)
        assert r.status_code == 403 and r.json() == {"error": "csrf"}
    other = requests.Session()  # a cookie of its own, the token of another client
    other.headers["Authorization"] = f"Bearer {TOKEN}"
    other.get(f"{base}/api/csrf", timeout=10)
    r = other.post(
        f"{base}/api/sessions/{sid}/cancel", headers={"X-CSRF-Token": http.headers["X-CSRF-Token"]}, timeout=10
    )
    assert r.status_code == 403
    assert phase_of(sid) == Phase.RUNNING


def test_read_only_mode_refuses_every_action_and_shows_no_button(console: Serve) -> None:
    base = console(read_only=True)
    http = client(base)
    parent = make_session()
    eid = make_execution(parent, status=ExecutionStatus.COMPLETED)
    for path in (
        f"/api/sessions/{parent}/cancel",
        f"/api/sessions/{parent}/redeliver",
        f"/api/executions/{eid}/redeliver",
        "/api/approvals/1/approve",
        "/api/approvals/1/deny",
    ):
        r = http.post(base + path, data={"reason": "x", "csrf": http.headers["X-CSRF-Token"]}, timeout=10)
        assert r.status_code == 403 and r.json() == {"error": "read_only"}, path
    form = http.post(
        f"{base}/sessions/{parent}/cancel", data={"csrf": http.headers["X-CSRF-Token"]}, allow_redirects=False
    )
    assert form.status_code == 303 and form.headers["location"] == f"/sessions/{parent}?outcome=read_only"
    assert phase_of(parent) == Phase.RUNNING
    page = http.get(f"{base}/sessions/{parent}", timeout=10).text
    forms = re.findall(r'<form method="post" action="([^"]*)"', page)
    assert forms == ["/logout"] and "read-only" in page  # signing out is all there is to post


def test_the_page_form_cancels_and_returns_to_the_page_with_the_outcome(console: Serve) -> None:
    base = console()
    browser = requests.Session()
    browser.post(
        f"{base}/login", data={"operator": "carol", "token": TOKEN, "csrf": login_csrf(browser, base)}, timeout=10
    )
    sid = make_session()
    page = browser.get(f"{base}/sessions/{sid}", timeout=10).text
    csrf = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
    r = browser.post(f"{base}/sessions/{sid}/cancel", data={"csrf": csrf}, allow_redirects=False, timeout=10)
    assert r.status_code == 303 and r.headers["location"] == f"/sessions/{sid}?outcome=cancelled"
    assert phase_of(sid) == Phase.CANCELLED
    assert "Outcome: <code>cancelled</code>" in browser.get(base + r.headers["location"], timeout=10).text


def test_redeliver_of_a_parent_whose_callback_was_lost_delivers_once_then_has_nothing_to_do(
    console: Serve, model_factory: ModelFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    model = model_factory(one_child_script())
    sid, _ = children_done_delivery_lost(model.base_url)
    (execution,) = executions_of(sid)
    assert execution.status == ExecutionStatus.COMPLETED and execution.delivery_status == DeliveryStatus.PENDING
    base = console()
    http = client(base, operator="dave")
    assert 'class="redeliver-execution"' in http.get(f"{base}/sessions/{sid}", timeout=10).text
    r = http.post(f"{base}/api/executions/{execution.id}/redeliver", timeout=10)
    assert r.status_code == 200 and r.json() == {"outcome": "resume"}
    assert executions_of(sid)[0].delivery_status == DeliveryStatus.DELIVERED
    again = http.post(f"{base}/api/executions/{execution.id}/redeliver", timeout=10)
    assert again.status_code == 409 and again.json() == {"outcome": "already_delivered"}
    parent_again = http.post(f"{base}/api/sessions/{sid}/redeliver", timeout=10)
    assert parent_again.status_code == 409 and parent_again.json() == {"outcome": "nothing_pending"}
    assert http.post(f"{base}/api/executions/999999/redeliver", timeout=10).status_code == 404
    lines = [rec.getMessage() for rec in caplog.records if "event=redeliver" in rec.getMessage()]
    assert any("actor=console:dave" in line and "outcome=resume" in line for line in lines)
    timeline = http.get(f"{base}/api/sessions/{sid}", timeout=10).json()["timeline"]
    (call,) = [c for t in timeline if t["kind"] == "model_reply" for c in t["tool_calls"]]
    assert call["result"]["delivered_from_session_id"] == execution.child_session_id


def test_redeliver_of_a_running_execution_is_409_still_running(console: Serve) -> None:
    base = console()
    http = client(base)
    parent = make_session()
    eid = make_execution(parent)
    assert 'class="redeliver-execution"' not in http.get(f"{base}/sessions/{parent}", timeout=10).text
    r = http.post(f"{base}/api/executions/{eid}/redeliver", timeout=10)
    assert r.status_code == 409 and r.json() == {"outcome": "still_running"}
    assert executions_of(parent)[0].delivery_status == DeliveryStatus.PENDING


def test_the_console_command_refuses_to_listen_beyond_loopback_without_a_token() -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("CONSOLE_")}
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "console", "--host", "0.0.0.0", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("agent-recovery: console: the console listens on 0.0.0.0, beyond loopback")
    assert "CONSOLE_TOKEN" in line


def test_a_session_cookie_made_without_the_token_or_for_another_name_is_answered_401(console: Serve) -> None:
    from console.auth import session_value

    base = console()
    forged = session_value("not-the-token", "mallory")
    renamed = session_value(TOKEN, "alice").replace("alice.", "mallory.", 1)
    for cookie in (forged, renamed, "mallory", ""):
        r = requests.get(f"{base}/api/sessions", cookies={"console_session": cookie}, timeout=10)
        assert r.status_code == 401, cookie
    good = requests.get(f"{base}/api/sessions", cookies={"console_session": session_value(TOKEN, "alice")}, timeout=10)
    assert good.status_code == 200


def test_why_a_session_failed_is_shown_in_the_api_the_pages_and_the_list_filters_by_it(console: Serve) -> None:
    base = console()
    http = client(base)
    parent = make_session(phase=Phase.WAITING_USER)
    child = make_session(
        session_type=SessionType.SUBAGENT,
        phase=Phase.FAILED,
        parent_session_id=parent,
        failure_code="context_too_long",
        failure_message="subagent failed: the provider answered HTTP 413",
    )
    make_execution(
        parent,
        child,
        status=ExecutionStatus.FAILED,
        delivery=DeliveryStatus.PENDING,
        error="subagent failed: the provider answered HTTP 413",
        completed_at=utcnow(),
    )
    other = make_session(phase=Phase.FAILED, failure_code="auth", failure_message="HTTP 401: bad key")
    d = http.get(f"{base}/api/sessions/{parent}", timeout=10).json()
    (node,) = d["tree"]["children"]
    assert (node["failure_code"], node["failure_message"]) == (
        "context_too_long",
        "subagent failed: the provider answered HTTP 413",
    )
    (ex,) = node["executions"]
    assert ex["error"] is True  # the key stays as it was
    assert ex["error_message"] == "subagent failed: the provider answered HTTP 413"
    assert ex["failure_code"] == "context_too_long"
    top = http.get(f"{base}/api/sessions/{other}", timeout=10).json()["tree"]
    assert (top["failure_code"], top["failure_message"]) == ("auth", "HTTP 401: bad key")
    listed = http.get(f"{base}/api/sessions", params={"failure_code": "auth"}, timeout=10).json()["sessions"]
    assert [(r["id"], r["failure_code"]) for r in listed] == [(other, "auth")]
    page = http.get(f"{base}/sessions/{other}", timeout=10).text
    assert 'id="failure-reason"' in page and "auth" in page and "HTTP 401: bad key" in page
    child_page = http.get(f"{base}/sessions/{parent}", timeout=10).text
    assert "context_too_long" in child_page
    rows = http.get(f"{base}/", params={"failure_code": "auth"}, timeout=10).text
    assert f'href="/sessions/{other}"' in rows and f'href="/sessions/{child}"' not in rows
