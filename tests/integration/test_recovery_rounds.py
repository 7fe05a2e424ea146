"""The start-up scan, resuming from a safe point and the parent's barrier (docs/tasks.md), with
the regression cases R1–R5, R16, R18, R20 (docs/fault-model.md) and the recovery log events.

A "crash" here is what a dead worker leaves in the database: the test stops driving at that
point, lets every lease lapse, and runs the real scan -> recover_child -> deliver_round -> agent
loop code. Real SIGKILLed workers are in tests/crash. Every test ends with invariants I1–I5.
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from crashpoints import InjectedFault, armed_fault
from harness.child import start_child as run_child
from harness.delivery import deliver_round
from harness.parent import run_agent
from harness.views import create_session
from models import (
    Phase,
    Role,
    SessionType,
    SubagentExecution,
    transaction,
)
from recovery.child import RecoveryBatch, recover_child
from recovery.scan import scan
from tests.helpers import (
    MAIN,
    TWO,
    RecordingScheduler,
    add_message,
    assert_one_delivered_pair,
    drive,
    executions_of,
    expire_leases,
    invariants,
    loop_deps,
    make_session,
    messages_of,
    one_child_script,
    parent_yielded,
    phase_of,
    rule_calls,
    sessions_count,
)
from tests.types import ModelFactory


@pytest.fixture(autouse=True)
def _db(db: str) -> None:
    pass


def test_r1_restart_while_parent_waits_for_first_delegate_recovers_the_original_child(
    model_factory: ModelFactory,
) -> None:
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
    assert messages_of(sid)[-1].content.startswith("parent done")
    assert invariants() == []


def test_r2_restart_while_a_followup_runs_reuses_child_and_execution(model_factory: ModelFactory) -> None:
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
    run_child(*children[0], deps)  # the only child: it delivers the round and resumes the parent
    resumed, new_epoch = deps.scheduler.resumed.pop()
    assert resumed == sid and deliver_round(sid, epoch).kind == "stale"  # a late deliver_round: nothing left
    assert run_agent(sid, new_epoch, deps) == "yielded"
    deps.scheduler.children.clear()  # the worker died: the followup's children were never sent
    followup_before = executions_of(sid)[1]
    assert followup_before.invocation_type == "FOLLOWUP" and followup_before.status == "RUNNING"
    drive(model.base_url)
    first, followup = executions_of(sid)
    assert followup.id == followup_before.id and followup.child_session_id == first.child_session_id == 2
    assert (followup.status, followup.delivery_status) == ("COMPLETED", "DELIVERED")
    assert sessions_count(SessionType.SUBAGENT) == 1
    assert messages_of(sid)[-1].content == "both done"
    assert invariants() == []


def test_r3_two_parallel_children_are_recovered_and_the_parent_waits_for_both(model_factory: ModelFactory) -> None:
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


def test_r4_an_incomplete_child_tool_round_is_dropped_and_not_rerun(model_factory: ModelFactory) -> None:
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


def test_r5_a_child_whose_recovery_fails_is_delivered_as_failed_and_the_parent_continues(
    model_factory: ModelFactory,
) -> None:
    model = model_factory(one_child_script({"error": {"status": 500, "message": "model exploded"}}))
    sid, _ = parent_yielded(model.base_url)
    drive(model.base_url)
    (e,) = executions_of(sid)
    assert (e.status, e.delivery_status) == ("FAILED", "DELIVERED")
    assert phase_of(e.child_session_id) == Phase.FAILED
    tool = next(m for m in messages_of(sid) if m.role == Role.TOOL)
    payload = json.loads(tool.content or "{}")
    assert payload["success"] is False and payload["cancelled"] is False and payload["error"]
    assert messages_of(sid)[-1].content.startswith("parent done")
    assert invariants() == []


def test_r16_a_completed_but_undelivered_child_is_delivered_without_running_again(model_factory: ModelFactory) -> None:
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


def test_r18_a_plain_running_session_without_children_is_resumed_as_before(model_factory: ModelFactory) -> None:
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


def test_r18_subagent_sessions_never_take_the_generic_path(model_factory: ModelFactory) -> None:
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


def test_r20_a_committed_final_answer_is_not_asked_for_again(model_factory: ModelFactory) -> None:
    model = model_factory(one_child_script({"content": "SHOULD NOT BE CALLED"}))
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    final = add_message(e.child_session_id, Role.ASSISTANT, "final from before the crash")
    drive(model.base_url)
    (done,) = executions_of(sid)
    assert rule_calls(model, 2) == 0
    assert done.final_message_id == final and done.result["result"] == "final from before the crash"  # type: ignore[index]
    assert invariants() == []


def test_recovery_logs_the_design_events_without_task_text_or_answers(
    model_factory: ModelFactory, caplog: pytest.LogCaptureFixture
) -> None:
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
    (e,) = executions_of(sid)
    # One spelling per field (logfmt): the ids are execution_id/parent_id/tool_call_id.
    assert f"event=subagent_result_delivered execution_id={e.id} parent_id={sid} tool_call_id=" in text
    assert f"event=parent_recovery_start parent_id={sid} epoch=" in text
    start = f"event=subagent_recovery_start execution_id={e.id} parent_id={sid} child_session_id={e.child_session_id} "
    assert start + "invocation=DELEGATE" in text
    assert f"event=subagent_recovery_complete execution_id={e.id} outcome=completed duration_ms=" in text
    # ... and a second delivery attempt logs the skip with its reason.
    caplog.clear()
    from recovery.ops import redeliver

    assert redeliver(e.id, RecordingScheduler()) == "already_delivered"
    with transaction() as s:
        from harness.delivery import deliver_one

        row = s.execute(select(SubagentExecution).where(SubagentExecution.id == e.id)).scalar_one()
        assert deliver_one(s, row, sid) is False
    assert f"event=subagent_result_delivery_skipped execution_id={e.id} reason=already_delivered" in caplog.text
    assert invariants() == []


def test_a_batch_whose_process_dies_between_children_is_finished_by_the_next_scan(
    model_factory: ModelFactory,
) -> None:
    """A round's recovery message runs its children one after another; the process dies after
    the first (crash point ``recover.between_children``): the second, never taken, is still the
    scan's reservation, and the next scan recovers it; the round is delivered exactly once."""
    model = model_factory(TWO)
    sid, _ = parent_yielded(model.base_url)
    expire_leases()
    sched = RecordingScheduler()
    deps = loop_deps(model.base_url, sched)
    scan(sched, callback_grace_seconds=0)
    ((_, _, children),) = sched.recoveries
    handed: list[list[tuple[int, int]]] = []
    batch = RecoveryBatch(children, handed.append)
    with armed_fault("recover.between_children"), pytest.raises(InjectedFault):
        batch.run(lambda eid, epoch: recover_child(eid, epoch, deps))
    done, waiting = sorted(executions_of(sid), key=lambda e: e.id != children[0][0])
    assert done.status == "COMPLETED" and done.delivery_status == "PENDING"
    assert waiting.status == "RECOVERING" and waiting.lease_owner is None  # still the scan's reservation
    assert handed == [] and sched.resumed == []
    expire_leases()  # the reservation lapses
    sched.recoveries.clear()
    scan(sched, callback_grace_seconds=0)
    ((_, _, again),) = sched.recoveries
    assert [eid for eid, _ in again] == [waiting.id]
    assert RecoveryBatch(again, handed.append).run(lambda eid, epoch: recover_child(eid, epoch, deps)) == ["completed"]
    assert {e.delivery_status for e in executions_of(sid)} == {"DELIVERED"}
    ((parent_id, new_epoch),) = sched.resumed
    assert parent_id == sid and run_agent(sid, new_epoch, deps) == "waiting_user"
    assert [m.role for m in messages_of(sid)] == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    assert invariants() == []
