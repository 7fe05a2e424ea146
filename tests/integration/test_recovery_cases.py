"""Spec §10.1 regression cases R1–R24 (R17, R19, R25 live beside the code they test: see the
closing note), driven in-process on real PostgreSQL + Redis with the scripted model over HTTP.

A "crash" here is what a dead worker leaves in the database: the test stops driving at that
point (or builds the pre-upgrade rows directly), lets every lease lapse, and runs the real
scan -> recover_child -> deliver_round -> agent loop code. Real SIGKILLed workers are in
tests/crash. Every test ends with invariants I1–I5 over the whole database.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

from harness import presence
from harness.parent import run_agent
from harness.views import create_session
from models import (
    AgentSession,
    ExecutionMode,
    ExecutionStatus,
    InvocationType,
    Message,
    Phase,
    Role,
    SessionType,
    SubagentExecution,
    transaction,
)
from models.base import utcnow
from recovery.cancel import cancel_session
from recovery.child import recover_child
from recovery.child import start_child as run_child
from recovery.delivery import deliver_round
from recovery.scan import scan
from settings import get_settings
from tests.helpers import (
    RecordingScheduler,
    add_message,
    children_done_callback_lost,
    drive,
    executions_of,
    expire_leases,
    invariants,
    loop_deps,
    make_execution,
    make_session,
    messages_of,
)

MAIN = "main agent"


def one_child_script(child_reply: dict[str, Any] | None = None, task: str = "check X") -> list[dict[str, Any]]:
    return [
        {
            "when": {"system_contains": MAIN, "turn": 0},
            "reply": {"tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": task}}]},
        },
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "parent done: {tool_results}"}},
        {"when": {"system_contains": "reviewer subagent"}, "reply": child_reply or {"content": "reviewed"}},
    ]


def sessions_count(kind: SessionType) -> int:
    with transaction() as s:
        return len(s.execute(select(AgentSession.id).where(AgentSession.session_type == kind)).all())


def phase_of(sid: int) -> Phase | None:
    with transaction() as s:
        return s.execute(select(AgentSession.phase).where(AgentSession.id == sid)).scalar_one()


def rule_calls(model: Any, index: int) -> int:
    return sum(1 for j in model.journal() if j["rule"] == index)


def parent_yielded(model_url: str, text: str = "go") -> tuple[int, RecordingScheduler]:
    """A parent that delegated and whose worker died right after (chord lost)."""
    deps = loop_deps(model_url)
    sid = create_session("main", text)
    assert run_agent(sid, 0, deps) == "yielded"
    return sid, deps.scheduler


def assert_one_delivered_pair(parent: int, execution: SubagentExecution) -> None:
    msgs = messages_of(parent)
    tools = [m for m in msgs if m.role == Role.TOOL and m.tool_call_id == execution.parent_tool_call_id]
    assert len(tools) == 1
    calls = [m for m in msgs if m.role == Role.ASSISTANT and execution.parent_tool_call_id in (m.tool_calls or "")]
    assert len(calls) == 1


@pytest.fixture(autouse=True)
def _db(db: str) -> None:
    pass


def test_r1_restart_while_parent_waits_for_first_delegate_recovers_the_original_child(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    (before,) = executions_of(sid)
    drive(model.base_url)
    (after,) = executions_of(sid)
    assert (after.id, after.child_session_id) == (before.id, before.child_session_id)
    assert (after.status, after.delivery_status) == ("COMPLETED", "DELIVERED")
    assert sessions_count(SessionType.SUBAGENT) == 1
    assert rule_calls(model, 0) == 1  # the parent never delegated again
    assert_one_delivered_pair(sid, after)
    assert messages_of(sid)[-1].content.startswith("parent done")  # type: ignore[union-attr]
    assert invariants() == []


def test_r2_restart_while_a_followup_runs_reuses_child_and_execution(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(
        [
            {
                "when": {"system_contains": MAIN, "turn": 0},
                "reply": {
                    "tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "first"}}]
                },
            },
            {
                "when": {"system_contains": MAIN, "turn": 1},
                "reply": {
                    "tool_calls": [
                        {"name": "delegate_followup", "arguments": {"child_session_id": 2, "task": "second"}}
                    ]
                },
            },
            {"when": {"system_contains": MAIN, "turn": 2}, "reply": {"content": "both done"}},
            {"when": {"system_contains": "reviewer subagent"}, "reply": {"content": "answer to {user}"}},
        ]
    )
    deps = loop_deps(model.base_url)
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    _, epoch, children = deps.scheduler.children.pop()
    run_child(*children[0], deps)
    out = deliver_round(sid, epoch)
    assert run_agent(sid, out.new_epoch, deps) == "yielded"  # type: ignore[arg-type]
    deps.scheduler.children.clear()  # the worker died: the followup's chord is lost
    followup_before = executions_of(sid)[1]
    assert followup_before.invocation_type == "FOLLOWUP" and followup_before.status == "RUNNING"
    drive(model.base_url)
    first, followup = executions_of(sid)
    assert followup.id == followup_before.id and followup.child_session_id == first.child_session_id == 2
    assert (followup.status, followup.delivery_status) == ("COMPLETED", "DELIVERED")
    assert sessions_count(SessionType.SUBAGENT) == 1
    assert messages_of(sid)[-1].content == "both done"
    assert invariants() == []


TWO = [
    {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "a"}},
                {"name": "delegate", "arguments": {"agent_type": "researcher", "task": "b"}},
            ]
        },
    },
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "parent done"}},
    {"when": {"system_contains": "subagent"}, "reply": {"content": "child answer"}},
]


def test_r3_two_parallel_children_are_recovered_and_the_parent_waits_for_both(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(TWO)
    sid, _ = parent_yielded(model.base_url)
    expire_leases()
    sched = RecordingScheduler()
    deps = loop_deps(model.base_url, sched)
    scan(sched, callback_grace_seconds=0)
    ((parent, epoch, children),) = sched.recoveries
    assert parent == sid and sorted(e for e, _ in children) == [e.id for e in executions_of(sid)]
    assert phase_of(sid) == Phase.RESUMING
    recover_child(*children[0], deps)
    assert deliver_round(sid, epoch).kind == "waiting"  # I3: one child still active
    assert [m.role for m in messages_of(sid)] == ["USER"]
    recover_child(*children[1], deps)  # the last one: it delivers the round itself
    assert deliver_round(sid, epoch).kind == "stale"  # a late callback finds it done
    assert {e.delivery_status for e in executions_of(sid)} == {"DELIVERED"}
    ((parent_id, new_epoch),) = sched.resumed
    assert parent_id == sid
    assert run_agent(sid, new_epoch, deps) == "waiting_user"
    assert [m.role for m in messages_of(sid)] == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    assert invariants() == []


@pytest.mark.parametrize("attempt", range(4))
def test_r3_two_recovered_siblings_finishing_at_the_same_moment_deliver_the_round_exactly_once(
    model_factory: Any, attempt: int
) -> None:
    """Both children of a recovered round end at once (threads released by a barrier): their
    finishing transactions serialize on the parent row, exactly one of them sees the round
    complete and delivers it, and the parent is resumed once."""
    model = model_factory(TWO)
    sid, _ = parent_yielded(model.base_url)
    expire_leases()
    sched = RecordingScheduler()
    deps = loop_deps(model.base_url, sched)
    scan(sched, callback_grace_seconds=0)
    ((_, _, children),) = sched.recoveries
    barrier = threading.Barrier(len(children))
    outcomes: list[str] = []

    def finish(eid: int, epoch: int) -> None:
        barrier.wait(timeout=10)
        outcomes.append(recover_child(eid, epoch, deps))

    threads = [threading.Thread(target=finish, args=pair) for pair in children]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert sorted(outcomes) == ["completed", "completed"]
    assert {e.delivery_status for e in executions_of(sid)} == {"DELIVERED"}
    assert len(sched.resumed) == 1, f"resumed {len(sched.resumed)} times"
    assert [m.role for m in messages_of(sid)] == ["USER", "ASSISTANT", "TOOL", "TOOL"]
    assert invariants(settled=False) == []


def test_r4_an_incomplete_child_tool_round_is_dropped_and_not_rerun(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(one_child_script({"content": "reviewed after restart"}))
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    # What the worker left: one complete round, then a round whose tool never returned.
    calls = [{"id": "c1", "type": "function", "function": {"name": "echo", "arguments": '{"text": "x"}'}}]
    add_message(e.child_session_id, Role.ASSISTANT, "", tool_calls=calls)
    add_message(e.child_session_id, Role.TOOL, "x", tool_call_id="c1")
    wait = [{"id": "c2", "type": "function", "function": {"name": "wait", "arguments": '{"seconds": 600}'}}]
    dangling = add_message(e.child_session_id, Role.ASSISTANT, "", tool_calls=wait)
    drive(model.base_url)
    child = messages_of(e.child_session_id)
    assert dangling not in [m.id for m in child]
    assert [m.role for m in child] == ["USER", "ASSISTANT", "TOOL", "ASSISTANT"]
    assert child[-1].content == "reviewed after restart"
    (done,) = executions_of(sid)
    assert done.result["result"] == "reviewed after restart"  # type: ignore[index]
    assert invariants() == []


def test_r5_a_child_whose_recovery_fails_is_delivered_as_failed_and_the_parent_continues(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(one_child_script({"error": {"status": 500, "message": "model exploded"}}))
    sid, _ = parent_yielded(model.base_url)
    drive(model.base_url)
    (e,) = executions_of(sid)
    assert (e.status, e.delivery_status) == ("FAILED", "DELIVERED")
    assert phase_of(e.child_session_id) == Phase.FAILED
    tool = next(m for m in messages_of(sid) if m.role == Role.TOOL)
    payload = json.loads(tool.content or "{}")
    assert payload["success"] is False and payload["cancelled"] is False and payload["error"]
    assert messages_of(sid)[-1].content.startswith("parent done")  # type: ignore[union-attr]
    assert invariants() == []


@pytest.fixture
def local_presence(redis_url: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """LOCAL client presence on the tests' Redis database."""
    from harness import events

    monkeypatch.setenv("REDIS_URL", redis_url)
    get_settings.cache_clear()
    events._redis.cache_clear()
    yield
    events._redis.cache_clear()
    get_settings.cache_clear()


