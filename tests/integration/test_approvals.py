"""A human approves a tool call before it runs: requests written with the reply, the session
parked in WAITING_APPROVAL, decisions as compare-and-sets, the scan as backstop, children in a
round, delegations that need approval (real PostgreSQL, scripted model over loopback HTTP)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

import harness.journal
from harness.approval import DecisionRefused, decide
from harness.cancel import cancel_session
from harness.child import start_child
from harness.delivery import deliver_and_resume
from harness.parent import run_agent
from harness.tools import ToolContext, tool, unregister
from harness.views import create_session
from models import AgentSession, ApprovalRequest, ApprovalStatus, Phase, SubagentExecution, transaction, utcnow
from models.approval import Decision, DecisionOutcome
from recovery.child import recover_child
from recovery.scan import scan
from tests.helpers import RecordingScheduler, executions_of, expire_leases, invariants, loop_deps, messages_of, phase_of
from tests.types import ModelFactory

MAIN = "main agent"

AGENTS = """
[agents.main]
system_prompt = "You are the main agent."
approve = ["wire_*"]
[agents.reviewer]
system_prompt = "You are the reviewer subagent."
"""


@dataclass
class Runs:
    """Every start of a tool that changes the world: (tool, session, arguments)."""

    starts: list[tuple[str, int, dict[str, Any]]]


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[Runs]:
    """``refund`` (``@tool(requires_approval=True)``), ``wire_money`` (plain, but the main
    agent's ``approve = ["wire_*"]`` covers it), offered to every agent."""
    from harness.agents import _load
    from settings import get_settings

    agents = tmp_path / "agents.toml"
    agents.write_text(AGENTS, encoding="utf-8")
    monkeypatch.setenv("AGENTS_FILE", str(agents))
    get_settings.cache_clear()
    _load.cache_clear()
    rec = Runs([])
    unregister("refund")  # tests.approval_tools' one, if another test of this process loaded it

    @tool(requires_approval=True)
    def refund(ctx: ToolContext, order: str, amount: int) -> str:
        """Refund an order."""
        rec.starts.append(("refund", ctx.session_id, {"order": order, "amount": amount}))
        return f"refunded {amount} on {order}"

    @tool
    def wire_money(ctx: ToolContext, amount: int) -> str:
        """Wire money."""
        rec.starts.append(("wire_money", ctx.session_id, {"amount": amount}))
        return f"wired {amount}"

    yield rec
    unregister("refund")
    unregister("wire_money")
    monkeypatch.undo()
    get_settings.cache_clear()
    _load.cache_clear()


def call(name: str, **args: Any) -> dict[str, Any]:
    return {"name": name, "arguments": args}


def parent_script(*calls: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"when": {"system_contains": MAIN, "turn": 0}, "reply": {"tool_calls": list(calls)}},
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "parent saw: {tool_results}"}},
        {"when": {"system_contains": "subagent"}, "reply": {"content": "child result"}},
    ]


def child_script(*calls: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "when": {"system_contains": MAIN, "turn": 0},
            "reply": {"tool_calls": [call("delegate", agent_type="reviewer", task="t")]},
        },
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "final: {tool_results}"}},
        {"when": {"system_contains": "subagent", "turn": 0}, "reply": {"tool_calls": list(calls)}},
        {"when": {"system_contains": "subagent", "turn": 1}, "reply": {"content": "child saw: {tool_results}"}},
    ]


def requests() -> list[ApprovalRequest]:
    with transaction() as s:
        return list(s.execute(select(ApprovalRequest).order_by(ApprovalRequest.id)).scalars())


def session_row(sid: int) -> AgentSession:
    with transaction() as s:
        return s.execute(select(AgentSession).where(AgentSession.id == sid)).scalar_one()


def settle(deps: Any, *, max_steps: int = 30) -> None:
    """Run what the scheduler holds until nothing is left (no scan, no lease expiry)."""
    sched: RecordingScheduler = deps.scheduler
    for _ in range(max_steps):
        if not sched.pending():
            return
        if sched.recoveries:
            _, _, children = sched.recoveries.pop(0)
            for eid, e in children:
                recover_child(eid, e, deps)
        elif sched.children:
            parent, epoch, children = sched.children.pop(0)
            for eid, e in children:
                start_child(eid, e, deps)
            sched.deliveries.append((parent, epoch))
        elif sched.deliveries:
            parent, epoch = sched.deliveries.pop(0)
            deliver_and_resume(parent, epoch, sched)
        else:
            sid, e = sched.resumed.pop(0)
            run_agent(sid, e, deps)
    raise AssertionError("did not settle")


