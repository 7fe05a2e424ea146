"""An approver sees what they approve: every argument of a pending call, in the console and at
the CLI, never cut silently; and the approval commands end in one line and a documented exit
code whatever goes wrong (docs/console.md). Real PostgreSQL, a scripted model over loopback,
each command in a subprocess as an operator runs it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from markupsafe import escape

from tests.integration.test_approvals import AGENTS, Runs, call, cli, parent_script, parked_parent
from tests.integration.test_approvals import runs as runs  # the fixture
from tests.integration.test_console_api import Serve, client
from tests.integration.test_console_api import console as console  # the fixture
from tests.types import ModelFactory

#: Longer than any summary: an approver must see its end.
ORDER = "<b>A-" + "7" * 150 + "-END</b>"
AMOUNT = 98765


@pytest.fixture
def parked(model_factory: ModelFactory, runs: Runs) -> tuple[int, str, Any]:
    """A parent parked on ``refund(order=ORDER, amount=AMOUNT)``: its session, call id, deps."""
    from tests.integration.test_approvals import requests

    model = model_factory(parent_script(call("refund", order=ORDER, amount=AMOUNT)))
    sid, deps = parked_parent(model.base_url)
    (req,) = requests()
    return sid, req.call_id, deps


@pytest.fixture
def env(db: str, runs: Runs, tmp_path: Any) -> dict[str, str]:
    """The CLI's processes: tests.approval_tools' tools (``wire_money`` lives in this process only,
    so their agents file has no ``approve = ["wire_*"]``, a rule that would match none of theirs)."""
    agents = tmp_path / "agents_cli.toml"
    agents.write_text(AGENTS.replace('approve = ["wire_*"]\n', ""), encoding="utf-8")
    return {"DATABASE_URL": db, "TOOL_MODULES": "tests.approval_tools", "AGENTS_FILE": str(agents)}


def test_the_console_shows_every_argument_of_a_pending_call_and_the_api_gives_them_as_an_object(
    console: Serve, parked: tuple[int, str, Any]
) -> None:
    base = console(show_content=True)
    http = client(base)
    (row,) = http.get(f"{base}/api/approvals", timeout=10).json()["approvals"]
    assert row["arguments"] == {"order": ORDER, "amount": AMOUNT}
    assert isinstance(row["summary"], str) and row["summary"].startswith('{"order": "<b>A-777')
    page = http.get(f"{base}/approvals", timeout=10).text
    assert str(escape(ORDER)) in page and str(AMOUNT) in page  # whole, never cut
    assert ORDER not in page  # escaped
    assert '<pre class="arguments"' in page
    hidden = console(show_content=False)
    (bare,) = client(hidden).get(f"{hidden}/api/approvals", timeout=10).json()["approvals"]
    assert "arguments" not in bare and "summary" not in bare  # users' data: only when told
    page = client(hidden).get(f"{hidden}/approvals", timeout=10).text
    assert ORDER not in page and "arguments hidden" in page


@pytest.mark.usefixtures("parked")
def test_approvals_json_gives_the_arguments_as_an_object_and_a_summary(env: dict[str, str]) -> None:
    listed = cli("approvals", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert row["arguments"] == {"order": ORDER, "amount": AMOUNT}
    assert len(row["summary"]) <= 60 and row["summary"].endswith("…")
    text = cli("approvals", env=env)
    assert text.returncode == 0 and row["summary"] in text.stdout


def test_approvals_show_prints_one_request_whole_and_names_a_missing_one(
    env: dict[str, str], parked: tuple[int, str, Any]
) -> None:
    sid, call_id, _ = parked
    shown = cli("approvals", "show", str(sid), call_id, env=env)
    assert shown.returncode == 0, shown.stderr
    assert ORDER in shown.stdout and f'"amount": {AMOUNT}' in shown.stdout
    assert "PENDING" in shown.stdout and "refund" in shown.stdout
    as_json = json.loads(cli("approvals", "show", str(sid), call_id, "--json", env=env).stdout)
    assert as_json["arguments"] == {"order": ORDER, "amount": AMOUNT}
    assert as_json["status"] == "PENDING" and as_json["approved_arguments"] is None
    missing = cli("approvals", "show", str(sid), "no-such-call", env=env)
    assert missing.returncode == 3 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines() == [
        f"agent-recovery: approvals show: no approval request for session {sid} call no-such-call"
    ]


def test_session_show_prints_the_original_and_the_edited_arguments(
    env: dict[str, str], parked: tuple[int, str, Any]
) -> None:
    sid, call_id, _ = parked
    edited = {"order": ORDER, "amount": 5}
    done = cli("approve", str(sid), call_id, "--by", "carol", "--arguments", json.dumps(edited), env=env)
    assert done.returncode == 0, done.stderr
    shown = cli("session", "show", str(sid), env=env)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    (asked,) = [ln for ln in lines if ln.strip().startswith("arguments:")]
    (ran,) = [ln for ln in lines if ln.strip().startswith("edited to:")]
    assert ORDER in asked and str(AMOUNT) in asked
    assert json.loads(ran.split(":", 1)[1]) == edited
    snap = json.loads(cli("session", "show", str(sid), "--json", env=env).stdout)
    (approval,) = snap["approvals"]
    assert approval["arguments"]["amount"] == AMOUNT and approval["approved_arguments"] == edited
    assert approval["edited_arguments"] is True


def test_an_approval_names_its_user_agent_and_parent_and_links_to_its_call(
    console: Serve, model_factory: ModelFactory, runs: Runs
) -> None:
    from harness.child import start_child
    from harness.parent import run_agent
    from harness.views import create_session
    from tests.helpers import RecordingScheduler, executions_of, loop_deps
    from tests.integration.test_approvals import child_script, requests, session_row

    model = model_factory(child_script(call("refund", order="C-1", amount=3)))
    deps = loop_deps(model.base_url, RecordingScheduler())
    parent = create_session("main", "go")
    run_agent(parent, 0, deps)
    (execution,) = executions_of(parent)
    start_child(execution.id, execution.epoch, deps)
    (req,) = requests()
    assert req.session_id == execution.child_session_id
    base = console(show_content=True)
    http = client(base)
    (row,) = http.get(f"{base}/api/approvals", timeout=10).json()["approvals"]
    assert row["parent_session_id"] == parent and row["user_id"] == session_row(req.session_id).user_id
    page = http.get(f"{base}/approvals", timeout=10).text
    assert f'href="/sessions/{parent}"' in page  # the parent
    assert f'href="/sessions/{req.session_id}#call-{req.call_id}"' in page  # the call in its timeline
    child_page = http.get(f"{base}/sessions/{req.session_id}", timeout=10).text
    assert f'id="call-{req.call_id}"' in child_page
