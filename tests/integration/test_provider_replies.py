"""What providers put beside the answer is kept and sent back as it came (docs/providers.md):
reasoning fields of an assistant message (``reasoning_content``, ``thinking_blocks``,
``reasoning_details``), and ``content`` given as a list of typed parts, whose text parts are
the answer. Real PostgreSQL, the scripted model over HTTP."""

from __future__ import annotations

import pytest

from harness.parent import run_agent
from harness.views import create_session
from tests.helpers import RecordingScheduler, drive, infra_fault_at, invariants, loop_deps, messages_of
from tests.types import ModelFactory

pytestmark = pytest.mark.usefixtures("db", "redis_url")

MAIN = "main agent"
REASONING = {
    "reasoning_content": "The user wants an echo; call the tool.",
    "thinking_blocks": [{"type": "thinking", "thinking": "echo it", "signature": "EqQBCkgIARABGAIiQL+/=="}],
    "reasoning_details": [{"type": "reasoning.encrypted", "data": "gAAAAB..", "id": "rs_1", "format": "openai"}],
}
PARTS = [
    {"type": "thinking", "thinking": [{"type": "text", "text": "first I think"}]},
    {"type": "text", "text": "the answer"},
    {"type": "text", "text": " is 42"},
]


def _tool_round_then_answer(fields: dict[str, object]) -> list[dict[str, object]]:
    return [
        {
            "when": {"system_contains": MAIN, "turn": 0},
            "reply": {
                "tool_calls": [{"name": "echo", "arguments": {"text": "hi"}, "id": "call_r"}],
                "message_fields": fields,
            },
        },
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "done: {tool_results}"}},
    ]


def _sent_back(model: object) -> dict[str, object]:
    (assistant,) = model.sent_back_messages()[-1]  # type: ignore[attr-defined]
    return {k: v for k, v in assistant.items() if k not in ("role", "tool_calls")}


def test_reasoning_fields_of_a_tool_calling_reply_are_stored_and_sent_back_as_they_came(
    model_factory: ModelFactory,
) -> None:
    model = model_factory(_tool_round_then_answer(REASONING))
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "waiting_user"
    assistant = next(m for m in messages_of(sid) if m.role == "ASSISTANT" and m.tool_calls)
    assert assistant.provider_fields == REASONING
    assert _sent_back(model) == {"content": "", **REASONING}
    assert invariants() == []


def test_reasoning_fields_survive_a_crash_after_the_reply_was_journaled(
    model_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import harness.journal

    model = model_factory(_tool_round_then_answer(REASONING))
    sid = create_session("main", "go")
    with infra_fault_at(harness.journal, "journal.after_reply"):
        assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "infra_error"
    drive(model.base_url)
    assert [j["rule"] for j in model.journal()] == [0, 1]  # continued from the journal
    assert _sent_back(model) == {"content": "", **REASONING}
    assert invariants() == []


def test_reasoning_fields_of_a_delegating_reply_reach_the_history_with_its_round(model_factory: ModelFactory) -> None:
    script = [
        {
            "when": {"system_contains": MAIN, "turn": 0},
            "reply": {
                "tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "check X"}}],
                "message_fields": REASONING,
            },
        },
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "parent done: {tool_results}"}},
        {"when": {"system_contains": "reviewer subagent"}, "reply": {"content": "reviewed"}},
    ]
    model = model_factory(script)
    sid = create_session("main", "go")
    deps = loop_deps(model.base_url)
    assert run_agent(sid, 0, deps) == "yielded"
    drive(model.base_url, after_crash=False, deps=deps)
    assistant = next(m for m in messages_of(sid) if m.role == "ASSISTANT" and m.tool_calls)
    assert assistant.provider_fields == REASONING
    main_requests = [r for r in model.sent_back_messages() if r]
    assert {k: v for k, v in main_requests[-1][0].items() if k in REASONING} == REASONING
    assert invariants() == []


def test_content_as_typed_parts_is_read_as_its_text_parts_and_kept_whole(model_factory: ModelFactory) -> None:
    model = model_factory(
        [{"when": {"system_contains": MAIN}, "reply": {"content": "unused", "message_fields": {"content": PARTS}}}]
    )
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "waiting_user"
    answer = messages_of(sid)[-1]
    assert (answer.role, answer.content) == ("ASSISTANT", "the answer is 42")
    assert answer.provider_fields == {"content": PARTS}


def test_typed_parts_of_a_tool_calling_reply_are_sent_back_as_they_came(model_factory: ModelFactory) -> None:
    model = model_factory(_tool_round_then_answer({"content": PARTS}))
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "waiting_user"
    assert _sent_back(model) == {"content": PARTS}
    assert messages_of(sid)[-1].content == "done: hi"


def test_a_childs_final_answer_keeps_its_reasoning_fields(model_factory: ModelFactory) -> None:
    script = [
        {
            "when": {"system_contains": MAIN, "turn": 0},
            "reply": {"tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "check X"}}]},
        },
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "parent done: {tool_results}"}},
        {
            "when": {"system_contains": "reviewer subagent"},
            "reply": {"content": "unused", "message_fields": {"content": PARTS, **REASONING}},
        },
    ]
    model = model_factory(script)
    deps = loop_deps(model.base_url)
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    drive(model.base_url, after_crash=False, deps=deps)
    from tests.helpers import executions_of

    (execution,) = executions_of(sid)
    final = messages_of(execution.child_session_id)[-1]
    assert (final.role, final.content) == ("ASSISTANT", "the answer is 42")
    assert final.provider_fields == {"content": PARTS, **REASONING}
