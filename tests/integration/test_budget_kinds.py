"""Budgets in dollars and in model calls beside tokens, and prices per model
(MODEL_PRICES_FILE) giving usage in USD (docs/usage.md, "Prices" and "Budgets"). Real
PostgreSQL, the scripted model over HTTP reporting known usage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli.main import main
from harness.parent import run_agent
from harness.views import create_session
from models import AgentSession, transaction
from models.budget import TreeBudget
from tests.helpers import loop_deps
from tests.types import ModelFactory

pytestmark = pytest.mark.usefixtures("db", "redis_url")

MAIN = "main agent"
USAGE = {"prompt_tokens": 1000, "completion_tokens": 200, "prompt_tokens_details": {"cached_tokens": 400}}
#: Per million tokens: 600 uncached prompt x 1.0 + 400 cached x 0.5 + 200 completion x 2.0.
PRICES = {"scripted": {"input": 1.0, "cached_input": 0.5, "output": 2.0}}
CALL_USD = (600 * 1.0 + 400 * 0.5 + 200 * 2.0) / 1e6
#: The parent calls a tool after every round and never answers.
FOREVER: list[dict[str, Any]] = [
    {
        "when": {"system_contains": MAIN},
        "reply": {"tool_calls": [{"name": "echo", "arguments": {"text": "x"}}], "usage": USAGE},
    }
]


def _budget(root: int) -> TreeBudget:
    with transaction() as s:
        row = s.get(TreeBudget, root)
        assert row is not None
        s.expunge(row)
        return row


def _failure(sid: int) -> tuple[str, str | None]:
    with transaction() as s:
        row = s.get(AgentSession, sid)
        assert row is not None
        return str(row.phase), row.failure_code


@pytest.fixture
def prices(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    from models.prices import load_prices
    from settings import get_settings

    path = tmp_path / "prices.toml"
    path.write_text('["scripted"]\ninput = 1.0\ncached_input = 0.5\noutput = 2.0\n', encoding="utf-8")
    monkeypatch.setenv("MODEL_PRICES_FILE", str(path))
    get_settings.cache_clear()
    load_prices.cache_clear()
    yield path
    monkeypatch.undo()
    get_settings.cache_clear()
    load_prices.cache_clear()


def test_a_model_calls_budget_refuses_the_call_past_its_count(model_factory: ModelFactory) -> None:
    model = model_factory(FOREVER)
    sid = create_session("main", "go", budget_model_calls=3)
    assert run_agent(sid, 0, loop_deps(model.base_url)) == "failed"
    assert len(model.journal()) == 3
    assert _failure(sid) == ("FAILED", "budget_exhausted")
    budget = _budget(sid)
    assert (budget.budget_tokens, budget.model_calls, budget.reserved_tokens) == (None, 3, 0)
    assert budget.spent_tokens == 3 * 1200  # tokens are still counted without a token budget


@pytest.mark.usefixtures("prices")
def test_a_usd_budget_stops_the_tree_at_its_dollars_and_usage_shows_usd(
    model_factory: ModelFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    model = model_factory(FOREVER)
    sid = create_session("main", "go", budget_usd=0.02)
    assert run_agent(sid, 0, loop_deps(model.base_url)) == "failed"
    calls = len(model.journal())
    assert _failure(sid) == ("FAILED", "budget_exhausted")
    budget = _budget(sid)
    assert float(budget.spent_usd) == pytest.approx(calls * CALL_USD)
    assert float(budget.reserved_usd) == pytest.approx(0)
    # Each call reserved its prompt's estimate at the input price and its completion limit at
    # the output price (DEFAULT_RESERVATION_TOKENS = 4096): refused once that did not fit.
    assert 0 < calls * CALL_USD <= 0.02
    assert calls * CALL_USD + 4096 * 2.0 / 1e6 > 0.02

    capsys.readouterr()
    assert main(["session", "show", str(sid), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["usage"]["tree"]["usd"] == pytest.approx(calls * CALL_USD)
    assert shown["budget"]["usd"] == pytest.approx(0.02)
    assert shown["budget"]["spent_usd"] == pytest.approx(calls * CALL_USD)
    assert main(["usage", "--by", "model", "--json"]) == 0
    by_model = json.loads(capsys.readouterr().out)
    assert by_model["groups"][0]["key"] == "scripted"
    assert by_model["total"]["usd"] == pytest.approx(calls * CALL_USD)
    assert main(["session", "show", str(sid)]) == 0
    assert f"usd={calls * CALL_USD:.6f}" in capsys.readouterr().out


def test_without_a_prices_file_usage_has_no_usd(
    model_factory: ModelFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "done", "usage": USAGE}}])
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url)) == "waiting_user"
    capsys.readouterr()
    assert main(["usage", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"]["usd"] is None


def test_a_prices_file_may_be_toml_or_json_and_must_name_three_prices(tmp_path: Path) -> None:
    from models.prices import Price, PricesError, parse_prices

    toml = tmp_path / "p.toml"
    toml.write_text('["m"]\ninput = 1\ncached_input = 0.5\noutput = 4\n', encoding="utf-8")
    js = tmp_path / "p.json"
    js.write_text(json.dumps({"m": {"input": 1, "cached_input": 0.5, "output": 4}}), encoding="utf-8")
    assert parse_prices(toml) == parse_prices(js) == {"m": Price(1.0, 0.5, 4.0)}
    assert Price(1.0, 0.5, 4.0).usd(prompt_tokens=1000, cached_tokens=400, completion_tokens=100) == pytest.approx(
        (600 * 1.0 + 400 * 0.5 + 100 * 4.0) / 1e6
    )
    for bad in ({"m": {"input": 1}}, {"m": {"input": -1, "cached_input": 0, "output": 0}}, {"m": 3}):
        js.write_text(json.dumps(bad), encoding="utf-8")
        with pytest.raises(PricesError, match="m"):
            parse_prices(js)


def test_an_agents_budget_may_name_tokens_usd_and_model_calls() -> None:
    from harness.agents import parse_agents
    from harness.errors import AgentConfigError

    base = '[agents.a]\nsystem_prompt = "p"\n'
    agent = parse_agents(base + "budget = { tokens = 9, usd = 2.5, model_calls = 4 }\n")["a"]
    assert (agent.budget_tokens, agent.budget_usd, agent.budget_model_calls) == (9, 2.5, 4)
    assert parse_agents(base + "budget = { usd = 1 }\n")["a"].budget_usd == 1.0
    for bad in ("budget = {}", "budget = { usd = 0 }", "budget = { model_calls = 1.5 }", "budget = { dollars = 1 }"):
        with pytest.raises(AgentConfigError, match="budget"):
            parse_agents(base + bad + "\n")


def test_submit_takes_a_usd_and_a_model_calls_budget(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["submit", "--budget-usd", "1.5", "--budget-model-calls", "7", "go"]) == 0
    with transaction() as s:
        row = s.query(TreeBudget).order_by(TreeBudget.root_session_id.desc()).first()
        assert row is not None
        assert (row.budget_tokens, float(row.budget_usd or 0), row.budget_model_calls) == (None, 1.5, 7)
