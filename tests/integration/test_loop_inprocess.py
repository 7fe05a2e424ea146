"""The loop, delegation and delivery driven step by step in-process (real PostgreSQL, real
scripted model over HTTP): followups, busy children, refused recursion, fencing, R17/R25."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import select

from crashpoints import InjectedFault, armed_fault
from harness.agents import DELEGATION_TOOLS, get_agent
from harness.child import start_child as run_child
from harness.delivery import deliver_round
from harness.parent import run_agent
from harness.tools import TOOL_NAMES
from harness.views import create_session
from models import AgentSession, PendingRound, Phase, transaction
from tests.helpers import (
    TWO_CHILDREN,
    RecordingScheduler,
    children_done_delivery_lost,
    executions_of,
    invariants,
    loop_deps,
    messages_of,
)
from tests.types import ModelFactory

MAIN = "main agent"


def _drive(model_url: str, sid: int, sched: RecordingScheduler) -> None:
    """Run the parent, its children and deliveries until the parent's turn ends (in-process)."""
    deps = loop_deps(model_url, sched)
    epoch = 0
    for _ in range(10):
        outcome = run_agent(sid, epoch, deps)
        if outcome != "yielded":
            return
        parent, parent_epoch, children = sched.children[-1]
        for eid, e in children:
            run_child(eid, e, deps)
        # The last child delivered the round itself and enqueued the parent's run (docs/tasks.md).
        resumed, epoch = sched.resumed.pop()
        assert resumed == parent and not sched.resumed
        assert deliver_round(parent, parent_epoch).kind == "stale"
    raise AssertionError("the parent did not finish")


def test_followup_reuses_the_child_session_and_a_busy_child_refuses(model_factory: ModelFactory) -> None:
    script = [
        # Round 1: delegate to a new child (id 2) AND, in the same round, a followup to it while it is busy.
        {
            "when": {"system_contains": MAIN, "turn": 0},
            "reply": {
                "tool_calls": [
                    {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "first look"}},
                    {"name": "delegate_followup", "arguments": {"child_session_id": 2, "task": "too early"}},
                ]
            },
        },
        {
            "when": {"system_contains": MAIN, "turn": 1},
            "reply": {
                "tool_calls": [
                    {"name": "delegate_followup", "arguments": {"child_session_id": 2, "task": "second look"}},
                ]
            },
        },
        {"when": {"system_contains": MAIN, "turn": 2}, "reply": {"content": "all done"}},
        {"when": {"system_contains": "reviewer", "user_contains": "first look"}, "reply": {"content": "looked {user}"}},
    ]
    model = model_factory(script)
    sid = create_session("main", "go")
    sched = RecordingScheduler()
    _drive(model.base_url, sid, sched)

    execs = executions_of(sid)
    assert [(e.invocation_type, e.child_session_id, e.status, e.delivery_status) for e in execs] == [
        ("DELEGATE", 2, "COMPLETED", "DELIVERED"),
        ("FOLLOWUP", 2, "COMPLETED", "DELIVERED"),
    ]
    followup = execs[1].result
    assert followup is not None and followup["follow_up"] is True and followup["round"] == 2
    assert followup["completed_rounds"] == 2
    parent = messages_of(sid)
    busy = next(m for m in parent if m.role == "TOOL" and "busy" in (m.content or ""))
    assert busy.tool_call_id is not None
    # The refused followup wrote nothing: the child has exactly two USER instructions.
    child_users = [m.content for m in messages_of(2) if m.role == "USER"]
    assert child_users == ["first look", "second look"]
    with transaction() as s:
        assert s.execute(select(AgentSession).where(AgentSession.parent_session_id == sid)).scalars().all()[0].id == 2
    assert invariants() == []


