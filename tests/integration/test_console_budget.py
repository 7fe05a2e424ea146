"""The console's session page shows its tree's budget (docs/usage.md, "The budget in the
console"): limit, spent, reserved and estimated per kind, read with the page's other
statements (one query for the tree, whatever its size). Real loopback console, real
PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from harness.views import create_session
from models import SessionType, transaction
from tests.helpers import make_session
from tests.integration.test_console_api import Serve, client, console

__all__ = ["console"]  # the fixture, imported for pytest


def test_a_session_page_shows_its_trees_budget_per_kind_and_a_tree_without_one_says_so(console: Serve) -> None:
    base = console()
    http = client(base)
    root = create_session("main", "go", budget_tokens=5000, budget_usd=0.5, budget_model_calls=9)
    child = make_session(session_type=SessionType.SUBAGENT, phase=None, parent_session_id=root, budget_root_id=root)
    with transaction() as s:
        s.execute(
            text(
                "UPDATE tree_budget SET spent_tokens = 1200, reserved_tokens = 1100, estimated_tokens = 300,"
                " spent_usd = 0.125, reserved_usd = 0.05, estimated_usd = 0.01, model_calls = 3"
                " WHERE root_session_id = :r"
            ),
            {"r": root},
        )
    got = http.get(f"{base}/api/sessions/{child}", timeout=10).json()["budget"]
    assert got == {
        "root_session_id": root,
        "tokens": {"limit": 5000, "spent": 1200, "reserved": 1100, "estimated": 300, "left": 2400},
        "usd": {"limit": 0.5, "spent": 0.125, "reserved": 0.05, "estimated": 0.01, "left": 0.315},
        "model_calls": {"limit": 9, "spent": 3, "reserved": 0, "estimated": 0, "left": 6},
    }
    page = http.get(f"{base}/sessions/{child}", timeout=10).text
    budget = page.split('<section id="budget">', 1)[1].split("</section>", 1)[0]
    assert f'href="/sessions/{root}"' in budget
    for figure in ("5000", "1200", "1100", "300", "2400", "$0.5000", "$0.1250", "$0.0500", "$0.0100", "$0.3150"):
        assert figure in budget
    assert "model calls" in budget
    plain = create_session("main", "go")
    assert http.get(f"{base}/api/sessions/{plain}", timeout=10).json()["budget"] is None
    assert "No budget" in http.get(f"{base}/sessions/{plain}", timeout=10).text


@pytest.mark.usefixtures("db")
def test_the_budget_of_a_tree_is_one_statement_of_the_page_whatever_its_size() -> None:
    from sqlalchemy import event

    from console.queries import read_only, session_detail
    from models.db import get_engine

    root = create_session("main", "go", budget_tokens=5000)
    for _ in range(5):
        make_session(session_type=SessionType.SUBAGENT, phase=None, parent_session_id=root, budget_root_id=root)
    seen: list[str] = []

    def count(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        seen.append(statement)

    engine = get_engine()
    event.listen(engine, "before_cursor_execute", count)
    try:
        with read_only() as s:
            detail = session_detail(s, root)
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert detail is not None and detail["budget"]["tokens"]["limit"] == 5000
    assert sum("tree_budget" in st for st in seen) == 1
