"""The invariant checker (recovery/invariants.py) catches a break made on purpose: each test
breaks one rule of the code in-process (a monkeypatch), runs the ordinary path, and checks that
``check_all`` names what went wrong. Real PostgreSQL, the scripted model."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

import harness.delivery
import harness.parent
from harness.parent import run_agent
from harness.rounds import ToolResult
from harness.views import create_session
from models import AgentSession
from tests.helpers import MAIN, TWO, drive, executions_of, invariants, loop_deps, messages_of
from tests.types import ModelFactory


@pytest.fixture(autouse=True)
def _db(db: str) -> None:
    pass


def _current_epoch(s: Any, sid: int) -> int:
    return int(s.execute(select(AgentSession.epoch).where(AgentSession.id == sid)).scalar_one())


def test_the_checker_flags_a_user_turn_answered_twice_by_a_duplicate_run_whose_take_ignored_its_epoch(
    model_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The take's epoch check removed (it takes whatever epoch the session holds), a duplicate
    ``agent.run`` of an answered turn runs the loop again and writes a second answer to the
    same user message: the checker says so."""
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "the answer"}}])
    deps = loop_deps(model.base_url)
    sid = create_session("main", "one question")
    assert run_agent(sid, 0, deps) == "waiting_user"
    assert invariants() == []
    assert run_agent(sid, 0, deps) == "stale"  # the duplicate message, with the code as it is

    real_take = harness.parent.take_session_facts

    def take_ignoring_the_epoch(s: Any, session_id: int, *, expected_epoch: int, **kw: Any) -> Any:
        return real_take(s, session_id, expected_epoch=_current_epoch(s, session_id), **kw)

    monkeypatch.setattr(harness.parent, "take_session_facts", take_ignoring_the_epoch)
    assert run_agent(sid, 0, deps) == "waiting_user"  # the duplicate, with the check removed

    roles = [str(m.role) for m in messages_of(sid)]
    assert roles == ["USER", "ASSISTANT", "ASSISTANT"]
    user, first, second = (m.id for m in messages_of(sid))
    problems = invariants()
    flagged = f"I6 session {sid}: the turn from message {user} answered 2 times [{first}, {second}]"
    assert flagged in problems, problems


def test_the_checker_flags_a_delivered_tool_message_that_is_not_the_childs_stored_result(
    model_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Delivery broken on purpose: each delegation's TOOL is written with a content that is
    not the child's stored result. Everything else holds (one TOOL per call, DELIVERED, the
    markers point at it): the checker still says which execution's result was not delivered."""
    model = model_factory(TWO)
    real_results = harness.delivery.round_results

    def wrong_results(rnd: Any, pending: Any) -> tuple[list[Any], list[ToolResult]]:
        ordered, results = real_results(rnd, pending)
        forged = '{"success": true, "result": "not what the child answered"}'
        return ordered, [
            ToolResult(r.tool_call_id, forged, r.source_session_id) if r.source_session_id is not None else r
            for r in results
        ]

    monkeypatch.setattr(harness.delivery, "round_results", wrong_results)
    sid = create_session("main", "go")
    deps = loop_deps(model.base_url)
    assert run_agent(sid, 0, deps) == "yielded"
    drive(model.base_url, deps=deps, after_crash=False)
    executions = executions_of(sid)
    assert {str(e.delivery_status) for e in executions} == {"DELIVERED"}
    problems = invariants()
    for e in executions:
        assert any(p.startswith(f"I1 execution {e.id}:") and "stored result" in p for p in problems), problems
