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


def test_an_answer_and_its_usage_row_are_one_statement_and_a_lost_end_writes_neither(
    model_factory: ModelFactory,
) -> None:
    """A child's final answer and a parent's final answer carry their usage row in the INSERT
    that stores them (models.reply): no statement of its own. A child's end that a newer owner
    beat rolls both back."""
    from sqlalchemy import event, func

    from harness.child import Completed, finish_child, load_child
    from harness.child_end import Usage
    from harness.model import ModelReply
    from models import Message, get_engine

    model = model_factory(
        [
            {
                "when": {"system_contains": MAIN, "turn": 0},
                "reply": {
                    "tool_calls": [
                        {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "a"}},
                        {"name": "delegate", "arguments": {"agent_type": "researcher", "task": "b"}},
                    ]
                },
            },
            {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "done", "usage": DETAILS}},
            {"when": {"system_contains": "subagent"}, "reply": {"content": "answer", "usage": DETAILS}},
        ]
    )
    seen: list[str] = []

    def record(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        seen.append(" ".join(statement.split()))

    deps = loop_deps(model.base_url)
    sid = create_session("main", "go")
    event.listen(get_engine(), "before_cursor_execute", record)
    try:
        assert run_agent(sid, 0, deps) == "yielded"
        drive(model.base_url, after_crash=False, deps=deps)
    finally:
        event.remove(get_engine(), "before_cursor_execute", record)
    usage_inserts = [q for q in seen if "INSERT INTO model_call_usage" in q]
    assert len(usage_rows()) == len(model.journal()) == len(usage_inserts) == 4
    # The two children's answers and the parent's: each the message's INSERT itself.
    assert len([q for q in usage_inserts if q.startswith("WITH usage AS") and "INSERT INTO message" in q]) == 3
    executions = executions_of(sid)
    with transaction() as s:
        finals = [s.get(Message, e.final_message_id) for e in executions]
    assert [m.content for m in finals if m is not None] == ["answer", "answer"]
    assert {(r.session_id, r.execution_id) for r in usage_rows()} >= {(e.child_session_id, e.id) for e in executions}

    # An end whose epoch a newer owner has moved past lands nothing, its usage row included.
    info = load_child(executions[0].id)
    reply = ModelReply(content="late", tool_calls=(), prompt_tokens=3, completion_tokens=4, model="scripted")
    with transaction() as s:
        before = s.execute(select(func.count()).select_from(Message)).scalar_one()
    ended = finish_child(info, executions[0].epoch - 1, Completed("late"), usage=Usage(3, 4, reply))
    assert ended is None
    with transaction() as s:
        assert s.execute(select(func.count()).select_from(Message)).scalar_one() == before
    assert len(usage_rows()) == 4