def a_scan_after_every_lease_lapsed(deps: Any) -> None:
    expire_leases()
    scan(deps.scheduler, callback_grace_seconds=0)


def approve(sid: int, cid: str, deps: Any, **kw: Any) -> Any:
    return decide(
        sid, cid, Decision(True, kw.pop("by", "alice"), kw.pop("note", ""), kw.pop("arguments", None)), deps.scheduler
    )


def deny(sid: int, cid: str, deps: Any, reason: str, by: str = "bob") -> Any:
    return decide(sid, cid, Decision(False, by, reason), deps.scheduler)


def parked_parent(model_url: str) -> tuple[int, Any]:
    deps = loop_deps(model_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "waiting_approval"
    return sid, deps


def test_a_call_that_needs_approval_is_requested_with_the_reply_and_parks_the_session_after_the_other_calls_ran(
    model_factory: ModelFactory, runs: Runs
) -> None:
    model = model_factory(
        parent_script(call("refund", order="A-1", amount=30), call("wire_money", amount=5), call("echo", text="hi"))
    )
    sid, _deps = parked_parent(model.base_url)
    assert runs.starts == []  # neither refund (@tool) nor wire_money (AGENTS_FILE glob) ran
    reqs = requests()
    assert [(r.tool, r.status, r.agent_type, json.loads(r.arguments)) for r in reqs] == [
        ("refund", ApprovalStatus.PENDING, "main", {"order": "A-1", "amount": 30}),
        ("wire_money", ApprovalStatus.PENDING, "main", {"amount": 5}),
    ]
    with transaction() as s:
        journal_created = s.execute(select(harness.journal.store.RoundJournal.created_at)).scalar_one()
    assert all(abs(r.requested_at - journal_created) < timedelta(seconds=2) for r in reqs)
    assert all(timedelta(hours=23) < r.expires_at - r.requested_at <= timedelta(hours=24) for r in reqs)
    row = session_row(sid)
    assert (row.phase, row.lease_owner, row.lease_expires_at) == (Phase.WAITING_APPROVAL, None, None)
    # echo (no approval needed) ran before the park, and its result is journaled.
    with transaction() as s:
        results = {c.tool_name: c.result for c in s.execute(select(harness.journal.store.RoundJournalCall)).scalars()}
    assert results == {"echo": "hi"}
    assert [m.role for m in messages_of(sid)] == ["USER"]  # the round is not in the history yet


def test_a_request_that_cannot_be_written_takes_the_journaled_reply_with_it(
    model_factory: ModelFactory, runs: Runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    import models.approval

    class Down(RuntimeError):
        pass

    def fail(*_: Any, **__: Any) -> None:
        raise Down("the request's insert failed")

    monkeypatch.setattr(models.approval, "record_requests", fail)
    model = model_factory(parent_script(call("refund", order="A-1", amount=30), call("echo", text="hi")))
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url)) == "failed"
    with transaction() as s:
        assert s.execute(select(harness.journal.store.RoundJournal)).first() is None  # one transaction
    assert runs.starts == []


def test_the_scan_never_resumes_a_session_waiting_for_approval_before_a_decision(
    model_factory: ModelFactory, runs: Runs
) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=30)))
    sid, deps = parked_parent(model.base_url)
    for _ in range(3):
        a_scan_after_every_lease_lapsed(deps)
    assert not deps.scheduler.pending()
    assert phase_of(sid) == Phase.WAITING_APPROVAL and runs.starts == []


def test_an_approval_resumes_the_loop_which_runs_the_tool_once_and_the_model_sees_its_result(
    model_factory: ModelFactory, runs: Runs
) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=30), call("echo", text="hi")))
    sid, deps = parked_parent(model.base_url)
    (req,) = requests()
    result = approve(sid, req.call_id, deps, note="ok by policy")
    assert result.outcome == DecisionOutcome.DECIDED and result.resumed
    settle(deps)
    assert runs.starts == [("refund", sid, {"order": "A-1", "amount": 30})]
    tools = [m.content for m in messages_of(sid) if m.role == "TOOL"]
    assert tools == ["refunded 30 on A-1", "hi"]  # reply order, though refund ran last
    assert phase_of(sid) == Phase.WAITING_USER
    (req,) = requests()
    assert (req.status, req.decided_by, req.reason) == (ApprovalStatus.APPROVED, "alice", "ok by policy")
    a_scan_after_every_lease_lapsed(deps)
    settle(deps)
    assert len(runs.starts) == 1
    assert invariants() == []


