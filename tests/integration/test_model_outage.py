"""A provider outage longer than the client's retry window, and answers the model did not
finish, on real PostgreSQL with the scripted model over HTTP: an outage never FAILs a session
in flight (it waits, and is resumed by the scan after a back-off until MODEL_OUTAGE_MAX_SECONDS
or its deadline); an answer cut off, filtered or refused is never a child's success."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

from harness.child import start_child
from harness.parent import run_agent
from harness.views import create_session
from models import AgentSession, ExecutionStatus, Phase, transaction
from models.base import utcnow
from recovery.metrics import build_registry
from recovery.ops import status_report
from recovery.scan import scan
from tests.helpers import (
    RecordingScheduler,
    drive,
    executions_of,
    expire_leases,
    invariants,
    loop_deps,
    messages_of,
    yielded_with_children,
)
from tests.types import ModelFactory

pytestmark = pytest.mark.usefixtures("db", "redis_url")

MAIN = "main agent"


def session_row(sid: int) -> Any:
    with transaction() as s:
        return s.execute(
            select(AgentSession.phase, AgentSession.model_outage_since, AgentSession.lease_expires_at).where(
                AgentSession.id == sid
            )
        ).one()


def waiting_metric() -> float:
    value = build_registry().get_sample_value("agent_recovery_sessions_waiting_for_model")
    assert value is not None
    return value


def test_a_model_outage_longer_than_the_retries_leaves_the_parent_waiting_and_the_scan_resumes_it_later(
    model_factory: ModelFactory,
) -> None:
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"error": {"status": 503, "message": "down"}}}])
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "waiting_model"
    phase, since, lease = session_row(sid)
    assert phase == Phase.RUNNING and since is not None
    assert lease > utcnow() + timedelta(seconds=5)  # the back-off: not resumed at the next scan
    assert [m.role for m in messages_of(sid)] == ["USER"]  # nothing written, no failure
    assert status_report()["sessions_waiting_for_model"] == 1 and waiting_metric() == 1
    sched = RecordingScheduler()
    scan(sched, callback_grace_seconds=0)
    assert sched.resumed == []  # the back-off holds
    model.set_script([{"when": {"system_contains": MAIN}, "reply": {"content": "back"}}])
    drive(model.base_url)  # leases lapse: the scan resumes it and the model answers
    phase, since, _ = session_row(sid)
    assert phase == Phase.WAITING_USER and since is None
    assert [m.content for m in messages_of(sid)] == ["go", "back"]
    assert status_report()["sessions_waiting_for_model"] == 0 and waiting_metric() == 0
    assert invariants() == []


def test_an_outage_longer_than_model_outage_max_seconds_fails_the_session(model_factory: ModelFactory) -> None:
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"error": {"status": 502, "message": "down"}}}])
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "waiting_model"
    with transaction() as s:
        s.execute(
            update(AgentSession).where(AgentSession.id == sid).values(model_outage_since=utcnow() - timedelta(hours=2))
        )
    expire_leases()
    sched = RecordingScheduler()
    scan(sched, callback_grace_seconds=0)
    ((resumed, epoch),) = sched.resumed
    assert run_agent(resumed, epoch, deps) == "failed"
    assert session_row(sid)[0] == Phase.FAILED


def test_a_refused_request_is_not_an_outage_and_fails_at_once(model_factory: ModelFactory) -> None:
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"error": {"status": 400, "message": "bad"}}}])
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "failed"
    assert session_row(sid)[1] is None


TWO: list[dict[str, Any]] = [
    {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "review A"}},
                {"name": "delegate", "arguments": {"agent_type": "researcher", "task": "research B"}},
            ]
        },
    },
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "parent done: {tool_results}"}},
]


def test_a_child_waits_out_a_model_outage_and_completes_when_the_model_is_back(model_factory: ModelFactory) -> None:
    down = {"when": {"system_contains": "subagent"}, "reply": {"error": {"status": 503, "message": "down"}}}
    model = model_factory([*TWO, down])
    sid, _, children, deps = yielded_with_children(model.base_url)
    assert start_child(*children[0], deps) == "waiting_model"
    first = executions_of(sid)[0]
    assert first.status == ExecutionStatus.RUNNING and first.result is None
    assert first.lease_expires_at > utcnow() + timedelta(seconds=5)
    assert status_report()["sessions_waiting_for_model"] == 1
    model.set_script([*TWO, {"when": {"system_contains": "subagent"}, "reply": {"content": "child answer"}}])
    assert start_child(*children[1], deps) == "completed"
    drive(model.base_url)
    assert {(e.status, e.delivery_status) for e in executions_of(sid)} == {("COMPLETED", "DELIVERED")}
    assert status_report()["sessions_waiting_for_model"] == 0
    assert invariants() == []


@pytest.mark.parametrize(
    ("finish_reason", "words"),
    [("length", "cut off at its token limit"), ("content_filter", "content filter")],
)
def test_a_child_answer_cut_off_or_filtered_ends_it_failed_with_the_reason_and_its_partial_text(
    model_factory: ModelFactory, finish_reason: str, words: str
) -> None:
    cut = {
        "when": {"system_contains": "subagent"},
        "reply": {"content": "The first half of an answ", "finish_reason": finish_reason},
    }
    model = model_factory([*TWO, cut])
    sid, _, children, deps = yielded_with_children(model.base_url)
    for eid, e in children:
        start_child(eid, e, deps)
    drive(model.base_url)
    for execution in executions_of(sid):
        assert execution.status == ExecutionStatus.FAILED and execution.delivery_status == "DELIVERED"
        result = execution.result
        assert result is not None and result["success"] is False
        assert words in result["error"] and result["partial_result"] == "The first half of an answ"
    assert invariants() == []


def test_a_retry_after_longer_than_the_retries_sets_the_outage_back_off(model_factory: ModelFactory) -> None:
    model = model_factory(
        [
            {
                "when": {"system_contains": MAIN},
                "reply": {"content": "x"},
                "fail_first": [{"status": 429, "retry_after": 900}],
            }
        ]
    )
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "waiting_model"
    _, since, lease = session_row(sid)
    assert since is not None
    assert lease > utcnow() + timedelta(seconds=850)  # the provider's 15 minutes, not the 10 s back-off
    assert len(model.journal()) == 1  # asked once: the wait is the session's, not a worker's
