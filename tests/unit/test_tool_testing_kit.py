"""The testing kit for tool authors (harness.tools.testing): a tool's crash contract in a plain
pytest, with no database, broker or worker: this module runs with DATABASE_URL pointing nowhere."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from harness.errors import ToolError
from harness.tools import ToolContext, tool, unregister
from harness.tools.testing import ToolTester


@pytest.fixture
def shop(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, Any]]]:
    """Two tools of a shop: a refund that is not safe to repeat, a lookup that is; every run
    is recorded with its key. No database is reachable."""
    from settings import get_settings

    monkeypatch.setenv("DATABASE_URL", "postgresql+psycopg2://nobody@127.0.0.1:9/none")
    get_settings.cache_clear()
    runs: list[tuple[str, Any]] = []

    @tool
    def kit_refund(ctx: ToolContext, order_id: int, amount_cents: int) -> str:
        """Refund part of an order."""
        if amount_cents <= 0:
            raise ToolError("amount_cents must be positive")
        runs.append(("refund", ctx.idempotency_key))
        return f"refunded {amount_cents} on {order_id}"

    @tool(idempotent=True)
    def kit_lookup(ctx: ToolContext, order_id: int) -> dict[str, object]:
        """Look an order up."""
        runs.append(("lookup", ctx.idempotency_key))
        return {"order_id": order_id, "status": "shipped"}

    yield runs
    unregister("kit_refund")
    unregister("kit_lookup")
    get_settings.cache_clear()


def test_a_call_runs_as_a_worker_runs_it_with_validated_arguments_and_a_fresh_key(shop: list[Any]) -> None:
    tester = ToolTester("kit_lookup")
    first, second = tester.call(order_id=7), tester.call(order_id=7)
    assert json.loads(first.result) == {"order_id": 7, "status": "shipped"}
    assert first.call_id.startswith("tc_") and len(first.call_id) == 35
    assert first.idempotency_key != second.idempotency_key  # a new call of the model: a new key
    assert tester.call(order_id="seven").result.startswith("error: ")  # the schema refuses it
    assert [kind for kind, _ in shop] == ["lookup", "lookup"]


def test_a_tool_error_is_the_result_the_model_reads(shop: list[Any]) -> None:
    assert ToolTester("kit_refund").call(order_id=7, amount_cents=0).result == "error: amount_cents must be positive"


def test_an_unrepeatable_call_interrupted_by_a_crash_is_not_run_again_and_the_model_is_told(shop: list[Any]) -> None:
    after = ToolTester("kit_refund").crash_during(order_id=7, amount_cents=300)
    assert not after.ran_again
    assert "was interrupted by a restart and may or may not have taken effect" in after.result
    assert '"amount_cents": 300' in after.result
    assert [kind for kind, _ in shop] == ["refund"]  # the interrupted run only


def test_an_idempotent_call_interrupted_by_a_crash_runs_again_with_the_same_key(shop: list[Any]) -> None:
    tester = ToolTester("kit_lookup")
    assert tester.repeatable and not tester.needs_approval
    after = tester.crash_during(order_id=7)
    assert after.ran_again and "shipped" in after.result
    assert [key for _, key in shop] == [after.idempotency_key, after.idempotency_key]


def test_a_call_that_kills_its_worker_every_time_is_reported_interrupted_after_the_bounded_reruns(
    shop: list[Any],
) -> None:
    after = ToolTester("kit_lookup").crash_during(order_id=7, reruns_that_crash=3)
    assert not after.ran_again and "may or may not have taken effect" in after.result


def test_a_function_that_is_not_a_tool_is_refused_by_name() -> None:
    def plain() -> None: ...

    with pytest.raises(LookupError, match="plain"):
        ToolTester(plain)
