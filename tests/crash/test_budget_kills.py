"""A budgeted tree's books with a worker SIGKILLed at each model and journal crash point, on one
shared stack (one scripted model, workers started per point): the tree's stored total is what
the model served and the tree stored, call for call; a journaled reply continued after the kill
adds nothing; a reply served but never stored is charged as estimated (docs/usage.md)."""

from __future__ import annotations

from typing import Any

import pytest

from models import transaction
from models.budget import budget_of
from models.usage import tree_usage
from tests.helpers import wait_until
from tests.types import StackFactory

pytestmark = [pytest.mark.crash, pytest.mark.timeout(400)]

MAIN = "main agent"
USAGE = {"prompt_tokens": 1000, "completion_tokens": 200}
PER_CALL = 1200

#: The parent delegates one child, the child runs one round of two tools (the first one's result
#: is journaled on its own) then answers, the parent answers.
SCRIPT: list[dict[str, Any]] = [
    {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {
            "tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "look"}}],
            "usage": USAGE,
        },
    },
    {
        "when": {"system_contains": "reviewer subagent", "turn": 0},
        "reply": {
            "tool_calls": [{"name": "echo", "arguments": {"text": "a"}}, {"name": "echo", "arguments": {"text": "b"}}],
            "usage": USAGE,
        },
    },
    {"when": {"system_contains": "reviewer subagent", "turn": 1}, "reply": {"content": "seen", "usage": USAGE}},
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "final answer", "usage": USAGE}},
]
CALLS = 4  #: what the script serves a tree that nothing interrupts

#: (point, the hit that kills: CRASH_POINT_AFTER, counted in the one process of a threads pool;
#: whether the killed call's reply was served and never stored; whether a call was charged as
#: estimated at all).
POINTS = [
    # budget.after_reserve (reserved, the model not asked) is the in-process
    # test_tree_budget.py::test_a_crash_after_a_reservation_keeps_it_charged_and_the_recovered_tree_still_ends.
    ("model.after_reply", 1, True, True),  # the provider answered the parent, nothing stored
    ("model.after_reply", 2, True, True),  # ... the child (charged by its execution's recovery take)
    ("journal.after_reply", 1, False, False),  # the delegating reply stored with its child
    ("journal.after_tool_result", 1, False, False),  # the child's reply journaled, its first tool's result too
]


def test_a_budgeted_trees_books_hold_with_a_worker_killed_at_each_model_and_journal_point(
    stack_factory: StackFactory,
) -> None:
    import tasks
    from harness.views import create_session

    stack = stack_factory(SCRIPT)
    for n, (point, after, lost, estimated) in enumerate(POINTS):
        before = len(stack.model.journal())
        # A threads pool: the crash ends the whole process (no pool child respawned to retry it).
        w1 = stack.worker(f"k{n}", concurrency=4, pool="threads", CRASH_POINT=point, CRASH_POINT_AFTER=str(after))
        sid = create_session("main", f"go {n}", budget_tokens=100_000)
        tasks.app.signature("agent.run", args=(sid, 0)).apply_async()
        wait_until(lambda w=w1: w.exited, timeout=60, what=f"the worker killed at {point}")
        assert f"crash_point={point}" in w1.log()
        w2 = stack.worker(f"r{n}", concurrency=4, pool="threads", beat=True)
        snap = stack.wait_phase(sid, timeout=100)
        w2.stop()

        served = len(stack.model.journal()) - before
        with transaction() as s:
            books, stored = budget_of(s, sid), tree_usage(s, sid)
        assert books is not None
        assert snap["messages"][-1]["content"] == "final answer", point
        # Every stored reply counted once, at the provider's figures.
        assert stored.prompt_tokens + stored.completion_tokens == stored.model_calls * PER_CALL, point
        assert (books["spent"], books["reserved"]) == (stored.model_calls * PER_CALL, 0), point
        assert books["estimated"] == stored.estimated_tokens, point
        # A journaled (or stored) reply was not asked again: the tree served each call once,
        # plus the one the kill lost when the provider had answered.
        assert stored.model_calls == CALLS, point
        assert served == CALLS + (1 if lost else 0), point
        assert (stored.estimated_calls > 0) == estimated, point
    assert stack.invariants() == []


#: The child asks when its tree's budget runs out (``on_budget_exhausted = "ask"``); each call
#: reserves about 1010 tokens (``max_tokens``) and spends 1200.
ASKING_AGENTS = """
[agents.main]
system_prompt = "You are the main agent."
tools = ["delegate", "echo"]
max_tokens = 1000
[agents.reviewer]
system_prompt = "You are the reviewer subagent."
tools = ["echo"]
max_tokens = 1000
on_budget_exhausted = "ask"
"""


def test_a_worker_killed_right_after_a_child_asked_for_budget_leaves_it_parked_and_an_approval_delivers_it_once(
    stack_factory: StackFactory, tmp_path: Any
) -> None:
    import json
    import os
    import subprocess
    import sys
    import time

    import tasks
    from harness.views import create_session
    from models.approval import ApprovalRequest, ApprovalStatus
    from tests.helpers import executions_of, messages_of, phase_of

    agents = tmp_path / "agents.toml"
    agents.write_text(ASKING_AGENTS, encoding="utf-8")
    stack = stack_factory(SCRIPT)
    w1 = stack.worker("k", concurrency=4, pool="threads", CRASH_POINT="budget.after_ask", AGENTS_FILE=str(agents))
    # The parent's call and the child's first fit (2400 spent); the child's second does not.
    sid = create_session("main", "go", budget_tokens=3300)
    tasks.app.signature("agent.run", args=(sid, 0)).apply_async()
    wait_until(lambda: w1.exited, timeout=60, what="the worker killed at budget.after_ask")
    assert "crash_point=budget.after_ask" in w1.log()
    (execution,) = executions_of(sid)
    child = execution.child_session_id
    stack.worker("r", concurrency=4, pool="threads", beat=True, AGENTS_FILE=str(agents))
    time.sleep(6)  # the boot scan and two beat scans (SCAN_INTERVAL_SECONDS=2) pass over it
    with transaction() as s:
        (req,) = s.query(ApprovalRequest).filter_by(session_id=child).all()
        s.expunge(req)
    assert (req.tool, req.status, req.execution_id) == ("budget.raise", ApprovalStatus.PENDING, execution.id)
    assert phase_of(child) == "WAITING_APPROVAL" and [m for m in messages_of(sid) if m.role == "TOOL"] == []
    assert len(stack.model.journal()) == 2  # the refused call asked no model
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "approve", str(child), req.call_id, "--arguments", '{"tokens": 5000}'],
        env={**os.environ, "CRASH_POINT": "", "AGENTS_FILE": str(agents)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    snap = stack.wait_phase(sid, timeout=90)
    (execution,) = executions_of(sid)
    assert (execution.status, execution.delivery_status) == ("COMPLETED", "DELIVERED")
    tools = [m for m in messages_of(sid) if m.role == "TOOL"]
    assert len(tools) == 1 and json.loads(tools[0].content or "")["result"] == "seen"
    assert snap["messages"][-1]["content"] == "final answer"
    assert len(stack.model.journal()) == CALLS  # each call of the script once
    with transaction() as s:
        books = budget_of(s, sid)
    assert books is not None and (books["tokens"], books["spent"], books["reserved"]) == (8300, CALLS * PER_CALL, 0)
    assert stack.invariants() == []