def test_a_denial_is_the_tool_result_denied_by_name_reason_and_the_tool_never_runs(
    model_factory: ModelFactory, runs: Runs
) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=30)))
    sid, deps = parked_parent(model.base_url)
    (req,) = requests()
    assert deny(sid, req.call_id, deps, "too much").outcome == DecisionOutcome.DECIDED
    settle(deps)
    assert runs.starts == []
    assert [m.content for m in messages_of(sid) if m.role == "TOOL"] == ["denied by an approver: too much"]
    assert messages_of(sid)[-1].content == "parent saw: denied by an approver: too much"
    assert invariants() == []


def test_the_first_decision_wins_a_repeat_is_a_no_op_and_a_conflicting_one_is_refused_naming_the_one_that_stands(
    model_factory: ModelFactory, runs: Runs
) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=30)))
    sid, deps = parked_parent(model.base_url)
    (req,) = requests()
    assert deny(sid, req.call_id, deps, "no").outcome == DecisionOutcome.DECIDED
    again = deny(sid, req.call_id, deps, "no")
    assert again.outcome == DecisionOutcome.REPEATED and not again.resumed
    assert "already denied by bob" in again.describe()
    conflict = approve(sid, req.call_id, deps)
    assert conflict.outcome == DecisionOutcome.CONFLICT
    assert conflict.describe() == "refused: the decision that stands is denied by bob: no"
    assert len(deps.scheduler.resumed) == 1  # only the first decision handed the session back
    assert approve(sid, "no-such-call", deps).outcome == DecisionOutcome.NOT_FOUND


def test_an_approval_with_edited_arguments_is_validated_recorded_and_the_tool_runs_with_them(
    model_factory: ModelFactory, runs: Runs
) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=300)))
    sid, deps = parked_parent(model.base_url)
    (req,) = requests()
    with pytest.raises(DecisionRefused, match="schema"):
        approve(sid, req.call_id, deps, arguments='{"order": "A-1", "amount": "lots"}')
    assert requests()[0].status == ApprovalStatus.PENDING
    approve(sid, req.call_id, deps, arguments='{"order": "A-1", "amount": 30}')
    settle(deps)
    assert runs.starts == [("refund", sid, {"order": "A-1", "amount": 30})]
    (req,) = requests()
    assert json.loads(req.arguments) == {"order": "A-1", "amount": 300}  # the originals are kept
    assert json.loads(req.approved_arguments or "") == {"order": "A-1", "amount": 30}


def test_an_expired_request_is_denied_with_reason_expired_by_the_scan_backstop(
    model_factory: ModelFactory, runs: Runs
) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=30)))
    sid, deps = parked_parent(model.base_url)
    with transaction() as s:
        s.execute(update(ApprovalRequest).values(expires_at=utcnow() - timedelta(seconds=1)))
    a_scan_after_every_lease_lapsed(deps)
    settle(deps)
    assert runs.starts == []
    assert [m.content for m in messages_of(sid) if m.role == "TOOL"] == ["denied by system: expired"]
    (req,) = requests()
    assert req.status == ApprovalStatus.EXPIRED
    assert approve(sid, req.call_id, deps).outcome == DecisionOutcome.CONFLICT


def test_a_decision_that_lands_while_the_loop_still_runs_its_other_calls_is_used_without_parking(
    model_factory: ModelFactory, runs: Runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=30), call("echo", text="hi")))
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    real = harness.journal.crash_point

    def approve_now(name: str) -> None:
        if name == "approval.after_request":
            (req,) = requests()
            assert approve(sid, req.call_id, deps).resumed is False  # the session is not parked
        real(name)

    monkeypatch.setattr(harness.journal, "crash_point", approve_now)
    assert run_agent(sid, 0, deps) == "waiting_user"
    assert len(runs.starts) == 1 and not deps.scheduler.pending()
    assert invariants() == []


def test_a_decision_made_while_the_hand_over_is_lost_is_acted_on_by_the_scan(
    model_factory: ModelFactory, runs: Runs
) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=30)))
    sid, deps = parked_parent(model.base_url)
    (req,) = requests()
    approve(sid, req.call_id, deps)
    deps.scheduler.resumed.clear()  # the message is lost (every worker down, Redis flushed)
    a_scan_after_every_lease_lapsed(deps)
    settle(deps)
    assert len(runs.starts) == 1 and phase_of(sid) == Phase.WAITING_USER


