"""Approvals with real workers SIGKILLed: a parent delegates to a child whose tool needs a
human yes; the worker dies while the request is pending (or at each named approval point); a
new worker boots; ``agent-recovery approve`` from the CLI; the tool runs at most once, only
after the approval, and the child's result reaches the parent once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from models import ApprovalRequest, ApprovalStatus, transaction
from tests.helpers import approval_environment, executions_of, messages_of, phase_of, wait_until
from tests.types import StackFactory

pytestmark = [pytest.mark.crash, pytest.mark.timeout(180)]

MAIN = "main agent"
AGENTS = """
[agents.main]
system_prompt = "You are the main agent."
[agents.reviewer]
system_prompt = "You are the reviewer subagent."
"""
SCRIPT: list[dict[str, Any]] = [
    {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {"tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "refund A-1"}}]},
    },
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "final answer"}},
    {
        "when": {"system_contains": "subagent", "turn": 0},
        "reply": {"tool_calls": [{"name": "refund", "arguments": {"order": "A-1", "amount": 30}}]},
    },
    {"when": {"system_contains": "subagent", "turn": 1}, "reply": {"content": "child saw: {tool_results}"}},
]


@pytest.fixture
def approval_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """AGENTS_FILE, TOOL_MODULES (``tests.approval_tools``: ``refund`` needs approval) and the
    file each run of ``refund`` appends a line to, for this process and every worker."""
    yield from approval_environment(monkeypatch, tmp_path, AGENTS)


def pending_request() -> ApprovalRequest | None:
    with transaction() as s:
        return s.execute(
            select(ApprovalRequest).where(ApprovalRequest.status == ApprovalStatus.PENDING)
        ).scalar_one_or_none()


def parked() -> ApprovalRequest | None:
    req = pending_request()
    return req if req is not None and phase_of(req.session_id) == "WAITING_APPROVAL" else None


def cli(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *argv],
        env={**os.environ, "CRASH_POINT": "", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def refund_runs(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def delivered_once(sid: int) -> str:
    (execution,) = executions_of(sid)
    assert (execution.status, execution.delivery_status) == ("COMPLETED", "DELIVERED")
    tools = [m for m in messages_of(sid) if m.role == "TOOL"]
    assert len(tools) == 1  # the child's result reached the parent once
    return str(json.loads(tools[0].content or "")["result"])


def test_a_worker_killed_while_a_childs_request_is_pending_then_a_cli_approval_runs_the_tool_once(
    stack_factory: StackFactory, approval_env: Path
) -> None:
    stack = stack_factory(SCRIPT)
    w1 = stack.worker("w1")
    sid = stack.submit("go")
    req = wait_until(parked, timeout=60, what="the child parked for approval")
    w1.kill()
    stack.worker("w2", beat=True)
    time.sleep(6)  # the boot scan and two beat scans (SCAN_INTERVAL_SECONDS=2) pass over it
    assert parked() is not None and refund_runs(approval_env) == []
    listed = json.loads(cli("approvals", "--json").stdout)
    assert [(r["session_id"], r["call_id"], r["tool"], r["agent_type"]) for r in listed] == [
        (req.session_id, req.call_id, "refund", "reviewer")
    ]
    done = cli("approve", str(req.session_id), req.call_id, "--by", "operator")
    assert done.returncode == 0, done.stderr
    stack.wait_phase(sid, timeout=90)
    assert [(r["order"], r["amount"]) for r in refund_runs(approval_env)] == [("A-1", 30)]
    assert delivered_once(sid) == "child saw: refunded 30 on A-1"
    assert stack.invariants() == []


#: Each named approval step, in the worker (or the CLI: after_decision) that dies there.
WORKER_POINTS = ["approval.after_request", "approval.after_park"]


@pytest.mark.parametrize("point", WORKER_POINTS)
def test_a_worker_killed_at_an_approval_point_leaves_a_request_a_new_worker_parks_and_the_cli_approves(
    stack_factory: StackFactory, approval_env: Path, point: str
) -> None:
    stack = stack_factory(SCRIPT)
    w1 = stack.worker("w1", concurrency=1, CRASH_POINT=point)
    sid = stack.submit("go")
    wait_until(lambda: f"crash_point={point}" in w1.log() or w1.exited, timeout=60, what=f"crash at {point}")
    assert f"crash_point={point}" in w1.log()
    w1.kill()
    stack.worker("w2", beat=True)
    req = wait_until(parked, timeout=60, what="the child parked again after recovery")
    assert refund_runs(approval_env) == []
    assert cli("approve", str(req.session_id), req.call_id).returncode == 0
    stack.wait_phase(sid, timeout=90)
    assert len(refund_runs(approval_env)) == 1
    assert delivered_once(sid).startswith("child saw: refunded 30")
    assert stack.invariants() == []


def test_a_cli_killed_right_after_its_decision_committed_is_acted_on_by_the_scan(
    stack_factory: StackFactory, approval_env: Path
) -> None:
    stack = stack_factory(SCRIPT)
    stack.worker("w1", beat=True)
    sid = stack.submit("go")
    req = wait_until(parked, timeout=60, what="the child parked for approval")
    done = cli("approve", str(req.session_id), req.call_id, CRASH_POINT="approval.after_decision")
    assert done.returncode == 137 and "crash_point=approval.after_decision" in done.stderr
    stack.wait_phase(sid, timeout=90)  # no message was sent: the reservation lapsed, the scan sent it
    assert len(refund_runs(approval_env)) == 1
    assert delivered_once(sid).startswith("child saw: refunded 30")
    assert stack.invariants() == []


def test_a_worker_killed_inside_the_approved_tool_never_runs_it_twice(
    stack_factory: StackFactory, approval_env: Path
) -> None:
    stack = stack_factory(SCRIPT)
    w1 = stack.worker("w1", CRASH_POINT="journal.after_tool_start")
    sid = stack.submit("go")
    req = wait_until(parked, timeout=60, what="the child parked for approval")
    edited = cli("approve", str(req.session_id), req.call_id, "--arguments", '{"amount": 25, "order": "A-1"}')
    assert edited.returncode == 0, edited.stderr
    wait_until(lambda: "crash_point=journal.after_tool_start" in w1.log(), timeout=60, what="the crash in the tool")
    w1.kill()
    stack.worker("w2", beat=True)
    stack.wait_phase(sid, timeout=90)
    assert refund_runs(approval_env) == []  # started (journaled), killed before it ran, not run again
    result = delivered_once(sid)
    assert "interrupted by a restart" in result
    # The interrupted call is quoted as the approver edited it, never with the model's amount.
    assert '"amount":25' in result and '"amount": 30' not in result and "edited the arguments" in result
    assert stack.invariants() == []


def test_a_cli_cancel_of_a_child_waiting_for_approval_delivers_it_as_cancelled_within_two_leases(
    stack_factory: StackFactory, approval_env: Path
) -> None:
    stack = stack_factory(SCRIPT)
    stack.worker("w1", beat=True)
    sid = stack.submit("go")
    req = wait_until(parked, timeout=60, what="the child parked for approval")
    done = cli("cancel", str(req.session_id))
    assert done.returncode == 0 and "cancelled" in done.stdout, done.stderr
    stack.wait_phase(sid, timeout=30)
    (execution,) = executions_of(sid)
    assert (execution.status, execution.delivery_status) == ("CANCELLED", "DELIVERED")
    ((result,),) = [[json.loads(m.content or "") for m in messages_of(sid) if m.role == "TOOL"]]
    assert (result["success"], result["cancelled"]) == (False, True)
    with transaction() as s:
        status, cancelled_at = s.execute(
            select(ApprovalRequest.status, ApprovalRequest.decided_at).where(ApprovalRequest.id == req.id)
        ).one()
    assert status == ApprovalStatus.CANCELLED and cancelled_at is not None
    # From the cancel's commit to the parent's answer, both in the database's time.
    took = (messages_of(sid)[-1].created_at - cancelled_at).total_seconds()
    print(f"cancel_to_parent_answer_seconds={took:.2f}")
    assert took < 2 * 3  # two leases (LEASE_SECONDS=3), not the child's deadline (an hour)
    time.sleep(3)  # more scans pass: nothing resumes the cancelled child
    assert refund_runs(approval_env) == [] and phase_of(req.session_id) == "CANCELLED"
    assert stack.invariants() == []
