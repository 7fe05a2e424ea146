"""The normal delegation path on real PostgreSQL + Redis + a real 2-process Celery worker,
with the scripted model over HTTP."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import select

from models import Message, Role, SubagentExecution, transaction
from tests.types import StackFactory

pytestmark = pytest.mark.timeout(120)

PARALLEL_SCRIPT = [
    {
        "when": {"system_contains": "main agent", "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "review module A"}},
                {"name": "delegate", "arguments": {"agent_type": "researcher", "task": "research topic B"}},
                {"name": "echo", "arguments": {"text": "inline hello"}},
            ]
        },
    },
    {"when": {"system_contains": "main agent", "turn": 1}, "reply": {"content": "final: {tool_results}"}},
    {
        "when": {"system_contains": "subagent", "turn": 0},
        "reply": {"tool_calls": [{"name": "wait", "arguments": {"seconds": 1}}]},
    },
    {"when": {"system_contains": "reviewer subagent", "turn": 1}, "reply": {"content": "review of A: fine"}},
    {"when": {"system_contains": "researcher subagent", "turn": 1}, "reply": {"content": "research of B: done"}},
]


def _executions(parent: int) -> list[SubagentExecution]:
    with transaction() as s:
        return list(
            s.execute(
                select(SubagentExecution)
                .where(SubagentExecution.parent_session_id == parent)
                .order_by(SubagentExecution.id)
            ).scalars()
        )


def _child_messages(child: int) -> list[Message]:
    with transaction() as s:
        return list(s.execute(select(Message).where(Message.session_id == child).order_by(Message.id)).scalars())


def test_parent_delegates_to_two_children_in_parallel_and_resumes_once(stack_factory: StackFactory) -> None:
    stack = stack_factory(PARALLEL_SCRIPT)
    stack.worker(concurrency=2)
    sid = stack.submit("please review and research")
    snap = stack.wait_phase(sid)

    msgs = snap["messages"]
    assert [m["role"] for m in msgs] == ["USER", "ASSISTANT", "TOOL", "TOOL", "TOOL", "ASSISTANT"]
    calls = msgs[1]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["delegate", "delegate", "echo"]
    # TOOL messages in tool-call order, each answering its call.
    assert [m["tool_call_id"] for m in msgs[2:5]] == [c["id"] for c in calls]
    review, research, echo = (json.loads(msgs[2]["content"]), json.loads(msgs[3]["content"]), msgs[4]["content"])
    assert review["success"] and review["result"] == "review of A: fine" and review["agent_type"] == "reviewer"
    assert research["success"] and research["result"] == "research of B: done"
    assert echo == "inline hello"
    assert "review of A: fine" in msgs[5]["content"] and "research of B: done" in msgs[5]["content"]

    execs = _executions(sid)
    assert len(execs) == 2
    for e, tool_msg in zip(execs, msgs[2:4], strict=True):
        assert (e.status, e.delivery_status) == ("COMPLETED", "DELIVERED")
        assert e.parent_assistant_message_id == msgs[1]["id"]
        assert e.parent_tool_message_id == tool_msg["id"]
        assert tool_msg["source_session_id"] == e.child_session_id
        assert e.invocation_type == "DELEGATE" and e.parent_tool_call_id == tool_msg["tool_call_id"]
        assert e.final_message_id is not None and e.rounds == 2 and e.total_tool_calls == 1

    # Parallel: the two 1-second waits overlapped (run one after the other, their rounds would
    # be committed at least one wait apart).
    (a, b) = execs
    a_wait = next(m for m in _child_messages(a.child_session_id) if m.role == Role.TOOL)
    b_wait = next(m for m in _child_messages(b.child_session_id) if m.role == Role.TOOL)
    assert abs(a_wait.created_at - b_wait.created_at) < timedelta(seconds=1)

    # The parent resumed exactly once: one model call per parent turn.
    journal = stack.model.journal()
    assert sum(1 for j in journal if j["rule"] == 0) == 1
    assert sum(1 for j in journal if j["rule"] == 1) == 1
    assert stack.invariants() == []


def test_cli_submit_then_session_show_reads_the_delegating_session(stack_factory: StackFactory) -> None:
    import os
    import subprocess
    import sys

    stack = stack_factory(PARALLEL_SCRIPT)
    stack.worker(concurrency=2)
    env = {**os.environ, **stack.env}
    cmd = [sys.executable, "-m", "cli.main"]
    submit = subprocess.run(
        [*cmd, "submit", "--agent", "main", "--wait", "60", "please review"],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert submit.returncode == 0, submit.stderr
    sid = int(submit.stdout.strip().splitlines()[-1])
    shown = subprocess.run(
        [*cmd, "session", "show", str(sid), "--json"], env=env, capture_output=True, text=True, timeout=30
    )
    snap = json.loads(shown.stdout)
    assert snap["id"] == sid and snap["phase"] == "WAITING_USER"
    assert [m["role"] for m in snap["messages"]] == ["USER", "ASSISTANT", "TOOL", "TOOL", "TOOL", "ASSISTANT"]
    assert {e["delivery_status"] for e in snap["executions"]} == {"DELIVERED"}
    assert set(snap["executions"][0]) == {
        "id",
        "status",
        "delivery_status",
        "child_session_id",
        "parent_tool_call_id",
        "invocation_type",
    }
    assert set(snap["messages"][1]) == {
        "id",
        "role",
        "content",
        "tool_calls",
        "tool_call_id",
        "source_session_id",
        "incomplete",  # added: an answer the model did not finish (docs/providers.md)
    }
    human = subprocess.run([*cmd, "session", "show", str(sid)], env=env, capture_output=True, text=True, timeout=30)
    assert "delegate#" in human.stdout and "execution" in human.stdout
    status = subprocess.run([*cmd, "status", "--json"], env=env, capture_output=True, text=True, timeout=30)
    report = json.loads(status.stdout)
    assert report["parents_waiting"] == 0
    assert {(r["status"], r["delivery_status"]) for r in report["executions"]} == {("COMPLETED", "DELIVERED")}


def test_operator_redeliver_by_celery_call_is_idempotent(stack_factory: StackFactory) -> None:
    """`celery -A tasks call recovery.redeliver --args='[ID]'`, exactly as the ops docs spell it,
    on a parent whose last child died before delivering; the second call changes nothing."""
    import os
    import subprocess
    import sys

    from tests.helpers import children_done_delivery_lost, executions_of, messages_of, wait_until

    stack = stack_factory([*PARALLEL_SCRIPT[:2], {"when": {"system_contains": "subagent"}, "reply": {"content": "ok"}}])
    sid, _ = children_done_delivery_lost(stack.model.base_url)  # the last child died before delivering
    from tests.helpers import expire_leases

    expire_leases()
    stack.worker()
    env = {**os.environ, **stack.env}
    first = executions_of(sid)[0].id
    cmd = [sys.executable, "-m", "celery", "-A", "tasks", "call", "recovery.redeliver", f"--args=[{first}]"]
    assert subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60).returncode == 0
    stack.wait_phase(sid, timeout=60)
    assert {e.delivery_status for e in executions_of(sid)} == {"DELIVERED"}
    count = len(messages_of(sid))
    assert subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60).returncode == 0
    cli = subprocess.run(
        [sys.executable, "-m", "cli.main", "redeliver", str(first)], env=env, capture_output=True, text=True, timeout=60
    )
    assert cli.stdout.strip() == "already_delivered"
    wait_until(lambda: "recovery.redeliver" in stack.workers[0].log(), timeout=10)
    assert len(messages_of(sid)) == count
    assert stack.invariants() == []