def child_parked(model_url: str) -> tuple[int, SubagentExecution, Any]:
    deps = loop_deps(model_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    _, _, children = deps.scheduler.children.pop()
    ((eid, e),) = children
    assert start_child(eid, e, deps) == "waiting_approval"
    (execution,) = executions_of(sid)
    return sid, execution, deps


def test_a_child_waiting_for_approval_keeps_its_parents_round_waiting_and_an_approval_delivers_its_result_once(
    model_factory: ModelFactory, runs: Runs
) -> None:
    model = model_factory(child_script(call("refund", order="C-9", amount=12)))
    sid, execution, deps = child_parked(model.base_url)
    assert phase_of(execution.child_session_id) == Phase.WAITING_APPROVAL
    assert (execution.status, execution.delivery_status, execution.lease_owner) == ("RUNNING", "PENDING", None)
    # Not counted as work nobody picks up (status, metrics) before its request is overdue.
    assert execution.lease_expires_at == requests()[0].expires_at
    deliver_and_resume(sid, 1, deps.scheduler)  # a deliver_round (the scan's, an operator's): the barrier holds
    for _ in range(3):
        a_scan_after_every_lease_lapsed(deps)  # never dead work, never delivered
    assert not deps.scheduler.pending() and runs.starts == []
    (req,) = requests()
    assert (req.session_id, req.execution_id, req.agent_type) == (execution.child_session_id, execution.id, "reviewer")
    assert req.expires_at <= execution.started_at + timedelta(hours=1)  # never past the child's deadline
    assert approve(req.session_id, req.call_id, deps).resumed
    settle(deps)
    assert runs.starts == [("refund", execution.child_session_id, {"order": "C-9", "amount": 12})]
    (execution,) = executions_of(sid)
    assert (execution.status, execution.delivery_status) == ("COMPLETED", "DELIVERED")
    parent_tools = [json.loads(m.content or "") for m in messages_of(sid) if m.role == "TOOL"]
    assert [(t["success"], t["result"]) for t in parent_tools] == [(True, "child saw: refunded 12 on C-9")]
    assert messages_of(sid)[-1].content.startswith("final: ")
    assert invariants() == []


def test_a_child_past_its_deadline_while_waiting_is_delivered_as_a_timed_out_failure_and_its_request_expires(
    model_factory: ModelFactory, runs: Runs
) -> None:
    model = model_factory(child_script(call("refund", order="C-9", amount=12)))
    sid, execution, deps = child_parked(model.base_url)
    past = utcnow() - timedelta(hours=2)
    with transaction() as s:
        s.execute(update(SubagentExecution).values(started_at=past))
        s.execute(update(ApprovalRequest).values(expires_at=past + timedelta(hours=1)))
    a_scan_after_every_lease_lapsed(deps)
    settle(deps)
    assert runs.starts == []
    (execution,) = executions_of(sid)
    assert (execution.status, execution.delivery_status) == ("FAILED", "DELIVERED")
    assert "timed out" in (execution.error or "")
    assert requests()[0].status == ApprovalStatus.EXPIRED
    assert invariants() == []


def test_cancelling_the_parent_cancels_its_childs_pending_request(model_factory: ModelFactory, runs: Runs) -> None:
    model = model_factory(child_script(call("refund", order="C-9", amount=12)))
    sid, _execution, deps = child_parked(model.base_url)
    cancel_session(sid)
    (req,) = requests()
    assert (req.status, req.reason) == (ApprovalStatus.CANCELLED, "cancelled")
    assert approve(req.session_id, req.call_id, deps).outcome == DecisionOutcome.CONFLICT
    a_scan_after_every_lease_lapsed(deps)
    settle(deps)
    assert runs.starts == []


def test_a_parked_parent_can_be_cancelled_and_its_request_shows_cancelled(
    model_factory: ModelFactory, runs: Runs
) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=30)))
    sid, _deps = parked_parent(model.base_url)
    changed, _ = cancel_session(sid)
    assert changed and phase_of(sid) == Phase.CANCELLED
    assert requests()[0].status == ApprovalStatus.CANCELLED


