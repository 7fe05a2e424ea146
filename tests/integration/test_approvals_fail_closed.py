"""Approvals that never fail open (real PostgreSQL, scripted model over loopback HTTP): a
cancelled child that waits for a decision is delivered as cancelled and never resumed; the need
for a decision is decided again from the configuration in force when a call is about to run;
an approval with edited arguments is the call the model, the history and the journal see."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from crashpoints import InjectedKill, armed_fault
from harness.agents import get_agent
from harness.approval import edited_result, needs_approval
from harness.cancel import cancel_session
from harness.journal import interrupted_result
from harness.loop import model_messages
from harness.model import ToolCall
from harness.parent import run_agent
from harness.views import create_session
from models import AgentSession, ApprovalRequest, ApprovalStatus, Phase, transaction
from models.approval import DecisionOutcome
from recovery.scan import scan
from tests.helpers import RecordingScheduler, executions_of, invariants, loop_deps, messages_of, phase_of
from tests.integration.test_approvals import (  # noqa: F401 (the fixture ``runs``)
    AGENTS,
    Runs,
    a_scan_after_every_lease_lapsed,
    approve,
    call,
    child_parked,
    child_script,
    parent_script,
    parked_parent,
    requests,
    runs,
    settle,
)
from tests.types import ModelFactory

# --- a cancelled child that waits for a decision ------------------------------------------


def parent_tool_results(sid: int) -> list[dict[str, Any]]:
    return [json.loads(m.content or "") for m in messages_of(sid) if m.role == "TOOL"]


#: The rules of ``child_script`` that answer the subagent (its turn 0 and its turn 1).
SUBAGENT_RULES = (2, 3)


def subagent_asks(model: Any) -> int:
    """How many times the model was asked on behalf of the subagent."""
    return sum(1 for entry in model.journal() if entry["rule"] in SUBAGENT_RULES)


def test_cancelling_a_child_waiting_for_approval_cancels_its_request_and_the_next_scan_delivers_it_as_cancelled(
    model_factory: ModelFactory,
    runs: Runs,  # noqa: F811
) -> None:
    model = model_factory(child_script(call("refund", order="C-9", amount=12)))
    sid, execution, deps = child_parked(model.base_url)
    asked = subagent_asks(model)
    assert asked == 1
    changed, _ = cancel_session(execution.child_session_id)
    assert changed
    (req,) = requests()
    assert (req.status, req.reason) == (ApprovalStatus.CANCELLED, "cancelled")
    # The very next pass acts on it: no lease or request expiry needs to lapse first.
    scan(deps.scheduler, callback_grace_seconds=0)
    settle(deps)
    (execution,) = executions_of(sid)
    assert (execution.status, execution.delivery_status) == ("CANCELLED", "DELIVERED")
    ((result,),) = [parent_tool_results(sid)]
    assert (result["success"], result["cancelled"]) == (False, True)
    assert messages_of(sid)[-1].content.startswith("final: ")  # the parent's round completed
    assert phase_of(execution.child_session_id) == Phase.CANCELLED
    assert subagent_asks(model) == asked and runs.starts == []  # never resumed
    a_scan_after_every_lease_lapsed(deps)
    settle(deps)
    assert subagent_asks(model) == asked and runs.starts == []
    assert invariants() == []


def test_a_cancelled_child_whose_request_lapses_before_its_deadline_is_never_resumed(
    model_factory: ModelFactory,
    runs: Runs,  # noqa: F811
) -> None:
    """As an earlier release left it: the child cancelled while parked, its execution still
    parked until the request's expiry, which lapses before the child's deadline."""
    model = model_factory(child_script(call("refund", order="C-9", amount=12)))
    sid, execution, deps = child_parked(model.base_url)
    asked = subagent_asks(model)
    with transaction() as s:
        s.execute(
            update(AgentSession).where(AgentSession.id == execution.child_session_id).values(phase=Phase.CANCELLED)
        )
    a_scan_after_every_lease_lapsed(deps)  # the request and the parked lease both lapsed
    settle(deps)
    (execution,) = executions_of(sid)
    assert (execution.status, execution.delivery_status) == ("CANCELLED", "DELIVERED")
    ((result,),) = [parent_tool_results(sid)]
    assert (result["success"], result["cancelled"]) == (False, True)
    assert subagent_asks(model) == asked and runs.starts == []
    assert invariants() == []


def test_the_scan_delivers_a_cancelled_child_still_parked_until_its_request_expires(
    model_factory: ModelFactory,
    runs: Runs,  # noqa: F811
) -> None:
    """The backstop: a parked child cancelled by an earlier release keeps its lease end at the
    request's expiry (an hour away); the next pass frees it and the child is delivered as
    cancelled without anything lapsing first."""
    model = model_factory(child_script(call("refund", order="C-9", amount=12)))
    sid, execution, deps = child_parked(model.base_url)
    with transaction() as s:
        s.execute(
            update(AgentSession).where(AgentSession.id == execution.child_session_id).values(phase=Phase.CANCELLED)
        )
    scan(deps.scheduler, callback_grace_seconds=0)
    settle(deps)
    (execution,) = executions_of(sid)
    assert (execution.status, execution.delivery_status) == ("CANCELLED", "DELIVERED")
    assert runs.starts == []


# --- the need for a decision is decided when the call is about to run ----------------------

NO_APPROVAL = """
[agents.main]
system_prompt = "You are the main agent."
[agents.reviewer]
system_prompt = "You are the reviewer subagent."
"""


def configure(agents_toml: str) -> None:
    """The configuration a worker deployed now reads (AGENTS_FILE rewritten)."""
    from harness.agents import _load

    Path(os.environ["AGENTS_FILE"]).write_text(agents_toml, encoding="utf-8")
    _load.cache_clear()


def test_a_round_journaled_before_its_tool_needed_approval_waits_for_one_under_the_new_configuration(
    model_factory: ModelFactory,
    runs: Runs,  # noqa: F811
) -> None:
    configure(NO_APPROVAL)
    model = model_factory(parent_script(call("wire_money", amount=500), call("echo", text="hi")))
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    with armed_fault("journal.after_reply", kill=True), pytest.raises(InjectedKill):
        run_agent(sid, 0, deps)  # the reply is journaled; nothing needed approval then
    assert requests() == []
    configure(AGENTS)  # the deploy: the main agent's approve = ["wire_*"] now covers wire_money
    a_scan_after_every_lease_lapsed(deps)
    settle(deps)
    assert runs.starts == []  # never run without a decision
    assert phase_of(sid) == Phase.WAITING_APPROVAL
    (req,) = requests()
    assert (req.tool, req.status, json.loads(req.arguments)) == ("wire_money", ApprovalStatus.PENDING, {"amount": 500})
    assert approve(sid, req.call_id, deps).resumed
    settle(deps)
    assert runs.starts == [("wire_money", sid, {"amount": 500})]
    assert [m.content for m in messages_of(sid) if m.role == "TOOL"] == ["wired 500", "hi"]
    assert invariants() == []


def test_an_mcp_tool_whose_server_cannot_be_listed_needs_approval_under_approve_destructive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import harness.tools.mcp
    from harness.agents import parse_agents

    monkeypatch.setattr(harness.tools.mcp, "lookup_mcp_tool", lambda name: None)  # the listing fails now
    text = '[agents.a]\nsystem_prompt = "p"\napprove_destructive = true\nmcp_servers = [{name = "files", url = "%s"}]\n'
    agent = parse_agents(text % "http://127.0.0.1:9/mcp")["a"]
    assert needs_approval(agent, "files__delete")


# --- an approval with edited arguments ----------------------------------------------------


def assistant_calls(sid: int) -> list[dict[str, Any]]:
    (assistant,) = [m for m in messages_of(sid) if m.role == "ASSISTANT" and m.tool_calls]
    calls = assistant.tool_calls if isinstance(assistant.tool_calls, list) else json.loads(assistant.tool_calls)
    return [{"name": c["function"]["name"], **json.loads(c["function"]["arguments"])} for c in calls]


def test_an_approval_with_edited_arguments_is_the_call_the_model_sees_and_its_result_says_so(
    model_factory: ModelFactory,
    runs: Runs,  # noqa: F811
) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=300)))
    sid, deps = parked_parent(model.base_url)
    (req,) = requests()
    assert approve(sid, req.call_id, deps, arguments={"amount": 25, "order": "A-1"}).outcome == DecisionOutcome.DECIDED
    settle(deps)
    assert runs.starts == [("refund", sid, {"order": "A-1", "amount": 25})]
    assert assistant_calls(sid) == [{"name": "refund", "order": "A-1", "amount": 25}]
    (tool_row,) = [m for m in messages_of(sid) if m.role == "TOOL"]
    assert tool_row.content == edited_result("alice", "refunded 25 on A-1")
    assert "edited" in tool_row.content and "alice" not in tool_row.content  # APPROVAL_NAME_TO_MODEL is off
    # What the model is shown of the round: the approved call, not the one it sent.
    view = json.dumps(model_messages(sid, get_agent("main")))
    assert '\\"amount\\":25' in view and "300" not in view
    assert invariants() == []


def test_after_a_crash_in_an_edited_call_the_interrupted_result_quotes_the_approved_arguments(
    model_factory: ModelFactory,
    runs: Runs,  # noqa: F811
) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=300)))
    sid, deps = parked_parent(model.base_url)
    (req,) = requests()
    approve(sid, req.call_id, deps, arguments='{"order": "A-1", "amount": 25}')
    ((resumed, epoch),) = deps.scheduler.resumed
    deps.scheduler.resumed.clear()
    with armed_fault("journal.after_tool_start", kill=True), pytest.raises(InjectedKill):
        run_agent(resumed, epoch, deps)
    a_scan_after_every_lease_lapsed(deps)
    settle(deps)
    assert runs.starts == []  # killed after its start was committed, before it ran
    assert assistant_calls(sid) == [{"name": "refund", "order": "A-1", "amount": 25}]
    (tool_row,) = [m for m in messages_of(sid) if m.role == "TOOL"]
    edited = ToolCall(req.call_id, "refund", '{"amount":25,"order":"A-1"}')
    assert tool_row.content == edited_result("alice", interrupted_result(edited))
    assert "300" not in tool_row.content
    assert invariants() == []


def test_approved_arguments_that_only_reorder_the_keys_are_not_an_edit_and_a_repeat_is_a_no_op(
    model_factory: ModelFactory,
    runs: Runs,  # noqa: F811
) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=300)))
    sid, deps = parked_parent(model.base_url)
    (req,) = requests()
    assert approve(sid, req.call_id, deps, arguments='{"amount": 300, "order": "A-1"}').resumed
    again = approve(sid, req.call_id, deps, arguments={"order": "A-1", "amount": 300})
    assert again.outcome == DecisionOutcome.REPEATED
    settle(deps)
    assert runs.starts == [("refund", sid, {"order": "A-1", "amount": 300})]
    (tool_row,) = [m for m in messages_of(sid) if m.role == "TOOL"]
    assert tool_row.content == "refunded 300 on A-1"  # no note: nothing was edited
    with transaction() as s:
        (stored,) = s.execute(select(ApprovalRequest.approved_arguments)).scalars()
    assert stored is None
    assert invariants() == []


def test_a_crash_right_after_the_edited_call_is_journaled_runs_it_once_with_the_approved_arguments(
    model_factory: ModelFactory,
    runs: Runs,  # noqa: F811
) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=300)))
    sid, deps = parked_parent(model.base_url)
    (req,) = requests()
    approve(sid, req.call_id, deps, arguments={"order": "A-1", "amount": 25})
    ((resumed, epoch),) = deps.scheduler.resumed
    deps.scheduler.resumed.clear()
    with armed_fault("approval.after_edited_call", kill=True), pytest.raises(InjectedKill):
        run_agent(resumed, epoch, deps)
    assert runs.starts == []
    a_scan_after_every_lease_lapsed(deps)
    settle(deps)
    assert runs.starts == [("refund", sid, {"order": "A-1", "amount": 25})]
    (tool_row,) = [m for m in messages_of(sid) if m.role == "TOOL"]
    assert tool_row.content == edited_result("alice", "refunded 25 on A-1")
    assert invariants() == []


def test_the_invariants_name_a_history_that_shows_the_unapproved_arguments_or_hides_the_edit(
    model_factory: ModelFactory,
    runs: Runs,  # noqa: F811
) -> None:
    from models import Message

    model = model_factory(parent_script(call("refund", order="A-1", amount=300)))
    sid, deps = parked_parent(model.base_url)
    (req,) = requests()
    approve(sid, req.call_id, deps, arguments={"order": "A-1", "amount": 25})
    settle(deps)
    assert invariants() == []
    # Broken on purpose: the history's call back to the model's arguments, the note dropped.
    with transaction() as s:
        rows = s.execute(select(Message).where(Message.session_id == sid)).scalars()
        (assistant,) = [m for m in rows if m.tool_calls]
        assistant.tool_calls = assistant.tool_calls.replace('\\"amount\\":25', '\\"amount\\":300')
        tool_row = update(Message).where(Message.session_id == sid, Message.role == "TOOL")
        s.execute(tool_row.values(content="refunded 25 on A-1"))
    problems = invariants()
    assert any("shows arguments the approver did not approve" in p for p in problems), problems
    assert any("does not say so" in p for p in problems), problems


def test_a_child_cancelled_before_its_first_run_is_ended_cancelled_without_asking_the_model(
    model_factory: ModelFactory,
    runs: Runs,  # noqa: F811
) -> None:
    from harness.child import start_child

    model = model_factory(child_script(call("refund", order="C-9", amount=12)))
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    _, _, ((eid, epoch),) = deps.scheduler.children.pop()
    (execution,) = executions_of(sid)
    assert cancel_session(execution.child_session_id)[0]
    assert start_child(eid, epoch, deps) == "cancelled"  # its message arrives after the cancel
    settle(deps)
    (execution,) = executions_of(sid)
    assert (execution.status, execution.delivery_status) == ("CANCELLED", "DELIVERED")
    assert subagent_asks(model) == 0 and runs.starts == [] and requests() == []
    assert invariants() == []
