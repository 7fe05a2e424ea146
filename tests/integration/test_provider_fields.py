"""A provider's own fields on a tool call (Gemini's thought signature in ``extra_content``) are
kept through the round journal and the history, and sent back unchanged with the call in the
next request, also after a crash between the reply and its round (real PostgreSQL, the
scripted model over HTTP)."""

from __future__ import annotations

import json

import pytest

from harness.parent import run_agent
from harness.views import create_session
from tests.helpers import RecordingScheduler, drive, infra_fault_at, invariants, loop_deps, messages_of
from tests.types import ModelFactory

pytestmark = pytest.mark.usefixtures("db", "redis_url")

SIGNATURE = {"google": {"thought_signature": "CiQBcsjafAbc/+=="}}
SCRIPT = [
    {
        "when": {"system_contains": "main agent", "turn": 0},
        "reply": {
            "tool_calls": [{"name": "echo", "arguments": {"text": "hi"}, "id": "call_sig", "extra_content": SIGNATURE}]
        },
    },
    {"when": {"system_contains": "main agent", "turn": 1}, "reply": {"content": "done: {tool_results}"}},
]


def test_a_tool_calls_thought_signature_is_kept_and_sent_back_unchanged(model_factory: ModelFactory) -> None:
    model = model_factory(SCRIPT)
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "waiting_user"
    assistant = next(m for m in messages_of(sid) if m.role == "ASSISTANT" and m.tool_calls)
    (stored,) = json.loads(assistant.tool_calls)
    assert stored["extra_content"] == SIGNATURE
    assert model.sent_back_extras() == [[], [SIGNATURE]]
    assert invariants() == []


def test_the_signature_survives_a_crash_after_the_reply_was_journaled(
    model_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import harness.journal

    model = model_factory(SCRIPT)
    sid = create_session("main", "go")
    with infra_fault_at(harness.journal, "journal.after_reply"):
        assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "infra_error"
    drive(model.base_url)
    assert [j["rule"] for j in model.journal()] == [0, 1]  # continued from the journal
    assert model.sent_back_extras()[-1] == [SIGNATURE]
    assert invariants() == []
