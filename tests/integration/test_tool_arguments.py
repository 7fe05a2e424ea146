"""Tool-call arguments the model got wrong (not JSON, ``""``, not what the tool takes) are
answered with a TOOL error that says what to fix, at most ``max_retries`` rounds in a row per
tool; then the session fails with the reason ``tool_arguments``, a parent and a child alike,
counted from the stored history (a crash does not start the count again) (docs/tools.md,
"Arguments the model got wrong"). Real PostgreSQL, the scripted model over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy import select

import harness.child
from harness.child import start_child
from harness.parent import run_agent
from harness.tools import tool, unregister
from harness.views import create_session
from models import AgentSession, Phase, transaction
from tests.helpers import MAIN, RecordingScheduler, drive, executions_of, invariants, loop_deps, messages_of
from tests.types import ModelFactory

pytestmark = pytest.mark.usefixtures("db", "redis_url")

TRUNCATED = '{"text": "hel'
BAD_ECHO = {"tool_calls": [{"name": "echo", "arguments": TRUNCATED}]}
GOOD_ECHO = {"tool_calls": [{"name": "echo", "arguments": {"text": "hello"}}]}


def reason_of(sid: int) -> tuple[Any, str | None, str | None]:
    with transaction() as s:
        return s.execute(
            select(AgentSession.phase, AgentSession.failure_code, AgentSession.failure_message).where(
                AgentSession.id == sid
            )
        ).one()


def tool_rows(sid: int) -> list[str]:
    return [m.content or "" for m in messages_of(sid) if m.role == "TOOL"]


def test_a_parent_whose_model_keeps_sending_truncated_arguments_fails_after_max_retries_with_the_reason(
    model_factory: ModelFactory,
) -> None:
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": BAD_ECHO}])
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "failed"
    phase, code, message = reason_of(sid)
    assert (phase, code) == (Phase.FAILED, "tool_arguments")
    assert message == (
        "the model sent arguments tool 'echo' could not take in 3 rounds in a row (max_retries=2): "
        "the arguments of tool 'echo' are not valid JSON"
    )
    assert len(model.journal()) == 3  # the first try and two retries, never up to max_rounds
    rows = tool_rows(sid)
    assert len(rows) == 3
    assert all(r.startswith("error: the arguments of tool 'echo' are not valid JSON") for r in rows)
    assert all("send the call again with the arguments as one JSON object" in r for r in rows)
    assert invariants() == []


def test_a_call_whose_arguments_were_good_starts_the_count_again(model_factory: ModelFactory) -> None:
    turns = [BAD_ECHO, BAD_ECHO, GOOD_ECHO, BAD_ECHO, BAD_ECHO, {"content": "done"}]
    model = model_factory(
        [{"when": {"system_contains": MAIN, "turn": n}, "reply": reply} for n, reply in enumerate(turns)]
    )
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "waiting_user"
    assert reason_of(sid)[1] is None
    assert len(model.journal()) == 6


def test_empty_arguments_of_a_tool_that_takes_required_parameters_are_answered_with_what_to_fix(
    model_factory: ModelFactory,
) -> None:
    model = model_factory(
        [
            {
                "when": {"system_contains": MAIN, "turn": 0},
                "reply": {"tool_calls": [{"name": "echo", "arguments": ""}]},
            },
            {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "done"}},
        ]
    )
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "waiting_user"
    (row,) = tool_rows(sid)
    assert row.startswith("error: the arguments of tool 'echo' are empty: send the call again")
    assert '"text": "string"' in row and "required: text" in row


@pytest.fixture
def strict_tool(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[None]:
    """``strict`` (``@tool(max_retries=0)``), offered to the main agent."""
    from harness.agents import _load
    from settings import get_settings

    agents = tmp_path / "agents.toml"
    agents.write_text('[agents.main]\nsystem_prompt = "You are the main agent."\ntools = ["strict", "echo"]\n')
    monkeypatch.setenv("AGENTS_FILE", str(agents))
    get_settings.cache_clear()
    _load.cache_clear()

    @tool(max_retries=0)
    def strict(order_id: int) -> str:
        """Look an order up."""
        return f"order {order_id}"

    yield
    unregister("strict")
    monkeypatch.undo()
    get_settings.cache_clear()
    _load.cache_clear()


@pytest.mark.usefixtures("strict_tool")
def test_a_tool_with_max_retries_0_fails_the_session_at_its_first_arguments_that_do_not_validate(
    model_factory: ModelFactory,
) -> None:
    model = model_factory(
        [
            {
                "when": {"system_contains": MAIN},
                "reply": {"tool_calls": [{"name": "strict", "arguments": {"order_id": "seven"}}]},
            }
        ]
    )
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "failed"
    phase, code, message = reason_of(sid)
    assert (phase, code) == (Phase.FAILED, "tool_arguments")
    assert message is not None and "max_retries=0" in message and "seven" not in message
    assert len(model.journal()) == 1


class Crash(sa_exc.OperationalError):
    """What a killed worker looks like in-process: an infrastructure error, nothing written."""

    def __init__(self, where: str) -> None:
        super().__init__(f"simulated crash at {where}", None, Exception("crash"))


def test_a_child_counts_across_a_crash_from_its_history_and_fails_with_the_reason(
    model_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = model_factory(
        [
            {
                "when": {"system_contains": MAIN, "turn": 0},
                "reply": {"tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "t"}}]},
            },
            {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "parent saw: {tool_results}"}},
            {"when": {"system_contains": "reviewer subagent"}, "reply": BAD_ECHO},
        ]
    )
    real = harness.child.crash_point
    hits = {"n": 0}

    def crash_after_the_second_round(name: str) -> None:
        if name == "child.after_round":
            hits["n"] += 1
            if hits["n"] == 2:
                raise Crash(name)
        real(name)

    monkeypatch.setattr(harness.child, "crash_point", crash_after_the_second_round)
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    ((eid, epoch),) = deps.scheduler.children.pop()[2]
    assert start_child(eid, epoch, deps) == "infra_error"  # killed after two bad rounds
    drive(model.base_url)
    child_asked = sum(1 for j in model.journal() if j["rule"] == 2)
    assert child_asked == 3  # two before the crash, one after: the count was not started again
    (e,) = executions_of(sid)
    assert (e.status, e.delivery_status) == ("FAILED", "DELIVERED")
    assert reason_of(e.child_session_id)[1] == "tool_arguments"
    assert "could not take in 3 rounds in a row" in (tool_rows(sid)[0])
    assert invariants() == []


def test_a_delegation_whose_arguments_are_not_json_is_told_what_to_fix_and_counted_like_a_tool(
    model_factory: ModelFactory,
) -> None:
    model = model_factory(
        [
            {
                "when": {"system_contains": MAIN},
                "reply": {"tool_calls": [{"name": "delegate", "arguments": '{"agent_type": "reviewer", "ta'}]},
            }
        ]
    )
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "failed"
    assert reason_of(sid)[1] == "tool_arguments"
    assert len(model.journal()) == 3
    rows = tool_rows(sid)
    assert all(r.startswith("error: the arguments of tool 'delegate' are not valid JSON") for r in rows), rows
    assert all('"agent_type": "string"' in r for r in rows)
    assert executions_of(sid) == []
