"""A runaway tree with a token budget on real worker processes, one SIGKILLed mid-flight: the
tree ends, every child's result reaches the parent once, the budget's books equal what was
stored, and the model served at most the budget plus the reservations in flight
(docs/usage.md, "Budgets")."""

from __future__ import annotations

from typing import Any

import pytest

from models import transaction
from models.budget import DEFAULT_RESERVATION_TOKENS, budget_of
from models.usage import tree_usage
from tests.helpers import executions_of, wait_until
from tests.types import StackFactory

pytestmark = [pytest.mark.crash, pytest.mark.timeout(180)]

MAIN = "main agent"
USAGE = {"prompt_tokens": 1000, "completion_tokens": 200}
PER_CALL = 1200
BUDGET = 40_000
CONCURRENCY = 4


def _delegate(task: str) -> dict[str, Any]:
    return {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": task}}


#: The parent delegates two children after every round and never answers; each child waits a
#: little (so some are in flight at the kill), then answers.
RUNAWAY: list[dict[str, Any]] = [
    {"when": {"system_contains": MAIN}, "reply": {"tool_calls": [_delegate("a"), _delegate("b")], "usage": USAGE}},
    {
        "when": {"system_contains": "reviewer subagent", "turn": 0},
        "reply": {"tool_calls": [{"name": "wait", "arguments": {"seconds": 0.5}}], "usage": USAGE},
    },
    {"when": {"system_contains": "reviewer subagent", "turn": 1}, "reply": {"content": "seen", "usage": USAGE}},
]


def test_a_budgeted_runaway_tree_ends_with_a_worker_killed_and_its_books_hold(stack_factory: StackFactory) -> None:
    import tasks
    from harness.views import create_session

    stack = stack_factory(RUNAWAY)
    w1 = stack.worker("w1", concurrency=CONCURRENCY)
    sid = create_session("main", "go", budget_tokens=BUDGET)
    tasks.app.signature("agent.run", args=(sid, 0)).apply_async()
    wait_until(lambda: len(executions_of(sid)) >= 4, timeout=60, what="two delegating rounds")
    w1.kill()
    stack.worker("w2", concurrency=CONCURRENCY, beat=True)
    snap = stack.wait_phase(sid, ("FAILED",), timeout=120)
    assert snap["failure_code"] == "budget_exhausted"

    executions = executions_of(sid)
    assert all(e.delivery_status == "DELIVERED" for e in executions)
    tool_results = [m["tool_call_id"] for m in snap["messages"] if m["role"] == "TOOL"]
    assert sorted(tool_results) == sorted(e.parent_tool_call_id for e in executions)  # each once
    with transaction() as s:
        books, stored = budget_of(s, sid), tree_usage(s, sid)
    assert books is not None
    # Spent is exactly what the stored replies report; a call killed in flight stays reserved.
    assert books["spent"] == stored.prompt_tokens + stored.completion_tokens
    served = len(stack.model.journal()) * PER_CALL
    assert books["spent"] <= served
    # At most the budget plus the reservations in flight (one per process that can call at once).
    assert served <= BUDGET + 2 * CONCURRENCY * (DEFAULT_RESERVATION_TOKENS + 1000)
    assert stack.invariants() == []
