"""History compatibility with R11–R14, R19, R20, R24 (docs/fault-model.md): rows written before
the upgrade (no invocation type, no tool call id, compacted or deleted history) are inferred,
repaired or left alone, never run twice. Every test ends with invariants I1–I5.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import update

from models import (
    AgentSession,
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
from recovery.scan import scan
from tests.helpers import (
    MAIN,
    RecordingScheduler,
    add_message,
    drive,
    executions_of,
    invariants,
    legacy_parent_with_child,
    make_execution,
    make_session,
    messages_of,
    one_child_script,
    parent_yielded,
    phase_of,
    rule_calls,
)
from tests.types import ModelFactory


@pytest.fixture(autouse=True)
def _db(db: str) -> None:
    pass


def test_r11_an_existing_complete_pair_is_only_marked_delivered(model_factory: ModelFactory) -> None:
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


def test_r12_a_pre_upgrade_running_delegate_is_inferred_and_recovered_with_a_stable_synthetic_id(
    model_factory: ModelFactory,
) -> None:
    model = model_factory(
        [
            {"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}},
            {"when": {"system_contains": "reviewer subagent"}, "reply": {"content": "legacy reviewed"}},
        ]
    )
    parent, child, eid = legacy_parent_with_child()
    drive(model.base_url)
    (e,) = executions_of(parent)
    assert e.invocation_type == InvocationType.DELEGATE
    assert e.parent_tool_call_id == f"recovered_subagent_execution_{eid}"
    assert (e.status, e.delivery_status, e.child_session_id) == ("COMPLETED", "DELIVERED", child)
    call = json.loads(next(m for m in messages_of(parent) if m.tool_calls).tool_calls or "[]")[0]
    assert call["function"]["name"] == "delegate"
    assert json.loads(call["function"]["arguments"]) == {"agent_type": "reviewer", "task": "legacy task"}
    assert invariants() == []


def test_r13_a_pre_upgrade_running_followup_is_inferred_with_its_child_session_id(model_factory: ModelFactory) -> None:
    model = model_factory(
        [
            {"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}},
            {"when": {"system_contains": "reviewer subagent"}, "reply": {"content": "followup reviewed"}},
        ]
    )
    parent, child, first = legacy_parent_with_child(status=ExecutionStatus.COMPLETED)
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


def test_r14_a_child_with_null_phase_and_running_execution_is_recovered(model_factory: ModelFactory) -> None:
    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    assert phase_of(e.child_session_id) is None
    drive(model.base_url)
    assert executions_of(sid)[0].delivery_status == "DELIVERED"
    assert phase_of(e.child_session_id) == Phase.COMPLETED
    assert invariants() == []


def test_r20_old_row_final_found_after_its_user_instruction(model_factory: ModelFactory) -> None:
    model = model_factory(
        [
            {"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}},
            {"when": {"system_contains": "reviewer subagent"}, "reply": {"content": "SHOULD NOT BE CALLED"}},
        ]
    )
    parent, child, _ = legacy_parent_with_child()
    final = add_message(child, Role.ASSISTANT, "legacy final")
    drive(model.base_url)
    (e,) = executions_of(parent)
    assert rule_calls(model, 1) == 0 and e.final_message_id == final and e.delivery_status == "DELIVERED"
    assert invariants() == []


def test_r24_recovery_after_compaction_with_orphans_and_deleted_rows(model_factory: ModelFactory) -> None:
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


def test_r19_legacy_rows_are_neither_delivered_nor_resumed_by_scans(model_factory: ModelFactory) -> None:
    """The LEGACY executions' children are RUNNING with lapsed leases, as a crash before the
    upgrade left them: a scan that took legacy rows for work would resume them (or deliver
    them); it must leave them, their children and their parent alone."""
    model = model_factory(one_child_script())
    parent = make_session(phase=Phase.RUNNING, lease_owner="live@host", lease_expires_at=utcnow() + timedelta(hours=1))
    add_message(parent, Role.USER, "old request")
    lapsed: dict[str, Any] = {"lease_owner": "gone@host", "lease_expires_at": utcnow() - timedelta(minutes=5)}
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


def test_a_broken_legacy_pair_repair_keeps_another_executions_delivered_tool_and_the_boundary(
    model_factory: ModelFactory,
) -> None:
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


def test_a_legacy_followup_finished_without_a_model_call_has_its_followup_fields(model_factory: ModelFactory) -> None:
    model = model_factory(
        [
            {"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}},
            {"when": {"system_contains": "reviewer subagent"}, "reply": {"content": "SHOULD NOT BE CALLED"}},
        ]
    )
    parent, child, first = legacy_parent_with_child(status=ExecutionStatus.COMPLETED)
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


def test_an_old_rows_last_words_are_not_its_result_when_the_child_failed(model_factory: ModelFactory) -> None:
    """The child's phase is part of the judgement. A FAILED child session's last
    ASSISTANT (an error text) is not a final answer: the child is resumed, the model asked."""
    model = model_factory(
        [
            {"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}},
            {"when": {"system_contains": "reviewer subagent"}, "reply": {"content": "real answer"}},
        ]
    )
    parent, child, _ = legacy_parent_with_child()
    add_message(child, Role.ASSISTANT, "error: provider exploded")
    with transaction() as s:
        s.execute(update(AgentSession).where(AgentSession.id == child).values(phase=Phase.FAILED))
    drive(model.base_url)
    (e,) = executions_of(parent)
    assert rule_calls(model, 1) == 1 and e.result["result"] == "real answer"  # type: ignore[index]