def test_a_child_is_never_offered_delegation_tools(model_factory: ModelFactory) -> None:
    from doubles.scripted_model import ScriptedModelServer

    seen_tools: list[list[str]] = []

    class Capturing(ScriptedModelServer):
        def answer(self, body: Any, authorization: str | None) -> tuple[int, dict[str, Any]]:
            system = body["messages"][0]["content"]
            if MAIN not in system:
                seen_tools.append([t["function"]["name"] for t in body.get("tools") or []])
            return super().answer(body, authorization)

    script = [
        {
            "when": {"system_contains": MAIN, "turn": 0},
            "reply": {"tool_calls": [{"name": "delegate", "arguments": {"agent_type": "researcher", "task": "x"}}]},
        },
        {"when": {"system_contains": MAIN}, "reply": {"content": "ok"}},
        # The child tries to delegate anyway: refused as an unavailable tool, no new execution.
        {
            "when": {"system_contains": "subagent", "turn": 0},
            "reply": {"tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "y"}}]},
        },
        {"when": {"system_contains": "subagent", "turn": 1}, "reply": {"content": "could not delegate"}},
    ]
    server = Capturing(script)
    server.start()
    try:
        sid = create_session("main", "go")
        _drive(server.base_url, sid, RecordingScheduler())
    finally:
        server.stop()
    assert seen_tools and all(not set(DELEGATION_TOOLS) & set(tools) for tools in seen_tools)
    assert "echo" in seen_tools[0]
    assert len(executions_of(sid)) == 1
    child_tool = next(m for m in messages_of(2) if m.role == "TOOL")
    assert "not available" in (child_tool.content or "")
    assert set(DELEGATION_TOOLS) & set(get_agent("main").tool_names(TOOL_NAMES, subagent=False))
    assert invariants() == []


def test_r17_after_a_failed_child_the_parent_may_delegate_again(model_factory: ModelFactory) -> None:
    script = [
        {
            "when": {"system_contains": MAIN, "turn": 0},
            "reply": {
                "tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "attempt one"}}]
            },
        },
        {
            "when": {"system_contains": MAIN, "turn": 1},
            "reply": {
                "tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "attempt two"}}]
            },
        },
        {"when": {"system_contains": MAIN, "turn": 2}, "reply": {"content": "done after retry"}},
        # "attempt one" matches no rule: the model answers 400 and the child fails.
        {"when": {"system_contains": "reviewer", "user_contains": "attempt two"}, "reply": {"content": "fine now"}},
    ]
    model = model_factory(script)
    sid = create_session("main", "go")
    _drive(model.base_url, sid, RecordingScheduler())
    first, second = executions_of(sid)
    assert (first.status, first.delivery_status) == ("FAILED", "DELIVERED")
    assert first.result is not None and first.result["success"] is False and first.result["error"]
    assert "attempt one" not in (first.error or "")  # I8: no task text in the error column
    assert (second.status, second.delivery_status) == ("COMPLETED", "DELIVERED")
    assert second.child_session_id != first.child_session_id and second.id > first.id
    failed_tool = next(m for m in messages_of(sid) if m.tool_call_id == first.parent_tool_call_id and m.role == "TOOL")
    assert json.loads(failed_tool.content or "{}")["success"] is False
    assert invariants() == []


@pytest.mark.parametrize("point", ["round.after_assistant", "round.after_some_tools", "round.after_all_tools"])
def test_r25_a_fault_inside_the_round_transaction_rolls_the_whole_round_back(
    model_factory: ModelFactory, point: str
) -> None:
    model = model_factory(TWO_CHILDREN)
    sid, epoch = children_done_delivery_lost(model.base_url)
    before = [m.id for m in messages_of(sid)]
    with armed_fault(point), pytest.raises(InjectedFault):
        deliver_round(sid, epoch)
    assert [m.id for m in messages_of(sid)] == before  # nothing of the round stayed
    assert {e.delivery_status for e in executions_of(sid)} == {"PENDING"}
    with transaction() as s:
        assert s.execute(select(PendingRound.closed_at).where(PendingRound.session_id == sid)).scalar_one() is None

    outcome = deliver_round(sid, epoch)  # run it again
    assert outcome.kind == "resume"
    msgs = messages_of(sid)
    assert [m.role for m in msgs] == ["USER", "ASSISTANT", "TOOL", "TOOL", "TOOL"]
    assert [m.tool_call_id for m in msgs[2:]] == [c["id"] for c in json.loads(msgs[1].tool_calls or "[]")]
    assert {e.delivery_status for e in executions_of(sid)} == {"DELIVERED"}
    assert invariants(settled=False) == []


def test_r25_a_fault_in_a_parent_inline_round_commits_nothing(model_factory: ModelFactory) -> None:
    model = model_factory(
        [
            {
                "when": {"system_contains": MAIN, "turn": 0},
                "reply": {
                    "tool_calls": [
                        {"name": "echo", "arguments": {"text": "a"}},
                        {"name": "echo", "arguments": {"text": "b"}},
                    ]
                },
            },
            {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "done"}},
        ]
    )
    sid = create_session("main", "go")
    deps = loop_deps(model.base_url)
    with armed_fault("round.after_some_tools"):
        assert run_agent(sid, 0, deps) == "failed"
    assert [m.role for m in messages_of(sid)] == ["USER"]


def test_a_duplicate_run_child_message_does_not_run_the_child_twice(model_factory: ModelFactory) -> None:
    model = model_factory(TWO_CHILDREN)
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    _, _, children = deps.scheduler.children[-1]
    eid, e = children[0]
    assert run_child(eid, e, deps) == "completed"
    assert run_child(eid, e, deps) == "stale"
    assert sum(1 for j in model.journal() if j["rule"] == 2) == 1


