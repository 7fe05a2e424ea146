"""A parent's answer that the model did not finish (a refusal, a filtered or cut-off answer,
``finish_reason: tool_calls`` without a call) is stored as it came and marked, and the agent's
``on_incomplete`` setting decides whether the parent waits for the user or fails with the
reason (docs/providers.md). Real PostgreSQL, the scripted model over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from harness.parent import run_agent
from harness.views import create_session
from models import AgentSession, Phase, transaction
from tests.helpers import RecordingScheduler, invariants, loop_deps, messages_of
from tests.types import ModelFactory

pytestmark = pytest.mark.usefixtures("db", "redis_url")

MAIN = "main agent"
REFUSED = "I can't help with that."
CASES = [
    ({"content": "", "message_fields": {"refusal": REFUSED}}, REFUSED, "refusal"),
    ({"content": "half an ans", "finish_reason": "length"}, "half an ans", "truncated"),
    ({"content": "", "finish_reason": "content_filter"}, "", "content_filter"),
    ({"content": "", "finish_reason": "tool_calls"}, "", "no_tool_calls"),
]


def session_row(sid: int) -> Any:
    with transaction() as s:
        return s.execute(
            select(AgentSession.phase, AgentSession.failure_code, AgentSession.failure_message).where(
                AgentSession.id == sid
            )
        ).one()


@pytest.fixture
def failing_agent(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[None]:
    from harness.agents import DEFAULT_AGENTS_TOML, _load
    from settings import get_settings

    agents = tmp_path / "agents.toml"
    agents.write_text(
        DEFAULT_AGENTS_TOML.replace("max_rounds = 20\n", 'max_rounds = 20\non_incomplete = "fail"\n', 1),
        encoding="utf-8",
    )
    monkeypatch.setenv("AGENTS_FILE", str(agents))
    get_settings.cache_clear()
    _load.cache_clear()
    yield
    monkeypatch.undo()
    get_settings.cache_clear()
    _load.cache_clear()


@pytest.mark.parametrize(("reply", "stored", "mark"), CASES)
def test_an_unfinished_answer_is_stored_as_it_came_marked_and_the_parent_waits_for_the_user(
    model_factory: ModelFactory, reply: dict[str, Any], stored: str, mark: str
) -> None:
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": reply}])
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "waiting_user"
    answer = messages_of(sid)[-1]
    assert (answer.role, answer.content, answer.incomplete) == ("ASSISTANT", stored, mark)
    assert session_row(sid)[0] == Phase.WAITING_USER
    assert invariants() == []


@pytest.mark.parametrize(("reply", "stored", "mark"), CASES)
def test_an_agent_set_to_fail_fails_the_parent_with_the_reason_and_keeps_the_answer(
    model_factory: ModelFactory, failing_agent: None, reply: dict[str, Any], stored: str, mark: str
) -> None:
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": reply}])
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "failed"
    answer = messages_of(sid)[-1]
    assert (answer.role, answer.content, answer.incomplete) == ("ASSISTANT", stored, mark)
    phase, code, message = session_row(sid)
    assert (phase, code) == (Phase.FAILED, mark)
    assert message is not None and (not stored or stored not in message)  # the reason, not the answer


def test_a_whole_answer_is_not_marked(model_factory: ModelFactory) -> None:
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "all of it"}}])
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "waiting_user"
    assert messages_of(sid)[-1].incomplete is None
