"""The console's safety in a real browser (Debian's Chromium): a site whose name was rebound to
127.0.0.1 gets nothing from a console on loopback without a token, and the console's pages
work under its Content-Security-Policy (no inline script: the cancel button's question comes
from the console's own script file); an approver signed in sees a call's every argument, and the
session's page then lists who approved it; a failed session's reason is on its page and in the
list, which finds it by that reason."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from console.auth import ConsoleConfig
from devstack.processes import ROOT
from models import Phase
from tests.browser.conftest import REBOUND_NAME, wait_js
from tests.console_server import serve
from tests.helpers import make_session, phase_of
from tests.integration.test_approvals import Runs
from tests.integration.test_approvals import runs as runs  # the fixture
from tests.types import ModelFactory

pytestmark = [pytest.mark.timeout(120)]

TOKEN = "browser-safety-token"
IMG = ROOT / "docs" / "img"  # docs/console.md's screenshots


def test_a_site_rebound_to_loopback_reads_nothing_and_cancels_nothing(
    db: str, redis_url: str, browser_page: Any
) -> None:
    page = browser_page
    sid = make_session()
    with serve(ConsoleConfig(token="", read_only=False, show_content=False)) as base:
        port = base.rsplit(":", 1)[1]
        rebound = f"http://{REBOUND_NAME}:{port}"
        # The attacker's page, same origin as the rebound name: the console answers it nothing.
        answer = page.goto(f"{rebound}/")
        assert answer is not None and answer.status == 400
        assert "host_not_allowed" in page.content()
        seen = page.evaluate(
            """async (sid) => {
                const csrf = await fetch('/api/csrf');
                const list = await fetch('/api/sessions');
                const cancel = await fetch(`/api/sessions/${sid}/cancel`, {method: 'POST'});
                return [csrf.status, list.status, cancel.status, await list.text()];
            }""",
            sid,
        )
        assert seen[:3] == [400, 400, 400]
        assert str(sid) not in seen[3]
        assert phase_of(sid) == Phase.RUNNING
        # The same browser, by the console's own name, is served.
        ok = page.goto(f"{base}/sessions/{sid}")
        assert ok is not None and ok.status == 200
        assert page.locator("#session-phase").inner_text() == "RUNNING"


def test_the_cancel_button_asks_first_under_the_content_security_policy(
    db: str, redis_url: str, browser_page: Any
) -> None:
    page = browser_page
    violations: list[str] = []
    page.on("console", lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None)
    questions: list[str] = []
    answers = iter([False, True])  # first No, then Yes

    def answer(dialog: Any) -> None:
        questions.append(dialog.message)
        if next(answers):
            dialog.accept()
        else:
            dialog.dismiss()

    page.on("dialog", answer)
    sid = make_session()
    with serve(ConsoleConfig(token="", read_only=False, show_content=False)) as base:
        page.goto(f"{base}/sessions/{sid}")
        page.click("#cancel")
        page.wait_for_timeout(300)
        assert questions == [f"Cancel session {sid}?"]
        assert phase_of(sid) == Phase.RUNNING  # answered No: nothing sent
        page.click("#cancel")
        page.wait_for_url(re.compile(r".*outcome=cancelled"))
        assert len(questions) == 2
        assert page.locator("#session-phase").inner_text() == "CANCELLED"
    assert violations == []


def test_a_signed_in_approver_sees_every_argument_and_approves(
    model_factory: ModelFactory, runs: Runs, browser_page: Any, tmp_path: Path
) -> None:
    from console.operators import Operators, hash_token
    from tests.integration.test_approvals import call, parent_script, parked_parent, requests

    page = browser_page
    order = "A-" + "9" * 300 + "-LAST"
    model = model_factory(parent_script(call("refund", order=order, amount=4321)))
    sid, _ = parked_parent(model.base_url)
    operators = tmp_path / "operators.toml"
    operators.write_text(f'[[operators]]\nname = "erin"\nrole = "approver"\ntoken_hash = "{hash_token(TOKEN)}"\n')
    config = ConsoleConfig(token="", read_only=False, show_content=True, operators=Operators(str(operators)))
    with serve(config) as base:
        page.goto(f"{base}/login")
        page.fill("input[name=operator]", "erin")
        page.fill("input[name=token]", TOKEN)
        page.click("form.login button[type=submit]")
        page.wait_for_url(f"{base}/")
        assert page.locator("#role").inner_text() == "approver"
        page.goto(f"{base}/sessions/{sid}")
        assert page.locator("#cancel").count() == 0  # an approver cancels nothing
        assert page.locator("#session-approvals").is_visible()
        page.goto(f"{base}/approvals")
        (req,) = requests()
        shown = page.locator(f"#arguments-{req.id}")
        assert json.loads(shown.inner_text()) == {"order": order, "amount": 4321}  # whole
        box = shown.bounding_box()
        assert box is not None and box["width"] < 1280  # folded onto lines, not off the page
        page.locator(f"tr[data-request-id='{req.id}'] button.approve").click()
        page.wait_for_url(re.compile(r".*outcome=approved"))
        # The session's page names who approved which call, and that it landed.
        page.goto(f"{base}/sessions/{sid}")
        rows = page.locator("#actions tbody tr")
        assert rows.count() == 1
        cells = rows.first.locator("td").all_inner_texts()
        assert cells[1:] == ["console:erin", "approve", f"call {req.call_id}", "decided"], cells
    (req,) = requests()
    assert (req.session_id, req.status, req.decided_by) == (sid, "APPROVED", "console:erin")


def test_a_failed_sessions_reason_is_on_its_page_and_the_list_finds_it_by_reason(
    model_factory: ModelFactory, browser_page: Any
) -> None:
    from harness.parent import run_agent
    from harness.views import create_session
    from tests.helpers import RecordingScheduler, loop_deps

    page = browser_page
    model = model_factory(
        [
            {
                "when": {"system_contains": "main agent"},
                "reply": {"error": {"status": 400, "message": "This model's maximum context length is 8192 tokens"}},
            }
        ]
    )
    failed = create_session("main", "a task too long for its model")
    assert run_agent(failed, 0, loop_deps(model.base_url, RecordingScheduler())) == "failed"
    other = make_session()  # running, no reason: the filter leaves it out
    with serve(ConsoleConfig(token="", read_only=False, show_content=False)) as base:
        page.goto(f"{base}/sessions/{failed}")
        assert page.locator("#session-phase").inner_text() == "FAILED"
        reason = page.locator("#failure-reason").inner_text()
        assert "context_too_long" in reason and "HTTP 400" in reason, reason
        page.screenshot(path=str(IMG / "console-failed.png"), full_page=True)
        page.goto(f"{base}/")
        assert "context_too_long" in page.locator(f"#sessions tr:has(a[href='/sessions/{failed}'])").inner_text()
        page.fill("input[name=failure_code]", "context_too_long")
        page.locator("form.filters:has(input[name=failure_code]) button[type=submit]").click()
        page.wait_for_url(re.compile(r".*failure_code=context_too_long"))
        listed = page.locator("#sessions tbody a[href^='/sessions/']").all_inner_texts()
        assert listed == [str(failed)], listed
        assert page.locator(f"#sessions a[href='/sessions/{other}']").count() == 0


def test_a_keyboard_user_cancels_a_running_session_while_its_page_updates(
    db: str, redis_url: str, browser_page: Any
) -> None:
    from sqlalchemy import text

    from models import transaction
    from tests.helpers import make_execution

    page = browser_page
    page.on("dialog", lambda dialog: dialog.accept())
    statuses: list[int] = []
    page.on("response", lambda r: statuses.append(r.status) if "/live" in r.url else None)
    sid = make_session()
    eid = make_execution(sid)
    with serve(ConsoleConfig(token="", read_only=False, show_content=False)) as base:
        page.goto(f"{base}/sessions/{sid}")
        for _ in range(40):  # the keyboard only: Tab until the Cancel button has the focus
            page.keyboard.press("Tab")
            if page.evaluate("document.activeElement.id") == "cancel":
                break
        assert page.evaluate("document.activeElement.id") == "cancel"
        wait_js(page, "document.getElementById('live').dataset.swappedAt !== undefined", timeout=10)
        swapped = page.evaluate("document.getElementById('live').dataset.swappedAt")
        page.wait_for_timeout(2500)  # unchanged: answered 304, nothing swapped
        assert 304 in statuses
        assert page.evaluate("document.getElementById('live').dataset.swappedAt") == swapped
        with transaction() as s:
            s.execute(text("UPDATE subagent_execution SET epoch = 7 WHERE id = :id"), {"id": eid})
        wait_js(page, "document.getElementById('tree').innerText.includes('epoch 7')", timeout=10)
        assert page.evaluate("document.activeElement.id") == "cancel"  # the swap kept the focus
        page.keyboard.press("Enter")
        page.wait_for_url(re.compile(r".*outcome=cancelled"))
    assert phase_of(sid) == Phase.CANCELLED