def cli(*argv: str, env: dict[str, str]) -> Any:
    import os
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "cli.main", *argv],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_cli_lists_pending_approvals_and_decides_with_first_wins_and_a_non_zero_exit_on_conflict(
    model_factory: ModelFactory, runs: Runs, db: str, tmp_path: Any
) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=30)))
    sid, deps = parked_parent(model.base_url)
    # The CLI's own tools are tests.approval_tools' (``wire_money`` lives in this process only): its
    # agents file has no ``approve = ["wire_*"]``, a rule that would match none of its tools.
    agents = tmp_path / "agents_cli.toml"
    agents.write_text(AGENTS.replace('approve = ["wire_*"]\n', ""), encoding="utf-8")
    env = {"DATABASE_URL": db, "TOOL_MODULES": "tests.approval_tools", "AGENTS_FILE": str(agents)}
    listed = cli("approvals", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert {"session_id", "call_id", "tool", "agent_type", "requested_at", "expires_at"} <= set(row)
    assert (row["session_id"], row["tool"], row["agent_type"]) == (sid, "refund", "main")
    bad = cli("approve", str(sid), row["call_id"], "--arguments", '{"order": 1}', env=env)
    assert bad.returncode == 2 and "schema" in bad.stderr
    done = cli("approve", str(sid), row["call_id"], "--by", "carol", "--note", "checked", env=env)
    assert done.returncode == 0, done.stderr
    assert "approved by carol: checked" in done.stdout
    again = cli("approve", str(sid), row["call_id"], "--by", "carol", env=env)
    assert again.returncode == 0 and "nothing done" in again.stdout
    conflict = cli("deny", str(sid), row["call_id"], "--reason", "no", "--by", "dave", env=env)
    assert conflict.returncode == 1
    assert "refused: the decision that stands is approved by carol" in conflict.stderr
    assert json.loads(cli("approvals", "--json", env=env).stdout) == []
    shown = cli("session", "show", str(sid), env=env)
    assert "approval " + row["call_id"] + " refund: APPROVED by carol" in shown.stdout
    row_now = session_row(sid)
    assert (row_now.phase, row_now.lease_owner) == (Phase.RUNNING, None)  # handed to agent.run
    assert run_agent(sid, row_now.epoch, deps) == "waiting_user"
    assert len(runs.starts) == 1


def test_the_invariants_name_a_tool_run_or_a_result_without_an_approval(
    model_factory: ModelFactory, runs: Runs
) -> None:
    from harness.history import append_message
    from models import Role
    from models import journal as store

    model = model_factory(parent_script(call("refund", order="A-1", amount=30)))
    sid, _deps = parked_parent(model.base_url)
    assert invariants(settled=False) == []
    (req,) = requests()
    with transaction() as s:
        store.mark_finished(s, req.journal_id, req.call_id, "refunded", tool_name="refund", repeatable=False)
        append_message(s, sid, Role.TOOL, "refunded", tool_call_id=req.call_id)
    problems = [p[:2] for p in invariants(settled=False)]
    assert "A1" in problems and "A2" in problems


def test_a_reply_with_two_requests_resumes_only_once_both_are_decided(model_factory: ModelFactory, runs: Runs) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=30), call("wire_money", amount=5)))
    sid, deps = parked_parent(model.base_url)
    first, second = requests()
    assert not approve(sid, first.call_id, deps).resumed  # the other one still waits
    assert phase_of(sid) == Phase.WAITING_APPROVAL
    assert deny(sid, second.call_id, deps, "not today").resumed
    settle(deps)
    assert [r[0] for r in runs.starts] == ["refund"]
    assert [m.content for m in messages_of(sid) if m.role == "TOOL"] == [
        "refunded 30 on A-1",
        "denied by an approver: not today",
    ]
    assert invariants() == []


def test_status_reports_the_pending_approvals_and_the_oldest_ones_wait(model_factory: ModelFactory, runs: Runs) -> None:
    from recovery.ops import status_report

    assert status_report()["approvals_pending"] == 0
    model = model_factory(parent_script(call("refund", order="A-1", amount=30)))
    parked_parent(model.base_url)
    report = status_report()
    assert report["approvals_pending"] == 1 and report["oldest_pending_approval_age_seconds"] >= 0