def make_local(child_session_id: int) -> None:
    with transaction() as s:
        s.execute(
            update(AgentSession).where(AgentSession.id == child_session_id).values(execution_mode=ExecutionMode.LOCAL)
        )


@pytest.fixture
def short_timeout(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SUBAGENT_TIMEOUT_SECONDS", "2")
    monkeypatch.setenv("SUBAGENT_CANCEL_GRACE_SECONDS", "1")
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_r6_a_recovered_child_past_its_deadline_is_cancelled_and_delivered_as_timed_out(
    model_factory, short_timeout
) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(one_child_script({"tool_calls": [{"name": "wait", "arguments": {"seconds": 30}}]}))
    sid, _ = parent_yielded(model.base_url)
    started = time.monotonic()
    drive(model.base_url)
    elapsed = time.monotonic() - started
    (e,) = executions_of(sid)
    assert (e.status, e.delivery_status) == ("FAILED", "DELIVERED")
    assert "timed out" in e.result["error"]  # type: ignore[index]
    assert elapsed < 25  # the 30 s wait was cut at the deadline, not waited out
    assert invariants() == []


def test_r7_local_child_waits_for_the_client_and_then_succeeds(model_factory, local_presence) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    make_local(e.child_session_id)
    user = "cli"
    presence.disconnect(user)
    threading.Timer(1.0, presence.connect, args=(user,)).start()
    drive(model.base_url)
    (done,) = executions_of(sid)
    assert (done.status, done.delivery_status) == ("COMPLETED", "DELIVERED")
    assert presence.is_connected(user)
    assert invariants() == []


def test_r8_local_client_never_connecting_fails_the_child_and_the_parent_continues(
    model_factory,
    local_presence,
    short_timeout,  # type: ignore[no-untyped-def]
) -> None:
    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    make_local(e.child_session_id)
    presence.disconnect("cli")
    drive(model.base_url)
    (done,) = executions_of(sid)
    assert (done.status, done.delivery_status) == ("FAILED", "DELIVERED")
    assert done.result["error"] == "LOCAL client did not connect before the recovery deadline"  # type: ignore[index]
    assert rule_calls(model, 2) == 0  # the child's model was never called
    assert messages_of(sid)[-1].content.startswith("parent done")  # type: ignore[union-attr]
    assert invariants() == []


def test_r9_a_crash_inside_the_delivery_transaction_delivers_once_on_the_next_run(model_factory) -> None:  # type: ignore[no-untyped-def]
    from crashpoints import InjectedFault, armed_fault

    model = model_factory(TWO)
    sid, epoch = children_done_callback_lost(model.base_url)
    with armed_fault("deliver.mid_round"), pytest.raises(InjectedFault):
        deliver_round(sid, epoch)
    assert [m.role for m in messages_of(sid)] == ["USER"]
    drive(model.base_url)
    assert [m.role for m in messages_of(sid)] == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    assert invariants() == []


def test_r10_a_crash_after_delivery_commit_does_not_deliver_again(model_factory) -> None:  # type: ignore[no-untyped-def]
    from crashpoints import InjectedFault, armed_fault

    model = model_factory(TWO)
    sid, epoch = children_done_callback_lost(model.base_url)
    with armed_fault("deliver.before_resume"), pytest.raises(InjectedFault):
        deliver_round(sid, epoch)  # committed; the process "died" before enqueueing the parent
    assert {e.delivery_status for e in executions_of(sid)} == {"DELIVERED"}
    delivered = [m.id for m in messages_of(sid)]
    drive(model.base_url)
    msgs = messages_of(sid)
    assert [m.id for m in msgs][: len(delivered)] == delivered
    assert [m.role for m in msgs] == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    assert rule_calls(model, 0) == 1
    assert invariants() == []


def _legacy_parent_with_child(*, status: ExecutionStatus = ExecutionStatus.RUNNING) -> tuple[int, int, int]:
    """Pre-upgrade shape: no invocation_type, no parent_tool_call_id, no start message id."""
    parent = make_session(phase=Phase.RUNNING)
    add_message(parent, Role.USER, "old request")
    child = make_session(
        session_type=SessionType.SUBAGENT, phase=Phase.RUNNING, agent_type="reviewer", parent_session_id=parent
    )
    add_message(child, Role.USER, "legacy task")
    eid = make_execution(
        parent,
        child,
        status=status,
        invocation=None,
        tool_call_id=None,
        task="legacy task",
        result={"success": True, "result": "old answer"} if status != ExecutionStatus.RUNNING else None,
    )
    return parent, child, eid


def test_r11_an_existing_complete_pair_is_only_marked_delivered(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}}])
    parent = make_session(phase=Phase.RUNNING)
    add_message(parent, Role.USER, "q")
    eid = make_execution(
        parent, status=ExecutionStatus.COMPLETED, tool_call_id="call_old", result={"success": True, "result": "r"}
    )
    call = [{"id": "call_old", "type": "function", "function": {"name": "delegate", "arguments": "{}"}}]
    a = add_message(parent, Role.ASSISTANT, "", tool_calls=call)
    t = add_message(parent, Role.TOOL, '{"success": true}', tool_call_id="call_old")
    drive(model.base_url)
    (e,) = executions_of(parent)
    assert e.delivery_status == "DELIVERED" and (e.parent_assistant_message_id, e.parent_tool_message_id) == (a, t)
    roles = [m.role for m in messages_of(parent)]
    assert roles == ["USER", "ASSISTANT", "TOOL", "ASSISTANT"]  # nothing re-inserted; the parent resumed
    assert eid == e.id
    assert invariants() == []


