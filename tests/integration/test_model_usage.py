"""The provider's usage of every model call (prompt, completion, cached and reasoning tokens,
the model's name) is recorded once, in the transaction that stores its reply: a parent's
tool round, its final answer, a delegating reply, a child's rounds and final answer; a round
continued from the journal after a crash adds nothing (docs/providers.md). Real PostgreSQL,
the scripted model over HTTP."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from harness.parent import run_agent
from harness.views import create_session
from models import transaction
from models.usage import ModelCallUsage
from tests.helpers import RecordingScheduler, drive, executions_of, infra_fault_at, loop_deps
from tests.types import ModelFactory

pytestmark = pytest.mark.usefixtures("db", "redis_url")

MAIN = "main agent"
DETAILS = {"prompt_tokens_details": {"cached_tokens": 8}, "completion_tokens_details": {"reasoning_tokens": 5}}


def usage_rows() -> list[ModelCallUsage]:
    with transaction() as s:
        return list(s.execute(select(ModelCallUsage).order_by(ModelCallUsage.id)).scalars())


def test_every_model_call_of_a_parent_and_its_child_is_recorded_once_with_its_details(
    model_factory: ModelFactory,
) -> None:
    script = [
        {
            "when": {"system_contains": MAIN, "turn": 0},
            "reply": {
                "tool_calls": [{"name": "echo", "arguments": {"text": "a"}}],
                "usage": DETAILS,
            },
        },
        {
            "when": {"system_contains": MAIN, "turn": 1},
            "reply": {"tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "t"}}]},
        },
        {"when": {"system_contains": MAIN, "turn": 2}, "reply": {"content": "done", "usage": DETAILS}},
        {"when": {"system_contains": "reviewer subagent"}, "reply": {"content": "reviewed", "usage": DETAILS}},
    ]
    model = model_factory(script)
    deps = loop_deps(model.base_url)
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    drive(model.base_url, after_crash=False, deps=deps)
    (execution,) = executions_of(sid)
    rows = usage_rows()
    assert len(rows) == len(model.journal()) == 4
    assert [(r.session_id, r.execution_id) for r in rows] == [
        (sid, None),
        (sid, None),
        (execution.child_session_id, execution.id),
        (sid, None),
    ]
    assert all(r.model == "scripted" and r.prompt_tokens > 0 and r.completion_tokens > 0 for r in rows)
    assert [(r.cached_tokens, r.reasoning_tokens) for r in rows] == [(8, 5), (0, 0), (8, 5), (8, 5)]


def test_a_round_continued_from_the_journal_adds_no_usage(
    model_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import harness.journal

    model = model_factory(
        [
            {
                "when": {"system_contains": MAIN, "turn": 0},
                "reply": {"tool_calls": [{"name": "echo", "arguments": {"text": "a"}}]},
            },
            {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "done"}},
        ]
    )
    sid = create_session("main", "go")
    with infra_fault_at(harness.journal, "journal.after_reply"):
        assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "infra_error"
    assert len(usage_rows()) == 1  # committed with the journaled reply
    drive(model.base_url)
    assert len(model.journal()) == 2 and len(usage_rows()) == 2  # the replay added nothing


def test_a_failed_model_call_records_no_usage(model_factory: ModelFactory) -> None:
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"error": {"status": 400, "message": "no"}}}])
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "failed"
    assert usage_rows() == []
