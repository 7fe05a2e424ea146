"""The console in a real browser, on a real stack: a parent delegates to two children, the worker
running them is SIGKILLed, a new worker recovers them; the session's page, opened once and never
reloaded, shows the recovered children with their epochs and then the finished session. The
screenshots of the README (docs/img/) are taken here."""

from __future__ import annotations

import re
from typing import Any

import pytest

from console.auth import ConsoleConfig
from demo.stack import ROOT
from tests.console_server import serve
from tests.helpers import executions_of, make_session, wait_until
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
    {"when": {"system_contains": "subagent", "turn": 1}, "reply": {"content": "child answer"}},
]


def sign_in(page: Any, base: str, operator: str = "alice") -> None:
    page.goto(f"{base}/login")
    page.fill("input[name=operator]", operator)
    page.fill("input[name=token]", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/")


def children_running(parent: int) -> bool:
    execs = executions_of(parent)
    return len(execs) == 2 and all(e.epoch >= 1 and e.status == "RUNNING" for e in execs)


def test_a_sigkilled_delegation_recovers_and_finishes_on_a_page_that_is_never_reloaded(
    stack_factory: StackFactory, browser_page: Any
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
        epochs = page.locator("li.node.depth-1 .epoch").all_inner_texts()
        assert any(int(re.sub(r"\D", "", e)) >= 3 for e in epochs), epochs
        IMG.mkdir(parents=True, exist_ok=True)
        page.locator("#tree").screenshot(path=str(IMG / "console-tree.png"))

        page.wait_for_function("document.getElementById('session-phase').innerText === 'WAITING_USER'", timeout=90_000)
        assert page.evaluate("window.__loadedOnce") is True  # the same document: never reloaded
        assert page.locator("#live-badge").count() == 0  # settled: no longer live
        assert page.locator("text=delivered from").count() == 2
        assert "recovered ×1" in page.locator("#tree").inner_text()
        page.screenshot(path=str(IMG / "console-session.png"), full_page=True)

        page.goto(f"{base}/health")
        assert "w2" in page.locator("#workers").inner_text()
        page.screenshot(path=str(IMG / "console-health.png"), full_page=True)
        page.goto(f"{base}/")
        assert page.locator(f'a[href="/sessions/{sid}"]').count() >= 1
        assert TOKEN not in page.content()
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
        assert page.locator("form[method=post]").count() == 0