def test_r12_a_pre_upgrade_running_delegate_is_inferred_and_recovered_with_a_stable_synthetic_id(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(
        [
            {"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}},
            {"when": {"system_contains": "reviewer subagent"}, "reply": {"content": "legacy reviewed"}},
        ]
    )
    parent, child, eid = _legacy_parent_with_child()
    drive(model.base_url)
    (e,) = executions_of(parent)
    assert e.invocation_type == InvocationType.DELEGATE
    assert e.parent_tool_call_id == f"recovered_subagent_execution_{eid}"
    assert (e.status, e.delivery_status, e.child_session_id) == ("COMPLETED", "DELIVERED", child)
    call = json.loads(next(m for m in messages_of(parent) if m.tool_calls).tool_calls or "[]")[0]
    assert call["function"]["name"] == "delegate"
    assert json.loads(call["function"]["arguments"]) == {"agent_type": "reviewer", "task": "legacy task"}
    assert invariants() == []


def test_r13_a_pre_upgrade_running_followup_is_inferred_with_its_child_session_id(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(
        [
            {"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}},
            {"when": {"system_contains": "reviewer subagent"}, "reply": {"content": "followup reviewed"}},
        ]
    )
    parent, child, first = _legacy_parent_with_child(status=ExecutionStatus.COMPLETED)
    with transaction() as s:  # the first one was delivered before the upgrade
        s.execute(update(SubagentExecution).where(SubagentExecution.id == first).values(delivery_status="LEGACY"))
    add_message(child, Role.ASSISTANT, "old answer")
    add_message(child, Role.USER, "legacy followup")
    second = make_execution(parent, child, invocation=None, tool_call_id=None, task="legacy followup")
    drive(model.base_url)
    e = next(x for x in executions_of(parent) if x.id == second)
    assert e.invocation_type == InvocationType.FOLLOWUP and e.delivery_status == "DELIVERED"
    call = json.loads(next(m for m in messages_of(parent) if m.tool_calls).tool_calls or "[]")[0]
    assert call["function"]["name"] == "delegate_followup"
    assert json.loads(call["function"]["arguments"]) == {"child_session_id": child, "task": "legacy followup"}
    assert invariants() == []


def test_r14_a_child_with_null_phase_and_running_execution_is_recovered(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    assert phase_of(e.child_session_id) is None
    drive(model.base_url)
    assert executions_of(sid)[0].delivery_status == "DELIVERED"
    assert phase_of(e.child_session_id) == Phase.COMPLETED
    assert invariants() == []


def test_r15_parent_cancelled_before_recovery_is_not_started_and_children_end_cancelled(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(TWO)
    sid, _ = parent_yielded(model.base_url)
    with transaction() as s:  # cancelled while the worker was down: only the phase changed
        s.execute(update(AgentSession).where(AgentSession.id == sid).values(phase=Phase.CANCELLED))
    drive(model.base_url)
    assert phase_of(sid) == Phase.CANCELLED
    assert {(e.status, e.delivery_status) for e in executions_of(sid)} == {("CANCELLED", "SUPPRESSED")}
    assert all(phase_of(e.child_session_id) == Phase.CANCELLED for e in executions_of(sid))
    assert [m.role for m in messages_of(sid)] == ["USER"]
    assert rule_calls(model, 1) == 0 and rule_calls(model, 2) == 0
    assert invariants() == []


def test_r16_a_completed_but_undelivered_child_is_delivered_without_running_again(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(one_child_script())
    sid, sched = parent_yielded(model.base_url)
    deps = loop_deps(model.base_url, sched)
    _, _, children = sched.children.pop()
    run_child(*children[0], deps)  # the child completed; the callback was lost
    child_calls = rule_calls(model, 2)
    drive(model.base_url)
    assert rule_calls(model, 2) == child_calls
    (e,) = executions_of(sid)
    assert e.delivery_status == "DELIVERED"
    assert invariants() == []


def test_r18_a_plain_running_session_without_children_is_resumed_as_before(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "resumed answer"}}])
    sid = make_session(phase=Phase.RUNNING, lease_owner="dead-worker")
    add_message(sid, Role.USER, "question")
    calls = [{"id": "c9", "type": "function", "function": {"name": "echo", "arguments": "{}"}}]
    dangling = add_message(sid, Role.ASSISTANT, "", tool_calls=calls)  # the crash left half a round
    side = make_session(session_type=SessionType.SIDE_TASK, phase=Phase.RESUMING)
    add_message(side, Role.USER, "side question")
    drive(model.base_url)
    msgs = messages_of(sid)
    assert dangling not in [m.id for m in msgs]
    assert [(m.role, m.content) for m in msgs] == [("USER", "question"), ("ASSISTANT", "resumed answer")]
    assert phase_of(sid) == Phase.WAITING_USER and phase_of(side) == Phase.WAITING_USER
    assert invariants() == []


def test_r18_subagent_sessions_never_take_the_generic_path(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory([{"when": {}, "reply": {"content": "should not be called"}}])
    parent = make_session(phase=Phase.WAITING_USER)
    child = make_session(
        session_type=SessionType.SUBAGENT, phase=Phase.RUNNING, parent_session_id=parent, agent_type="reviewer"
    )
    add_message(child, Role.USER, "x")
    sched = RecordingScheduler()
    expire_leases()
    report = scan(sched, callback_grace_seconds=0)
    assert child not in report.resumed_sessions and not sched.resumed
    assert model.journal() == []


def test_r20_a_committed_final_answer_is_not_asked_for_again(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(one_child_script({"content": "SHOULD NOT BE CALLED"}))
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    final = add_message(e.child_session_id, Role.ASSISTANT, "final from before the crash")
    drive(model.base_url)
    (done,) = executions_of(sid)
    assert rule_calls(model, 2) == 0
    assert done.final_message_id == final and done.result["result"] == "final from before the crash"  # type: ignore[index]
    assert invariants() == []


def test_r20_old_row_final_found_after_its_user_instruction(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(
        [
            {"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}},
            {"when": {"system_contains": "reviewer subagent"}, "reply": {"content": "SHOULD NOT BE CALLED"}},
        ]
    )
    parent, child, _ = _legacy_parent_with_child()
    final = add_message(child, Role.ASSISTANT, "legacy final")
    drive(model.base_url)
    (e,) = executions_of(parent)
    assert rule_calls(model, 1) == 0 and e.final_message_id == final and e.delivery_status == "DELIVERED"
    assert invariants() == []


def test_r21_a_cancelled_parent_stays_suppressed_across_two_restarts(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(TWO)
    sid, _ = parent_yielded(model.base_url)
    cancel_session(sid)
    drive(model.base_url)
    with transaction() as s:
        first = [
            (e.id, e.epoch, e.status, e.delivery_status)
            for e in s.execute(select(SubagentExecution).order_by(SubagentExecution.id)).scalars()
        ]
    report = scan(RecordingScheduler(), callback_grace_seconds=0)  # second restart
    assert report.suppressed == [] and report.parents == []
    with transaction() as s:
        second = [
            (e.id, e.epoch, e.status, e.delivery_status)
            for e in s.execute(select(SubagentExecution).order_by(SubagentExecution.id)).scalars()
        ]
    assert first == second and {r[3] for r in second} == {"SUPPRESSED"}
    assert phase_of(sid) == Phase.CANCELLED
    assert invariants() == []


def test_r22_deadline_is_not_reset_by_restart_and_local_waiting_consumes_it(
    model_factory,
    local_presence,
    short_timeout,  # type: ignore[no-untyped-def]
) -> None:
    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    with transaction() as s:  # it had run almost its whole budget before the crash
        from datetime import timedelta

        s.execute(
            update(SubagentExecution)
            .where(SubagentExecution.id == e.id)
            .values(started_at=e.started_at - timedelta(seconds=1.5))
        )
        s.execute(
            update(AgentSession).where(AgentSession.id == e.child_session_id).values(execution_mode=ExecutionMode.LOCAL)
        )
    presence.disconnect("cli")
    threading.Timer(1.5, presence.connect, args=("cli",)).start()  # connects after the deadline
    drive(model.base_url)
    (done,) = executions_of(sid)
    assert (done.status, done.delivery_status) == ("FAILED", "DELIVERED")
    assert rule_calls(model, 2) == 0
    assert done.started_at == e.started_at - __import__("datetime").timedelta(seconds=1.5)  # never reset
    assert invariants() == []


def test_r23_results_are_delivered_in_ascending_execution_id_whatever_finished_first(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}}])
    parent = make_session(phase=Phase.RUNNING)
    add_message(parent, Role.USER, "q")
    low = make_execution(parent, status=ExecutionStatus.RUNNING, tool_call_id="call_low")
    high = make_execution(parent, status=ExecutionStatus.RUNNING, tool_call_id="call_high")
    from models.execution import finish_execution

    for eid in (high, low):  # the higher id finishes first
        with transaction() as s:
            finish_execution(s, eid, epoch=0, status=ExecutionStatus.COMPLETED, result={"success": True, "id": eid})
        time.sleep(0.01)
    drive(model.base_url)
    tools = [m for m in messages_of(parent) if m.role == Role.TOOL]
    assert [t.tool_call_id for t in tools] == ["call_low", "call_high"]
    assert invariants() == []


def test_r24_recovery_after_compaction_with_orphans_and_deleted_rows(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(one_child_script({"content": "after compaction"}))
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    child = e.child_session_id
    calls = [{"id": "c1", "type": "function", "function": {"name": "echo", "arguments": '{"text": "x"}'}}]
    add_message(child, Role.ASSISTANT, "", tool_calls=calls)
    boundary = add_message(child, Role.TOOL, "x", tool_call_id="c1")  # compacted up to here
    orphan = add_message(child, Role.TOOL, "orphan", tool_call_id="ghost")
    deleted = add_message(child, Role.ASSISTANT, "deleted final")
    with transaction() as s:
        s.execute(update(Message).where(Message.id == deleted).values(deleted=True))
        s.execute(
            update(AgentSession)
            .where(AgentSession.id == child)
            .values(compaction_boundary_message_id=boundary, compaction_summary="summary")
        )
    drive(model.base_url)
    live = [m.id for m in messages_of(child)]
    assert orphan not in live and deleted not in live and boundary in live
    (done,) = executions_of(sid)
    assert done.result["result"] == "after compaction"  # type: ignore[index]
    assert invariants() == []


def test_the_same_recover_child_and_deliver_round_messages_several_times_deliver_once(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(TWO)
    sid, _ = parent_yielded(model.base_url)
    expire_leases()
    sched = RecordingScheduler()
    deps = loop_deps(model.base_url, sched)
    scan(sched, callback_grace_seconds=0)
    ((_, epoch, children),) = sched.recoveries
    for eid, e in children:
        assert recover_child(eid, e, deps) == "completed"
        assert recover_child(eid, e, deps) == "stale"
        assert recover_child(eid, e, deps) == "stale"
    # The last recovered child delivered the round itself and asked for the parent's run once.
    assert [p for p, _ in sched.resumed] == [sid]
    kinds = [deliver_round(sid, epoch).kind for _ in range(3)]  # the chord callback, late, three times
    assert kinds == ["stale", "stale", "stale"]
    assert sum(1 for m in messages_of(sid) if m.role == Role.TOOL) == 2
    assert invariants(settled=False) == []


def test_recovery_logs_the_design_events_without_task_text_or_answers(model_factory, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    secret_task = "CANARY-TASK-7f3a"
    secret_answer = "CANARY-ANSWER-91bd"
    model = model_factory(one_child_script({"content": secret_answer}, task=secret_task))
    sid, _ = parent_yielded(model.base_url)
    caplog.set_level(logging.DEBUG)
    drive(model.base_url)
    text = "\n".join(r.getMessage() for r in caplog.records)
    for event in (
        "subagent_recovery_scan",
        "subagent_recovery_start",
        "subagent_recovery_complete",
        "subagent_result_delivered",
        "parent_recovery_wait",
        "parent_recovery_start",
    ):
        assert f"event={event}" in text, event
    assert secret_task not in text and secret_answer not in text
    # ... and a second delivery attempt logs the skip with its reason.
    caplog.clear()
    (e,) = executions_of(sid)
    from recovery.ops import redeliver

    assert redeliver(e.id, RecordingScheduler()) == "already_delivered"
    with transaction() as s:
        from recovery.delivery import deliver_one

        row = s.execute(select(SubagentExecution).where(SubagentExecution.id == e.id)).scalar_one()
        assert deliver_one(s, row, sid) is False
    assert "event=subagent_result_delivery_skipped" in caplog.text and "reason=already_delivered" in caplog.text
    assert invariants() == []


def test_a_parent_cancelled_during_recovery_gets_nothing_and_a_second_restart_leaves_it(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(one_child_script({"tool_calls": [{"name": "wait", "arguments": {"seconds": 20}}]}))
    sid, _ = parent_yielded(model.base_url)
    expire_leases()
    sched = RecordingScheduler()
    deps = loop_deps(model.base_url, sched)
    scan(sched, callback_grace_seconds=0)
    ((_, epoch, children),) = sched.recoveries
    outcome: list[str] = []
    runner = threading.Thread(target=lambda: outcome.append(recover_child(*children[0], deps)))
    runner.start()
    from tests.helpers import wait_until

    wait_until(lambda: phase_of(executions_of(sid)[0].child_session_id) == Phase.RESUMING, timeout=10)
    started = time.monotonic()
    assert cancel_session(sid)[0]
    runner.join(15)
    assert not runner.is_alive() and time.monotonic() - started < 10  # the 20 s wait noticed the cancel
    assert outcome == ["lost"]  # fenced: the cancelled child wrote nothing more
    assert deliver_round(sid, epoch).kind == "suppressed"
    (e,) = executions_of(sid)
    assert (e.status, e.delivery_status) == ("CANCELLED", "SUPPRESSED")
    assert [m.role for m in messages_of(sid)] == ["USER"]
    before = (e.epoch, e.completed_at)
    expire_leases()
    second = scan(RecordingScheduler(), callback_grace_seconds=0)
    assert second.parents == [] and second.suppressed == [] and second.resumed_sessions == []
    (e2,) = executions_of(sid)
    assert (e2.epoch, e2.completed_at) == before and phase_of(sid) == Phase.CANCELLED
    assert rule_calls(model, 1) == 0
    assert invariants() == []


# --- R-cases made able to fail (issue 9) ------------------------------------------------------


def test_r6_recovery_long_after_the_crash_keeps_the_absolute_deadline(model_factory, short_timeout) -> None:  # type: ignore[no-untyped-def]
    """The crash was long ago: a deadline reset at recovery would let the (instant) child
    complete; the absolute deadline fails it without calling the model."""
    from datetime import timedelta

    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    with transaction() as s:
        s.execute(
            update(SubagentExecution)
            .where(SubagentExecution.id == e.id)
            .values(started_at=e.started_at - timedelta(seconds=600))
        )
    drive(model.base_url)
    (done,) = executions_of(sid)
    assert (done.status, done.delivery_status) == ("FAILED", "DELIVERED")
    assert "timed out" in done.result["error"]  # type: ignore[index]
    assert rule_calls(model, 2) == 0  # the child's model was never called again
    assert invariants() == []


def test_r6_past_deadline_and_grace_a_live_lease_does_not_hold_the_execution(model_factory, short_timeout) -> None:  # type: ignore[no-untyped-def]
    """A stuck worker keeps renewing its lease: past deadline + cancel grace the scan takes it."""
    from datetime import timedelta

    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    with transaction() as s:
        s.execute(
            update(SubagentExecution)
            .where(SubagentExecution.id == e.id)
            .values(
                started_at=e.started_at - timedelta(seconds=60),
                lease_owner="stuck-worker",
                lease_expires_at=utcnow() + timedelta(hours=1),
            )
        )
    drive(model.base_url, after_crash=False)  # nobody expires the lease: only the deadline path can
    (done,) = executions_of(sid)
    assert (done.status, done.delivery_status) == ("FAILED", "DELIVERED")
    assert "timed out" in done.result["error"]  # type: ignore[index]
    assert done.epoch > e.epoch  # the stuck worker is fenced


def test_r7_a_local_child_shows_running_and_calls_no_model_until_the_client_connects(
    model_factory, local_presence
) -> None:  # type: ignore[no-untyped-def]
    from harness.views import snapshot

    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    make_local(e.child_session_id)
    presence.disconnect("cli")
    seen: dict[str, Any] = {}

    def connect() -> None:
        seen["child_calls"] = rule_calls(model, 2)
        with transaction() as s:
            seen["phase"] = snapshot(s, e.child_session_id)["phase"]  # type: ignore[index]
        presence.connect("cli")

    timer = threading.Timer(1.5, connect)
    timer.start()
    drive(model.base_url)
    timer.join()
    assert seen == {"child_calls": 0, "phase": "RUNNING"}  # waited (no model call), shown RUNNING
    (done,) = executions_of(sid)
    assert (done.status, done.delivery_status) == ("COMPLETED", "DELIVERED")
    assert rule_calls(model, 2) == 1


def test_r19_legacy_rows_are_neither_delivered_nor_resumed_by_scans(model_factory) -> None:  # type: ignore[no-untyped-def]
    """The LEGACY executions' children are RUNNING with lapsed leases, as a crash before the
    upgrade left them: a scan that took legacy rows for work would resume them (or deliver
    them); it must leave them, their children and their parent alone."""
    model = model_factory(one_child_script())
    parent = make_session(phase=Phase.RUNNING, lease_owner="live@host", lease_expires_at=utcnow() + timedelta(hours=1))
    add_message(parent, Role.USER, "old request")
    lapsed = {"lease_owner": "gone@host", "lease_expires_at": utcnow() - timedelta(minutes=5)}
    children = [
        make_session(
            session_type=SessionType.SUBAGENT,
            phase=Phase.RUNNING,
            parent_session_id=parent,
            agent_type="reviewer",
            **lapsed,
        )
        for _ in range(2)
    ]
    for child in children:
        add_message(child, Role.USER, "old task")
    done = make_execution(
        parent, children[0], status=ExecutionStatus.COMPLETED, invocation=None, tool_call_id=None, **lapsed
    )
    odd = make_execution(
        parent, children[1], status=ExecutionStatus.RUNNING, invocation=None, tool_call_id=None, **lapsed
    )
    with transaction() as s:
        s.execute(
            update(SubagentExecution).where(SubagentExecution.id.in_((done, odd))).values(delivery_status="LEGACY")
        )
    for _ in range(2):
        sched = RecordingScheduler()
        report = scan(sched, callback_grace_seconds=0)
        assert not sched.pending() and report.parents == [] and report.recovering == []
        assert report.resumed_sessions == [] and report.delivering == []
    assert [m.role for m in messages_of(parent)] == ["USER"]
    assert {(e.status, e.delivery_status, e.epoch) for e in executions_of(parent)} == {
        ("COMPLETED", "LEGACY", 0),
        ("RUNNING", "LEGACY", 0),
    }
    assert {phase_of(c) for c in children} == {Phase.RUNNING}
    assert len(model.journal()) == 0


def test_r23_inside_a_pending_round_results_follow_ascending_execution_id(model_factory) -> None:  # type: ignore[no-untyped-def]
    """The round lists call_b before call_a, but call_a's execution is older: its result comes first."""
    from models import PendingRound

    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}}])
    parent = make_session(phase=Phase.RUNNING)
    add_message(parent, Role.USER, "q")
    calls = [
        {"id": cid, "type": "function", "function": {"name": "delegate", "arguments": "{}"}}
        for cid in ("call_b", "call_a")
    ]
    with transaction() as s:
        rnd = PendingRound(session_id=parent, assistant_content="", tool_calls=calls, inline_results={})
        s.add(rnd)
        s.flush()
        round_id = rnd.id
    low = make_execution(parent, status=ExecutionStatus.RUNNING, tool_call_id="call_a")
    high = make_execution(parent, status=ExecutionStatus.RUNNING, tool_call_id="call_b")
    from models.execution import finish_execution

    with transaction() as s:
        s.execute(
            update(SubagentExecution).where(SubagentExecution.id.in_((low, high))).values(pending_round_id=round_id)
        )
        for eid in (high, low):  # the higher id finishes first
            finish_execution(s, eid, epoch=0, status=ExecutionStatus.COMPLETED, result={"success": True, "id": eid})
    drive(model.base_url)
    tools = [m for m in messages_of(parent) if m.role == Role.TOOL]
    assert [t.tool_call_id for t in tools] == ["call_a", "call_b"]
    assert invariants() == []


def test_r24_parent_side_delivery_after_a_compaction_boundary_with_deleted_rows(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    calls = [{"id": "old1", "type": "function", "function": {"name": "echo", "arguments": '{"text": "x"}'}}]
    # The round committed before the crash sits before its pending round's delivery; build a
    # compacted parent history with a deleted row and an orphan TOOL in its tail.
    add_message(sid, Role.ASSISTANT, "", tool_calls=calls)
    boundary = add_message(sid, Role.TOOL, "x", tool_call_id="old1")
    deleted = add_message(sid, Role.ASSISTANT, "deleted words")
    orphan = add_message(sid, Role.TOOL, "orphan", tool_call_id="ghost")
    with transaction() as s:
        s.execute(update(Message).where(Message.id == deleted).values(deleted=True))
        s.execute(
            update(AgentSession)
            .where(AgentSession.id == sid)
            .values(compaction_boundary_message_id=boundary, compaction_summary="summary")
        )
    drive(model.base_url)
    live = [m.id for m in messages_of(sid)]
    assert boundary in live and deleted not in live and orphan not in live
    (e,) = executions_of(sid)
    assert e.delivery_status == "DELIVERED" and e.parent_tool_message_id in live
    assert messages_of(sid)[-1].content.startswith("parent done")  # type: ignore[union-attr]
    assert invariants() == []


def test_a_broken_legacy_pair_repair_keeps_another_executions_delivered_tool_and_the_boundary(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}}])
    parent = make_session(phase=Phase.RUNNING)
    add_message(parent, Role.USER, "q")
    both = [
        {"id": cid, "type": "function", "function": {"name": "delegate", "arguments": "{}"}}
        for cid in ("call_a", "call_b")
    ]
    assistant = add_message(parent, Role.ASSISTANT, "", tool_calls=both)
    b_tool = add_message(parent, Role.TOOL, "b result", tool_call_id="call_b")  # call_a's TOOL is missing
    add_message(parent, Role.USER, "later")  # the broken round is not the tail
    add_message(parent, Role.ASSISTANT, "later answer")
    a = make_execution(parent, status=ExecutionStatus.COMPLETED, tool_call_id="call_a", result={"success": True})
    b = make_execution(parent, status=ExecutionStatus.COMPLETED, tool_call_id="call_b", result={"success": True})
    with transaction() as s:
        s.execute(
            update(SubagentExecution)
            .where(SubagentExecution.id == b)
            .values(
                delivery_status="DELIVERED",
                parent_result_delivered_at=utcnow(),
                parent_assistant_message_id=assistant,
                parent_tool_message_id=b_tool,
            )
        )
        s.execute(
            update(AgentSession).where(AgentSession.id == parent).values(compaction_boundary_message_id=assistant)
        )
    damage = [p for p in invariants(settled=False) if p.startswith("I2")]
    assert damage, "the setup is a history broken before the upgrade"
    drive(model.base_url)
    live = [m.id for m in messages_of(parent)]
    assert assistant in live and b_tool in live  # neither the boundary nor b's delivered result goes
    (ea,) = [e for e in executions_of(parent) if e.id == a]
    assert ea.delivery_status == "DELIVERED"
    # The damage straddles the compaction boundary and b's delivered result, which no repair may
    # delete: it stays as it was (the normalizer drops b's orphaned TOOL from the model's view),
    # and recovery adds no violation of its own (call_a's new pair is legal, delivered once).
    assert invariants() == damage


def test_a_legacy_followup_finished_without_a_model_call_has_its_followup_fields(model_factory) -> None:  # type: ignore[no-untyped-def]
    model = model_factory(
        [
            {"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}},
            {"when": {"system_contains": "reviewer subagent"}, "reply": {"content": "SHOULD NOT BE CALLED"}},
        ]
    )
    parent, child, first = _legacy_parent_with_child(status=ExecutionStatus.COMPLETED)
    with transaction() as s:
        s.execute(update(SubagentExecution).where(SubagentExecution.id == first).values(delivery_status="LEGACY"))
    add_message(child, Role.ASSISTANT, "old answer")
    add_message(child, Role.USER, "legacy followup")
    second = make_execution(parent, child, invocation=None, tool_call_id=None, task="legacy followup")
    add_message(child, Role.ASSISTANT, "followup final")
    drive(model.base_url)
    e = next(x for x in executions_of(parent) if x.id == second)
    assert rule_calls(model, 1) == 0 and e.status == "COMPLETED"
    assert e.result["follow_up"] is True and e.result["round"] == 2  # type: ignore[index]


def test_an_old_rows_last_words_are_not_its_result_when_the_child_failed(model_factory) -> None:  # type: ignore[no-untyped-def]
    """spec §7.3.5: the child's phase is part of the judgement. A FAILED child session's last
    ASSISTANT (an error text) is not a final answer: the child is resumed, the model asked."""
    model = model_factory(
        [
            {"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}},
            {"when": {"system_contains": "reviewer subagent"}, "reply": {"content": "real answer"}},
        ]
    )
    parent, child, _ = _legacy_parent_with_child()
    add_message(child, Role.ASSISTANT, "error: provider exploded")
    with transaction() as s:
        s.execute(update(AgentSession).where(AgentSession.id == child).values(phase=Phase.FAILED))
    drive(model.base_url)
    (e,) = executions_of(parent)
    assert rule_calls(model, 1) == 1 and e.result["result"] == "real answer"  # type: ignore[index]


def test_a_local_client_that_disconnects_mid_run_is_waited_for_before_the_next_round(  # type: ignore[no-untyped-def]
    model_factory, local_presence
) -> None:
    """spec §7.4.1: the child notices the disconnect at its next round and calls no model until
    the client is back (the wait consumes the same deadline)."""
    script = one_child_script({"tool_calls": [{"name": "wait", "arguments": {"seconds": 1.0}}]})
    script.insert(
        2, {"when": {"system_contains": "reviewer subagent", "last_role": "tool"}, "reply": {"content": "ok"}}
    )
    model = model_factory(script)
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    make_local(e.child_session_id)
    presence.connect("cli")
    seen: dict[str, int] = {}

    def drop_then_return() -> None:
        presence.disconnect("cli")  # during the child's 1 s tool
        time.sleep(1.5)
        seen["final_calls_while_away"] = rule_calls(model, 2)
        presence.connect("cli")

    timer = threading.Timer(0.5, drop_then_return)
    timer.start()
    drive(model.base_url)
    timer.join()
    assert seen == {"final_calls_while_away": 0}  # no model call while the client was away
    (done,) = executions_of(sid)
    assert (done.status, done.result["result"]) == ("COMPLETED", "ok")  # type: ignore[index]
