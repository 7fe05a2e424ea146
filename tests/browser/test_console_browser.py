"""The console in a real browser, on a real stack: a parent delegates to two children, the worker
running them is SIGKILLed, a new worker recovers them; each child then asks for a tool that needs
a human yes (``refund``); the operator presses Approve on the approvals page; the session's page,
opened once and never reloaded, shows the recovered children with their epochs, the children
waiting for approval, and then the finished session. The screenshots of docs/console.md (docs/img/)
are taken here."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from console.auth import ConsoleConfig
from devstack.processes import ROOT
from tests.browser.conftest import wait_js
from tests.console_server import serve
from tests.helpers import approval_environment, executions_of, make_session, wait_until
from tests.types import StackFactory

pytestmark = [pytest.mark.crash, pytest.mark.timeout(240)]

TOKEN = "browser-test-token"
IMG = ROOT / "docs" / "img"
MAIN = "main agent"
SCRIPT = [
    {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "review A"}},
                {"name": "delegate", "arguments": {"agent_type": "researcher", "task": "research B"}},
            ]
        },
    },
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "final: {tool_results}"}},
    {
        "when": {"system_contains": "subagent", "turn": 0},
        "reply": {"tool_calls": [{"name": "wait", "arguments": {"seconds": 4}}]},
    },
    {
        "when": {"system_contains": "subagent", "turn": 1},
        "reply": {"tool_calls": [{"name": "refund", "arguments": {"order": "A-1", "amount": 30}}]},
    },
    {"when": {"system_contains": "subagent", "turn": 2}, "reply": {"content": "child answer"}},
]
AGENTS = """
[agents.main]
system_prompt = "You are the main agent."
[agents.reviewer]
system_prompt = "You are the reviewer subagent."
[agents.researcher]
system_prompt = "You are the researcher subagent."
"""


@pytest.fixture
def approval_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """AGENTS_FILE and TOOL_MODULES (``tests.approval_tools``: ``refund`` needs approval) for this
    process and every worker; returns the file each run of ``refund`` appends a line to."""
    yield from approval_environment(monkeypatch, tmp_path, AGENTS)


def sign_in(page: Any, base: str, operator: str = "alice") -> None:
    page.goto(f"{base}/login")
    page.fill("input[name=operator]", operator)
    page.fill("input[name=token]", TOKEN)
    page.click("form.login button[type=submit]")
    page.wait_for_url(f"{base}/")


def children_running(parent: int) -> bool:
    execs = executions_of(parent)
    return len(execs) == 2 and all(e.epoch >= 1 and e.status == "RUNNING" for e in execs)


def test_a_killed_delegation_recovers_then_an_approval_pressed_in_the_console_finishes_it_unreloaded(
    stack_factory: StackFactory, browser_page: Any, approval_env: Path
) -> None:
    page = browser_page
    stack = stack_factory(SCRIPT)
    w1 = stack.worker("w1")
    sid = stack.submit("go")
    wait_until(lambda: children_running(sid), timeout=30, what="both children running")
    with serve(ConsoleConfig(token=TOKEN, read_only=False, show_content=False)) as base:
        sign_in(page, base)
        page.goto(f"{base}/sessions/{sid}")
        page.evaluate("window.__loadedOnce = true")  # gone if the page were reloaded
        assert page.locator("#session-phase").inner_text() == "RUNNING"
        assert page.locator("#live-badge").is_visible()
        assert page.locator("li.node.depth-1").count() == 2

        w1.kill()
        stack.worker("w2", beat=True)
        # The page polls its live part: the recovered children appear without a reload.
        page.wait_for_selector("text=recovered ×1", timeout=90_000)
        # The scan's reservation counts the recovery (epoch 2); the recovery's take follows (3).
        wait_js(
            page,
            "[...document.querySelectorAll('li.node.depth-1 .epoch')]"
            ".some(e => parseInt(e.innerText.replace(/\\D/g, '')) >= 3)",
            timeout=90,
        )
        epochs = page.locator("li.node.depth-1 .epoch").all_inner_texts()
        assert any(int(re.sub(r"\D", "", e)) >= 3 for e in epochs), epochs
        IMG.mkdir(parents=True, exist_ok=True)
        page.locator("#tree").screenshot(path=str(IMG / "console-tree.png"))

        # Each recovered child asks for `refund`, which needs a human yes: both park.
        wait_js(
            page,
            "document.querySelectorAll('li.node.depth-1').length === 2 && "
            "[...document.querySelectorAll('li.node.depth-1')].every(n => n.innerText.includes('WAITING_APPROVAL'))",
            timeout=90,
        )
        assert approval_env.exists() is False  # nothing ran before a decision
        approvals = page.context.new_page()  # a second tab: the session's page stays as it is
        approvals.goto(f"{base}/approvals")
        assert approvals.locator("#approvals tbody tr[data-request-id]").count() == 2
        # Each child's request names its parent session, with a link to it.
        assert approvals.locator(f'#approvals a[href="/sessions/{sid}"]').count() == 2
        approvals.screenshot(path=str(IMG / "console-approvals.png"), full_page=True)
        for n in (2, 1):
            approvals.locator("#approvals button.approve").first.click()
            approvals.wait_for_url(re.compile(r".*outcome=approved"))
            assert approvals.locator("#approvals tbody tr[data-request-id]").count() == n - 1
        approvals.close()

        try:
            wait_js(page, "document.getElementById('session-phase').innerText === 'WAITING_USER'", timeout=90)
        except AssertionError:
            print("session", json.dumps(stack.snapshot(sid), default=str)[:3000])
            for w in stack.workers:
                print(f"---- {w.log_path}\n{w.log()[-6000:]}")
            raise
        assert page.evaluate("window.__loadedOnce") is True  # the same document: never reloaded
        assert page.locator("#live-badge").count() == 0  # settled: no longer live
        assert page.locator("text=delivered from").count() == 2
        assert "recovered ×1" in page.locator("#tree").inner_text()
        page.screenshot(path=str(IMG / "console-session.png"), full_page=True)

        page.goto(f"{base}/health")
        assert "w2" in page.locator("#workers").inner_text()
        # The live worker says so (its watcher wrote its presence); the verdict comes first.
        assert page.locator("#workers tr[data-worker^='w2'] .badge.alive").count() == 1
        assert page.locator("#verdict").is_visible()
        page.screenshot(path=str(IMG / "console-health.png"), full_page=True)
        page.goto(f"{base}/")
        assert page.locator(f'a[href="/sessions/{sid}"]').count() >= 1
        assert TOKEN not in page.content()
    runs = [json.loads(line) for line in approval_env.read_text().splitlines()]
    assert len(runs) == 2 and {r["order"] for r in runs} == {"A-1"}  # once per child, after the approval
    assert stack.invariants() == []


def test_the_cancel_button_cancels_the_session_and_read_only_mode_shows_no_button(
    db: str, redis_url: str, browser_page: Any
) -> None:
    page = browser_page
    page.on("dialog", lambda dialog: dialog.accept())
    sid = make_session()
    with serve(ConsoleConfig(token=TOKEN, read_only=False, show_content=False)) as base:
        sign_in(page, base, operator="bob")
        page.goto(f"{base}/sessions/{sid}")
        page.click("#cancel")
        page.wait_for_url(re.compile(r".*outcome=cancelled"))
        assert page.locator("#session-phase").inner_text() == "CANCELLED"
        assert page.locator("#cancel").count() == 0
    with serve(ConsoleConfig(token=TOKEN, read_only=True, show_content=False)) as base:
        other = make_session()
        sign_in(page, base, operator="bob")
        page.goto(f"{base}/sessions/{other}")
        assert page.locator("#cancel").count() == 0
        assert page.locator("form[method=post]:not([action='/logout'])").count() == 0
