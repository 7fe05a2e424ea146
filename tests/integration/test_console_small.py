"""The console's small ones (docs/console.md): bad filters are 400 (never a database outage nor
a traceback), a deny's reason must be text, a session waiting for an approval stays live, the
sign-in form needs its CSRF token, and a page's form that fails goes back to its page with the
outcome and what was typed. A real loopback server, the real PostgreSQL schema."""

from __future__ import annotations

import logging
from urllib.parse import parse_qs, urlsplit

import pytest
import requests
from sqlalchemy import text

from models import Phase
from tests.helpers import make_session
from tests.integration.test_console_api import TOKEN, Serve, client
from tests.integration.test_console_api import console as console  # the fixture
from tests.integration.test_console_bounds import _pending_requests


def csrf_of(html: str) -> str:
    return html.split('name="csrf" value="', 1)[1].split('"', 1)[0]


def test_an_unknown_phase_or_a_nul_byte_in_a_filter_is_400_not_an_outage(
    console: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    base = console()
    http = client(base)
    unknown = http.get(f"{base}/api/sessions", params={"phase": "BOGUS"}, timeout=10)
    assert unknown.status_code == 400 and "phase" in unknown.json()["detail"]
    assert http.get(f"{base}/", params={"phase": "BOGUS"}, timeout=10).status_code == 400
    for name in ("agent", "user", "phase"):
        nul = http.get(f"{base}/api/sessions", params={name: "a\x00b"}, timeout=10)
        assert nul.status_code == 400, name
        assert name in nul.json()["detail"]
    for name in ("tool", "agent"):
        assert http.get(f"{base}/api/approvals", params={name: "a\x00b"}, timeout=10).status_code == 400
    assert "console_database_unavailable" not in caplog.text
    assert "Traceback" not in caplog.text
    assert http.get(f"{base}/api/sessions", params={"phase": "waiting_approval"}, timeout=10).status_code == 200


def test_a_json_deny_whose_reason_is_not_text_is_refused(console: Serve) -> None:
    base = console()
    http = client(base)
    _pending_requests(1)
    (row,) = http.get(f"{base}/api/approvals", timeout=10).json()["approvals"]
    for reason in (None, 5, ["no"], {"a": 1}):
        r = http.post(f"{base}/api/approvals/{row['id']}/deny", json={"reason": reason}, timeout=10)
        assert r.status_code == 400 and r.json()["outcome"] == "reason_required", reason
    assert len(http.get(f"{base}/api/approvals", timeout=10).json()["approvals"]) == 1  # still pending


def test_a_top_level_session_waiting_for_an_approval_stays_live(console: Serve) -> None:
    base = console()
    http = client(base)
    sid = make_session(phase=Phase.WAITING_APPROVAL)
    assert http.get(f"{base}/api/sessions/{sid}", timeout=10).json()["active"] is True
    page = http.get(f"{base}/sessions/{sid}", timeout=10).text
    assert 'data-active="true"' in page and 'id="live-badge"' in page


def test_the_sign_in_form_needs_its_csrf_token(console: Serve) -> None:
    for token in (TOKEN, ""):
        base = console(token=token)
        browser = requests.Session()
        form = {"operator": "mallory", "token": token}
        forged = browser.post(f"{base}/login", data=form, allow_redirects=False, timeout=10)
        assert forged.status_code == 403 and "console_session" not in forged.cookies
        csrf = csrf_of(browser.get(f"{base}/login", timeout=10).text)
        done = browser.post(f"{base}/login", data={**form, "csrf": csrf}, allow_redirects=False, timeout=10)
        assert done.status_code == 303 and "console_session" in done.cookies


def test_a_page_form_that_fails_goes_back_to_its_page_with_the_outcome_and_the_typed_reason(console: Serve) -> None:
    base = console()
    browser = requests.Session()
    csrf = csrf_of(browser.get(f"{base}/login", timeout=10).text)
    browser.post(f"{base}/login", data={"operator": "dan", "token": TOKEN, "csrf": csrf}, timeout=10)
    _pending_requests(1)
    page = browser.get(f"{base}/approvals", timeout=10).text
    request_id = int(page.split('data-request-id="', 1)[1].split('"', 1)[0])
    typed = "refund looks like fraud, call the customer first"
    forged = browser.post(
        f"{base}/approvals/{request_id}/deny", data={"csrf": "forged", "reason": typed}, allow_redirects=False
    )
    assert forged.status_code == 303  # not raw JSON
    back = urlsplit(forged.headers["location"])
    assert back.path == "/approvals" and parse_qs(back.query)["outcome"] == ["csrf"]
    shown = browser.get(base + forged.headers["location"], timeout=10).text
    assert "Outcome: <code>csrf</code>" in shown
    assert f'value="{typed}"' in shown  # the reason typed is still there
    blank = browser.post(f"{base}/approvals/{request_id}/deny", data={"csrf": csrf, "reason": "  "}, timeout=10)
    assert "Outcome: <code>reason_required</code>" in blank.text


def test_a_session_is_found_by_its_id_from_the_list(console: Serve) -> None:
    base = console()
    http = client(base)
    sid = make_session()
    found = http.get(f"{base}/", params={"id": f" {sid} "}, allow_redirects=False, timeout=10)
    assert found.status_code == 303 and found.headers["location"] == f"/sessions/{sid}"
    assert http.get(f"{base}/", params={"id": "x1"}, timeout=10).status_code == 400
    assert 'name="id"' in http.get(f"{base}/", timeout=10).text


def test_a_session_that_settles_while_its_page_is_read_is_never_shown_running_and_settled(
    console: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page's reads see one snapshot. The race this pins: the session's row was read
    RUNNING, the session then ended its turn, and the tree's figures (read after it) found
    nothing live: the page showed RUNNING and stopped polling, for good."""
    from console import queries
    from models import transaction

    sid = make_session(phase=Phase.RUNNING)
    figures = queries.tree_figures

    def session_ends_in_between(s: object, session_id: int) -> object:
        with transaction() as other:  # another connection: the run's own commit
            other.execute(text("UPDATE agent_session SET phase = 'WAITING_USER' WHERE id = :sid"), {"sid": session_id})
        return figures(s, session_id)  # type: ignore[arg-type]

    monkeypatch.setattr(queries, "tree_figures", session_ends_in_between)
    base = console()
    answer = client(base).get(f"{base}/api/sessions/{sid}", timeout=10).json()
    assert (answer["session"]["phase"], answer["active"]) == ("RUNNING", True)
    monkeypatch.setattr(queries, "tree_figures", figures)
    again = client(base).get(f"{base}/api/sessions/{sid}", timeout=10).json()
    assert (again["session"]["phase"], again["active"]) == ("WAITING_USER", False)
