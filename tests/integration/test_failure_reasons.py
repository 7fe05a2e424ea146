"""Every session that ends FAILED or CANCELLED stores why (docs/providers.md, "Failure
reasons"): a code and a short message without content or secrets, written by the
compare-and-set that stops it, shown by ``session show`` (and ``--json``) and counted in a
metric by code. Real PostgreSQL, the scripted model over HTTP."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import select

from harness.cancel import cancel
from harness.model import ModelClient
from harness.parent import run_agent
from harness.views import create_session, snapshot
from models import AgentSession, Phase, transaction
from recovery.metrics import build_registry
from tests.helpers import RecordingScheduler, drive, executions_of, invariants, loop_deps
from tests.types import ModelFactory

pytestmark = pytest.mark.usefixtures("db", "redis_url")

MAIN = "main agent"
SECRET_TASK = "TASK-CANARY-x9y8z7"


def reason_of(sid: int) -> tuple[Any, str | None, str | None]:
    with transaction() as s:
        return s.execute(
            select(AgentSession.phase, AgentSession.failure_code, AgentSession.failure_message).where(
                AgentSession.id == sid
            )
        ).one()


def failed_metric(code: str) -> float:
    return build_registry().get_sample_value("agent_recovery_session_failures_total", {"failure_code": code}) or 0.0


@pytest.mark.parametrize(
    ("status", "message", "code"),
    [
        (401, "Incorrect API key provided", "auth"),
        (404, "The model `gpt-9` does not exist", "model_not_found"),
        (413, "Request Entity Too Large", "context_too_long"),
        (400, "This model's maximum context length is 8192 tokens", "context_too_long"),
        (400, "Invalid value for 'temperature'", "provider_rejected"),
    ],
)
def test_a_parent_refused_by_its_provider_stores_why(
    model_factory: ModelFactory, status: int, message: str, code: str
) -> None:
    model = model_factory(
        [{"when": {"system_contains": MAIN}, "reply": {"error": {"status": status, "message": message}}}]
    )
    sid = create_session("main", SECRET_TASK)
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "failed"
    phase, failure_code, failure_message = reason_of(sid)
    assert (phase, failure_code) == (Phase.FAILED, code)
    assert failure_message is not None and f"HTTP {status}" in failure_message
    assert SECRET_TASK not in failure_message
    assert failed_metric(code) == 1.0


def test_a_bad_response_is_the_reason(model_factory: ModelFactory) -> None:
    model = model_factory(
        [{"when": {"system_contains": MAIN}, "reply": {"content": "x", "message_fields": {"content": 7}}}]
    )
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "failed"
    assert reason_of(sid)[1] == "bad_response"


def test_a_read_timeout_past_its_retries_is_the_reason(model_factory: ModelFactory) -> None:
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "late"}, "delay_seconds": 1.0}])
    deps = loop_deps(model.base_url, RecordingScheduler())
    deps.model.close()
    deps = type(deps)(
        scheduler=deps.scheduler,
        model=ModelClient(model.base_url, "", "scripted", 2.0, 0.2, read_timeout_retries=1),
        owner=deps.owner,
        lease_seconds=deps.lease_seconds,
    )
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "failed"
    phase, code, message = reason_of(sid)
    assert (phase, code) == (Phase.FAILED, "read_timeout")
    assert message is not None and "did not answer within" in message
    assert len(model.received()) == 2  # the first attempt and one retry


def test_max_rounds_is_the_reason(model_factory: ModelFactory) -> None:
    model = model_factory(
        [{"when": {"system_contains": MAIN}, "reply": {"tool_calls": [{"name": "echo", "arguments": {"text": "a"}}]}}]
    )
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "failed"
    phase, code, message = reason_of(sid)
    assert (phase, code, message) == (Phase.FAILED, "max_rounds", "reached max_rounds=20 without a final answer")
    assert invariants() == []


def test_a_cancel_stores_who_cancelled(model_factory: ModelFactory) -> None:
    sid = create_session("main", "go")
    assert cancel(sid, actor="console:alice").outcome == "cancelled"
    assert reason_of(sid) == (Phase.CANCELLED, "cancelled_by", "cancelled by console:alice")


def test_a_failed_child_stores_its_reason_and_the_cancelled_parents_children_theirs(
    model_factory: ModelFactory,
) -> None:
    script = [
        {
            "when": {"system_contains": MAIN, "turn": 0},
            "reply": {"tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "check"}}]},
        },
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "parent done: {tool_results}"}},
        {"when": {"system_contains": "reviewer subagent"}, "reply": {"error": {"status": 404, "message": "no model"}}},
    ]
    model = model_factory(script)
    deps = loop_deps(model.base_url)
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    drive(model.base_url, after_crash=False, deps=deps)
    (execution,) = executions_of(sid)
    phase, code, message = reason_of(execution.child_session_id)
    assert (phase, code) == (Phase.FAILED, "model_not_found")
    assert message == execution.error
    assert reason_of(sid)[1] is None  # the parent went on: it decides about the failed child


def test_session_show_json_carries_the_reason(model_factory: ModelFactory, capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    model = model_factory(
        [{"when": {"system_contains": MAIN}, "reply": {"error": {"status": 401, "message": "bad key"}}}]
    )
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "failed"
    with transaction() as s:
        snap = snapshot(s, sid)
    assert snap is not None and snap["failure_code"] == "auth" and "HTTP 401" in snap["failure_message"]
    capsys.readouterr()
    assert main(["session", "show", str(sid), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["failure_code"] == "auth"
    assert main(["session", "show", str(sid)]) == 0
    assert "failed: auth (" in capsys.readouterr().out
