"""A budget request approved in a real browser (Debian's Chromium): the approvals page's
Approve form of a ``budget.raise`` request has an input per kind it asks for, pre-filled with
the request's amount; the approver types another and presses Approve; the tree's budget is
raised by what was typed (docs/console.md, "Approvals")."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from console.auth import ConsoleConfig
from tests.console_server import serve
from tests.integration.test_console_budget_approve import FOREVER_ECHO, _budget, _parked, _request
from tests.integration.test_console_budget_approve import asking_main as asking_main  # the fixture
from tests.types import ModelFactory

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("db", "redis_url", "asking_main")]

TOKEN = "browser-budget-token"


def test_an_approver_types_the_amount_of_a_budget_raise_and_the_tree_is_raised_by_it(
    model_factory: ModelFactory, browser_page: Any
) -> None:
    page = browser_page
    model = model_factory(FOREVER_ECHO)
    sid, req = _parked(model.base_url, budget_tokens=2500)
    asked = json.loads(req.arguments)["tokens"]
    with serve(ConsoleConfig(token=TOKEN, read_only=False, show_content=False)) as base:
        page.goto(f"{base}/login")
        page.fill("input[name=operator]", "dana")
        page.fill("input[name=token]", TOKEN)
        page.click("form.login button[type=submit]")
        page.wait_for_url(f"{base}/")
        page.goto(f"{base}/approvals")
        amount = page.locator(f"#raise-{req.id}-tokens")
        assert amount.input_value() == str(asked)  # pre-filled with the request's
        assert page.locator(f"tr[data-request-id='{req.id}'] button.approve-session").count() == 0
        amount.fill("7000")
        page.locator(f"tr[data-request-id='{req.id}'] button.approve").click()
        page.wait_for_url(re.compile(r".*outcome=approved"))
    decided = _request(sid)
    assert (decided.status, decided.decided_by) == ("APPROVED", "console:dana")
    assert json.loads(decided.approved_arguments or "") == {"tokens": 7000}
    assert _budget(sid).budget_tokens == 2500 + 7000
