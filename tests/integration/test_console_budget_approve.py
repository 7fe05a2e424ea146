"""The console approves a budget request with the amounts the approver names (docs/console.md,
"Approvals"): the Approve form has an input per kind the request asks for, pre-filled with its
amounts, sent as the decision's edited arguments; refused like any action without the CSRF
token, and refused (nothing decided) when the amounts are not positive numbers. A real
loopback console, real PostgreSQL, the scripted model over HTTP."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import requests

from harness.parent import run_agent
from harness.views import create_session
from models import transaction
from models.approval import ApprovalRequest, ApprovalStatus
from models.budget import TreeBudget
from tests.helpers import RecordingScheduler, loop_deps
from tests.integration.test_budget_ask import FOREVER_ECHO, asking_main
from tests.integration.test_console_api import TOKEN, Serve, client, console, login_csrf
from tests.types import ModelFactory

__all__ = ["asking_main", "console"]  # the fixtures, shared with the budget ask and console API tests

pytestmark = pytest.mark.usefixtures("db", "redis_url")


def _parked(model_url: str, **budget: Any) -> tuple[int, ApprovalRequest]:
    """A top-level session parked on a budget request; returns it and the request."""
    sid = create_session("main", "go", **budget)
    assert run_agent(sid, 0, loop_deps(model_url, RecordingScheduler())) == "waiting_approval"
    return sid, _request(sid)


def _request(sid: int) -> ApprovalRequest:
    with transaction() as s:
        (row,) = s.query(ApprovalRequest).filter_by(session_id=sid).all()
        s.expunge(row)
        return row


def _budget(sid: int) -> TreeBudget:
    with transaction() as s:
        row = s.get(TreeBudget, sid)
        assert row is not None
        s.expunge(row)
        return row


def _signed_in(base: str) -> tuple[requests.Session, str]:
    """A browser signed in as carol, and the CSRF token of the approvals page."""
    browser = requests.Session()
    browser.post(
        f"{base}/login", data={"operator": "carol", "token": TOKEN, "csrf": login_csrf(browser, base)}, timeout=10
    )
    page = browser.get(f"{base}/approvals", timeout=10).text
    return browser, page.split('name="csrf" value="', 1)[1].split('"', 1)[0]


@pytest.mark.usefixtures("asking_main")
def test_the_approvals_page_approves_a_budget_request_with_the_amount_typed_in_its_form(
    console: Serve, model_factory: ModelFactory
) -> None:
    model = model_factory(FOREVER_ECHO)
    sid, req = _parked(model.base_url, budget_tokens=2500)
    asked = json.loads(req.arguments)["tokens"]
    base = console()  # users' data hidden: a budget request's amounts are shown anyway
    (row,) = client(base).get(f"{base}/api/approvals", timeout=10).json()["approvals"]
    assert row["amounts"] == {"tokens": asked} and row["tool"] == "budget.raise"

    browser, csrf = _signed_in(base)
    page = browser.get(f"{base}/approvals", timeout=10).text
    field = re.search(rf'<input name="raise_tokens" id="raise-{req.id}-tokens" value="(\d+)"', page)
    assert field is not None and int(field.group(1)) == asked  # pre-filled with the request's amount
    assert "approve-session" not in page  # a budget request is approved one at a time

    approve = f"{base}/approvals/{req.id}/approve"
    for bad in ("0", "-5", "1.5", "lots", "nan"):
        r = browser.post(approve, data={"csrf": csrf, "raise_tokens": bad}, allow_redirects=False, timeout=10)
        assert r.status_code == 303 and r.headers["location"] == "/approvals?outcome=refused", bad
    r = browser.post(approve, data={"csrf": "forged", "raise_tokens": "4000"}, allow_redirects=False, timeout=10)
    assert r.headers["location"] == "/approvals?outcome=csrf"
    assert (_request(sid).status, _budget(sid).budget_tokens) == (ApprovalStatus.PENDING, 2500)  # nothing decided

    r = browser.post(approve, data={"csrf": csrf, "raise_tokens": "4000"}, allow_redirects=False, timeout=10)
    assert r.status_code == 303 and r.headers["location"] == "/approvals?outcome=approved"
    decided = _request(sid)
    assert (decided.status, decided.decided_by) == (ApprovalStatus.APPROVED, "console:carol")
    assert json.loads(decided.approved_arguments or "") == {"tokens": 4000}
    assert _budget(sid).budget_tokens == 2500 + 4000  # raised by the typed amount, not the request's


@pytest.mark.usefixtures("asking_main")
def test_the_api_approves_a_budget_request_with_edited_amounts_and_refuses_a_grant_for_the_session(
    console: Serve, model_factory: ModelFactory
) -> None:
    model = model_factory(FOREVER_ECHO)
    sid, req = _parked(model.base_url, budget_model_calls=1)
    assert json.loads(req.arguments) == {"model_calls": 1}
    base = console()
    http = client(base, operator="alice")
    url = f"{base}/api/approvals/{req.id}/approve"
    granted = http.post(url, json={"for_session": True}, timeout=10)
    assert granted.status_code == 400 and granted.json()["outcome"] == "refused"
    unknown = http.post(url, json={"arguments": {"model_calls": 3, "gold": 1}}, timeout=10)
    assert unknown.status_code == 400 and unknown.json()["outcome"] == "refused"
    assert _request(sid).status == ApprovalStatus.PENDING
    done = http.post(url, json={"arguments": {"model_calls": 3}}, timeout=10)
    assert done.status_code == 200 and done.json()["outcome"] == "approved"
    assert _budget(sid).budget_model_calls == 1 + 3
