"""``on_budget_exhausted = "ask"``: a refused reservation parks the tree on a durable approval
request to raise its budget (docs/usage.md, "When the budget runs out: ask"). Real PostgreSQL,
the scripted model over HTTP reporting known usage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select, text

from cli.main import main
from harness.parent import run_agent
from harness.views import create_session
from models import AgentSession, transaction
from models.approval import ApprovalRequest
from models.budget import TreeBudget
from tests.helpers import infra_fault_at, loop_deps
from tests.types import ModelFactory

pytestmark = pytest.mark.usefixtures("db", "redis_url")

USAGE = {"prompt_tokens": 1000, "completion_tokens": 200}
FOREVER_ECHO: list[dict[str, Any]] = [
    {
        "when": {"system_contains": "main agent"},
        "reply": {"tool_calls": [{"name": "echo", "arguments": {"text": "x"}}], "usage": USAGE},
    }
]


@pytest.fixture
def asking_main(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[None]:
    """AGENTS_FILE: the built-in agents, ``main`` asking when its budget runs out, its calls
    reserving ~1000 tokens each."""
    from harness.agents import DEFAULT_AGENTS_TOML, _load
    from settings import get_settings

    agents = tmp_path / "agents.toml"
    agents.write_text(
        DEFAULT_AGENTS_TOML.replace(
            "max_rounds = 20\n", 'max_rounds = 20\nmax_tokens = 1000\non_budget_exhausted = "ask"\n', 1
        ),
        encoding="utf-8",
    )
    monkeypatch.setenv("AGENTS_FILE", str(agents))
    get_settings.cache_clear()
    _load.cache_clear()
    yield
    monkeypatch.undo()
    get_settings.cache_clear()
    _load.cache_clear()


def _state(sid: int) -> tuple[str, str | None, list[tuple[str, str, str]]]:
    with transaction() as s:
        row = s.get(AgentSession, sid)
        assert row is not None
        rows = s.execute(select(ApprovalRequest).where(ApprovalRequest.session_id == sid).order_by(ApprovalRequest.id))
        asked = [(r.call_id, str(r.status), r.arguments) for r in rows.scalars()]
        return str(row.phase), row.failure_code, asked


def _epoch(sid: int) -> int:
    with transaction() as s:
        row = s.get(AgentSession, sid)
        assert row is not None and str(row.phase) == "RUNNING"  # handed back to a loop
        return int(row.epoch)


@pytest.mark.usefixtures("asking_main")
def test_a_tree_that_asks_waits_for_a_raise_resumes_when_approved_and_stops_when_denied(
    model_factory: ModelFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    import harness.budget_request

    model = model_factory(FOREVER_ECHO)
    deps = loop_deps(model.base_url)
    sid = create_session("main", "go", budget_tokens=2500)
    # Two calls fit (each reserves ~1000, spends 1200); the third is refused: the request is
    # recorded and the session parked in one transaction, then the worker dies.
    with infra_fault_at(harness.budget_request, "budget.after_ask"):
        assert run_agent(sid, 0, deps) == "infra_error"
    phase, code, asked = _state(sid)
    assert (phase, code) == ("WAITING_APPROVAL", None)
    ((first, status, _),) = asked
    assert first.startswith("budget-") and status == "PENDING"
    served = len(model.journal())
    assert served == 2
    # The approver names the amount (the request's edited arguments); the budget is raised in
    # the decision's transaction and the session handed back to a loop.
    assert main(["approve", str(sid), first, "--arguments", '{"tokens": 2400}', "--by", "ada"]) == 0
    with transaction() as s:
        budget = s.get(TreeBudget, sid)
        assert budget is not None and budget.budget_tokens == 4900
    assert run_agent(sid, _epoch(sid), deps) == "waiting_approval"  # two calls more, then it asks again
    assert len(model.journal()) == served + 2
    phase, code, asked = _state(sid)
    second = asked[-1][0]
    assert phase == "WAITING_APPROVAL" and second != first and asked[-1][1] == "PENDING"
    assert main(["deny", str(sid), second, "--reason", "enough", "--by", "ada"]) == 0
    assert run_agent(sid, _epoch(sid), deps) == "failed"
    assert len(model.journal()) == served + 2  # denied: no model call more
    phase, code, asked = _state(sid)
    assert (phase, code) == ("FAILED", "budget_exhausted")
    assert [st for _, st, _ in asked] == ["APPROVED", "DENIED"]
    from recovery.invariants import check_all

    with transaction() as s:
        assert check_all(s, settled=True) == []  # A1-A3 hold for budget requests too
    assert json.loads(asked[0][2]) == {"tokens": json.loads(asked[0][2])["tokens"]}


def test_an_agent_asks_or_stops_and_nothing_else() -> None:
    from harness.agents import parse_agents
    from harness.errors import AgentConfigError

    base = '[agents.x]\nsystem_prompt = "p"\n'
    assert parse_agents(base)["x"].on_budget_exhausted == "stop"
    assert parse_agents(base + 'on_budget_exhausted = "ask"\n')["x"].on_budget_exhausted == "ask"
    with pytest.raises(AgentConfigError, match="on_budget_exhausted"):
        parse_agents(base + 'on_budget_exhausted = "beg"\n')


@pytest.mark.usefixtures("asking_main")
def test_a_decided_budget_request_is_purged_after_the_retention_and_a_pending_one_never(
    model_factory: ModelFactory,
) -> None:
    from datetime import timedelta

    from models.approval import purge_decided
    from models.base import utcnow

    model = model_factory(FOREVER_ECHO)
    sid = create_session("main", "go", budget_tokens=1500)
    assert run_agent(sid, 0, loop_deps(model.base_url)) == "waiting_approval"
    with transaction() as s:
        assert purge_decided(s, retention_days=0) == 0  # pending: kept
        s.execute(
            text("UPDATE approval_request SET status = 'DENIED', decided_at = :t WHERE session_id = :sid"),
            {"t": utcnow() - timedelta(days=2), "sid": sid},
        )
    with transaction() as s:
        assert purge_decided(s, retention_days=1) == 1