def test_a_last_child_whose_delivery_raises_asks_for_it_as_a_task_which_delivers_the_round_once(
    model_factory: ModelFactory,
) -> None:
    """No chord behind the children: a last child whose in-process delivery fails (a database
    blip) sends ``agent.deliver_round`` itself; that message delivers the round once, and a
    second copy of it is stale."""
    model = model_factory(TWO_CHILDREN)
    sched = RecordingScheduler()
    deps = loop_deps(model.base_url, sched)
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    _, epoch, children = sched.children.pop()
    with armed_fault("deliver.mid_round"):
        for eid, e in children:
            assert run_child(eid, e, deps) == "completed"
    assert sched.deliveries == [(sid, epoch)] and not sched.resumed  # asked for, nothing written
    assert {e.delivery_status for e in executions_of(sid)} == {"PENDING"}

    assert deliver_round(sid, epoch).kind == "resume"  # the message runs
    assert deliver_round(sid, epoch).kind == "stale"  # a second copy of it
    assert [m.role for m in messages_of(sid)] == ["USER", "ASSISTANT", "TOOL", "TOOL", "TOOL"]
    assert {e.delivery_status for e in executions_of(sid)} == {"DELIVERED"}
    assert invariants(settled=False) == []


def test_a_cancelled_parent_gets_nothing_and_is_not_resumed(model_factory: ModelFactory) -> None:
    from harness.cancel import cancel_session

    model = model_factory(TWO_CHILDREN)
    sid, epoch = children_done_delivery_lost(model.base_url)
    assert cancel_session(sid)[0]
    count = len(messages_of(sid))
    assert deliver_round(sid, epoch).kind == "suppressed"
    assert len(messages_of(sid)) == count
    assert {e.delivery_status for e in executions_of(sid)} == {"SUPPRESSED"}
    with transaction() as s:
        assert s.execute(select(AgentSession.phase).where(AgentSession.id == sid)).scalar_one() == Phase.CANCELLED
    assert invariants() == []


@pytest.mark.parametrize("point", ["delegate.after_child_session", "delegate.after_user_message"])
def test_a_failure_inside_delegation_creation_leaves_no_orphan_row(model_factory: ModelFactory, point: str) -> None:
    from models import Message, SubagentExecution

    model = model_factory(TWO_CHILDREN)
    sid = create_session("main", "go")
    deps = loop_deps(model.base_url)
    with armed_fault(point):
        assert run_agent(sid, 0, deps) == "failed"  # the round transaction rolled back whole
    with transaction() as s:
        assert s.execute(select(AgentSession.id).where(AgentSession.parent_session_id == sid)).all() == []
        assert s.execute(select(SubagentExecution.id)).all() == []
        assert s.execute(select(PendingRound.id)).all() == []
        assert [m.role for m in s.execute(select(Message)).scalars()] == ["USER"]
    assert deps.scheduler.children == []


def test_a_run_message_for_a_session_that_no_longer_exists_is_stale_not_an_error(db: str) -> None:
    """A late ``agent.run`` whose session was deleted (retention, an operator) does nothing."""
    from harness.parent import RunOutcome, run_agent
    from tests.helpers import loop_deps

    assert run_agent(987654, 0, loop_deps("http://127.0.0.1:9/v1")) == RunOutcome.STALE


@pytest.mark.parametrize(
    ("before", "moved", "after"),
    [
        (Phase.IDLE, True, Phase.RUNNING),
        (Phase.RESUMING, True, Phase.RUNNING),
        (Phase.WAITING_APPROVAL, False, Phase.WAITING_APPROVAL),
        (Phase.CANCELLED, False, Phase.CANCELLED),
    ],
)
def test_the_start_reads_the_facts_and_moves_the_phase_only_from_a_startable_one_in_one_statement(
    model_factory: ModelFactory, before: Phase, moved: bool, after: Phase
) -> None:
    """``load_child_starting``: the facts as before the move (the previous phase), the phase
    moved to RUNNING only from CHILD_STARTABLE (the compare-and-set's rowcount is reported),
    one statement on PostgreSQL."""
    from sqlalchemy import event, update

    from harness.child import load_child_starting

    model = model_factory(TWO_CHILDREN)
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    eid = deps.scheduler.children[-1][2][0][0]
    child = next(e.child_session_id for e in executions_of(sid) if e.id == eid)
    with transaction() as s:
        s.execute(update(AgentSession).where(AgentSession.id == child).values(phase=before))
    statements: list[str] = []
    with transaction() as s:
        conn = s.connection()
        event.listen(conn, "before_cursor_execute", lambda *a: statements.append(a[2]))
        info, landed = load_child_starting(s, eid)
    assert (info.child_phase, landed) == (before, moved)
    assert info.child_session_id == child and info.execution_id == eid
    assert len(statements) == 1
    with transaction() as s:
        assert s.execute(select(AgentSession.phase).where(AgentSession.id == child)).scalar_one() == after