def test_a_heartbeat_that_renews_a_child_right_after_it_parked_does_not_leave_it_counted_as_stuck(
    model_factory: ModelFactory, runs: Runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    import harness.approval
    from models.execution import fence_execution

    real = harness.approval.crash_point

    def heartbeat_lands_now(name: str) -> None:
        if name == "approval.after_park":
            with transaction() as s:
                e = s.execute(select(SubagentExecution)).scalar_one()
                assert fence_execution(s, e.id, epoch=e.epoch, lease_seconds=5)  # the in-flight renewal
        real(name)

    monkeypatch.setattr(harness.approval, "crash_point", heartbeat_lands_now)
    model = model_factory(child_script(call("refund", order="C-9", amount=12)))
    _sid, execution, _deps = child_parked(model.base_url)
    assert execution.lease_expires_at == requests()[0].expires_at


def gate_delegations(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, approve: str) -> None:
    """The main agent's ``approve`` list is ``approve`` (a glob list over the built-ins too)."""
    from harness.agents import _load

    agents = tmp_path / "agents_gated.toml"
    agents.write_text(AGENTS.replace('approve = ["wire_*"]', f"approve = {approve}"), encoding="utf-8")
    monkeypatch.setenv("AGENTS_FILE", str(agents))
    _load.cache_clear()


def subagent_sessions() -> list[int]:
    from models import SessionType

    with transaction() as s:
        return list(
            s.execute(select(AgentSession.id).where(AgentSession.session_type == SessionType.SUBAGENT)).scalars()
        )


@pytest.mark.parametrize("approve_list", ['["*"]', '["delegate"]'], ids=["star", "delegate"])
def test_a_delegation_that_needs_approval_waits_with_no_child_and_its_approval_creates_the_child_delivered_once(
    model_factory: ModelFactory, runs: Runs, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, approve_list: str
) -> None:
    gate_delegations(monkeypatch, tmp_path, approve_list)
    model = model_factory(
        parent_script(call("delegate", agent_type="reviewer", task="review it"), call("wire_money", amount=5))
    )
    sid, deps = parked_parent(model.base_url)
    # Parked before any child exists: no execution, no child session, nothing sent.
    assert executions_of(sid) == [] and subagent_sessions() == [] and not deps.scheduler.pending()
    assert runs.starts == []
    gated = {r.tool: r for r in requests()}
    assert set(gated) == ({"delegate", "wire_money"} if approve_list == '["*"]' else {"delegate"})
    assert json.loads(gated["delegate"].arguments) == {"agent_type": "reviewer", "task": "review it"}
    a_scan_after_every_lease_lapsed(deps)  # the scan neither resumes nor delivers it
    assert not deps.scheduler.pending() and executions_of(sid) == []
    for req in gated.values():
        approve(sid, req.call_id, deps)
    settle(deps)
    (execution,) = executions_of(sid)
    assert (execution.status, execution.delivery_status) == ("COMPLETED", "DELIVERED")
    assert len(subagent_sessions()) == 1
    assert runs.starts == [("wire_money", sid, {"amount": 5})]
    tools = [m for m in messages_of(sid) if m.role == "TOOL"]
    assert [t.tool_call_id for t in tools] == [gated["delegate"].call_id, tools[1].tool_call_id]
    assert json.loads(tools[0].content or "")["result"] == "child result" and tools[1].content == "wired 5"
    assert messages_of(sid)[-1].content.startswith("parent saw: ")
    a_scan_after_every_lease_lapsed(deps)
    settle(deps)
    assert len(executions_of(sid)) == 1 and len([m for m in messages_of(sid) if m.role == "TOOL"]) == 2
    assert len(runs.starts) == 1
    assert invariants() == []


def test_a_denied_delegation_creates_no_child_and_the_model_sees_the_denial_as_its_result(
    model_factory: ModelFactory, runs: Runs, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    gate_delegations(monkeypatch, tmp_path, '["delegate*"]')
    model = model_factory(
        parent_script(call("delegate", agent_type="reviewer", task="review it"), call("echo", text="hi"))
    )
    sid, deps = parked_parent(model.base_url)
    (req,) = requests()
    assert req.tool == "delegate"
    assert deny(sid, req.call_id, deps, "not this one").resumed
    settle(deps)
    assert executions_of(sid) == [] and subagent_sessions() == []
    assert [m.content for m in messages_of(sid) if m.role == "TOOL"] == ["denied by an approver: not this one", "hi"]
    assert messages_of(sid)[-1].content == "parent saw: denied by an approver: not this one\nhi"
    assert phase_of(sid) == Phase.WAITING_USER
    assert invariants() == []
