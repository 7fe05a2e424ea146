"""Approving without a person for the obvious (real PostgreSQL, scripted model over loopback
HTTP): a tool's ``requires_approval`` callable decides per call and its decision is journaled
with the reply; "this tool for the rest of this session"; several decisions at once; per-tool
approval timeouts; the approver's name reaches the model only with APPROVAL_NAME_TO_MODEL."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from crashpoints import InjectedKill, armed_fault
from harness.approval import DecisionResult, decide
from harness.parent import run_agent
from harness.tools import ToolContext, tool, unregister
from harness.views import create_session
from models import ApprovalStatus, Phase, transaction
from models.approval import ApprovalGrant, Decision, DecisionOutcome
from models.journal import RoundJournal
from tests.helpers import RecordingScheduler, invariants, loop_deps, messages_of, phase_of
from tests.integration.test_approvals import (
    MAIN,
    a_scan_after_every_lease_lapsed,
    call,
    deny,
    parent_script,
    requests,
    settle,
)
from tests.integration.test_console_api import console as console  # the fixture
from tests.types import ModelFactory

AGENTS = """
[agents.main]
system_prompt = "You are the main agent."
approve = ["wire_*"]
approval_timeout_seconds = { wire_money = 600 }
[agents.reviewer]
system_prompt = "You are the reviewer subagent."
"""


@dataclass
class Rule:
    """``refund``'s ``requires_approval`` callable: by default a person approves a refund above
    100; ``answers`` (when set) are what it says, in turn, whatever the amount; ``raises``: it
    raises (its message quotes the order, which no log line may carry)."""

    asked: list[dict[str, Any]] = field(default_factory=list)
    answers: list[bool] = field(default_factory=list)
    raises: bool = False

    def __call__(self, arguments: dict[str, Any]) -> bool:
        self.asked.append(arguments)
        if self.raises:
            raise ValueError(f"cannot judge order {arguments['order']}")
        if self.answers:
            return self.answers.pop(0)
        return bool(arguments["amount"] > 100)


@dataclass
class Tools:
    rule: Rule
    starts: list[tuple[str, int, dict[str, Any]]]

    def register_refund(self, *, with_rule: bool = True) -> None:
        unregister("refund")
        starts = self.starts

        @tool(requires_approval=self.rule if with_rule else False)
        def refund(ctx: ToolContext, order: str, amount: int) -> str:
            """Refund an order."""
            starts.append(("refund", ctx.session_id, {"order": order, "amount": amount}))
            return f"refunded {amount} on {order}"


@pytest.fixture
def tools(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Tools]:
    """``refund`` (its callable: ``Rule``), ``wire_money`` (the agent's ``approve`` glob, 600 s in
    the agents file), ``slow_refund`` (``@tool(requires_approval=True,
    approval_timeout_seconds=120)``)."""
    from harness.agents import _load
    from settings import get_settings

    agents = tmp_path / "agents.toml"
    agents.write_text(AGENTS, encoding="utf-8")
    monkeypatch.setenv("AGENTS_FILE", str(agents))
    get_settings.cache_clear()
    _load.cache_clear()
    out = Tools(Rule(), [])
    out.register_refund()

    @tool
    def wire_money(ctx: ToolContext, amount: int) -> str:
        """Wire money."""
        out.starts.append(("wire_money", ctx.session_id, {"amount": amount}))
        return f"wired {amount}"

    @tool(requires_approval=True, approval_timeout_seconds=120)
    def slow_refund(ctx: ToolContext, order: str) -> str:
        """Refund slowly."""
        out.starts.append(("slow_refund", ctx.session_id, {"order": order}))
        return f"slowly refunded {order}"

    yield out
    for name in ("refund", "wire_money", "slow_refund"):
        unregister(name)
    monkeypatch.undo()
    get_settings.cache_clear()
    _load.cache_clear()


def rounds_script(*rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The main agent calls ``rounds[i]`` at its turn i, then answers with what it saw."""
    rules = [
        {"when": {"system_contains": MAIN, "turn": n}, "reply": {"tool_calls": calls}} for n, calls in enumerate(rounds)
    ]
    return [
        *rules,
        {"when": {"system_contains": MAIN, "turn": len(rounds)}, "reply": {"content": "saw: {tool_results}"}},
    ]


def two_refunds() -> list[dict[str, Any]]:
    """The main agent asks for two refunds above 100 in one reply (both wait for a person)."""
    return parent_script(call("refund", order="A-1", amount=300), call("refund", order="A-2", amount=400))


def approve(
    sid: int, cid: str, deps: Any, *, by: str = "alice", arguments: Any = None, for_session: bool = False
) -> DecisionResult:
    return decide(sid, cid, Decision(True, by, "", arguments, for_session), deps.scheduler)


def journaled_rules(sid: int) -> dict[str, bool]:
    with transaction() as s:
        found = s.execute(select(RoundJournal.approval_rules).where(RoundJournal.session_id == sid)).scalars().all()
    return {k: v for rules in found for k, v in (rules or {}).items()}


def tool_results(sid: int) -> list[str]:
    return [m.content or "" for m in messages_of(sid) if m.role == "TOOL"]


# --- 1. requires_approval=callable ---------------------------------------------------------------


def test_a_callable_asks_a_person_only_for_a_refund_above_100_and_its_decisions_commit_with_the_reply(
    model_factory: ModelFactory, tools: Tools
) -> None:
    model = model_factory(
        parent_script(call("refund", order="A-1", amount=30), call("refund", order="A-2", amount=300))
    )
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "waiting_approval"
    assert tools.starts == [("refund", sid, {"order": "A-1", "amount": 30})]  # 30: no person asked
    (req,) = requests()
    assert (req.tool, json.loads(req.arguments)) == ("refund", {"order": "A-2", "amount": 300})
    assert sorted(journaled_rules(sid).values()) == [False, True]
    assert journaled_rules(sid)[req.call_id] is True
    assert [a["amount"] for a in tools.rule.asked] == [30, 300]  # once per call, though read twice
    assert approve(sid, req.call_id, deps).resumed
    settle(deps)
    assert [s[2]["amount"] for s in tools.starts] == [30, 300]
    assert tool_results(sid) == ["refunded 30 on A-1", "refunded 300 on A-2"]
    assert [a["amount"] for a in tools.rule.asked] == [30, 300]  # the resumed round read the journal
    assert invariants() == []


def test_a_callable_that_raises_asks_a_person_and_no_log_line_carries_the_arguments(
    model_factory: ModelFactory, tools: Tools, caplog: pytest.LogCaptureFixture
) -> None:
    tools.rule.raises = True
    model = model_factory(parent_script(call("refund", order="SECRET-ORDER-7", amount=5)))
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    with caplog.at_level(logging.DEBUG):
        assert run_agent(sid, 0, deps) == "waiting_approval"
    assert tools.starts == []  # fails closed: a 5 that the callable could not judge waits
    (req,) = requests()
    assert req.status == ApprovalStatus.PENDING
    failed = [r.getMessage() for r in caplog.records if "approval_rule_failed" in r.getMessage()]
    assert failed and "error=ValueError" in failed[0] and "tool=refund" in failed[0]
    assert not any("SECRET-ORDER-7" in r.getMessage() for r in caplog.records)


def test_a_continued_round_keeps_the_journaled_decision_though_the_callable_now_decides_otherwise(
    model_factory: ModelFactory, tools: Tools
) -> None:
    tools.rule.answers = [False, True, True]  # a callable whose answer changes (a limit moved)
    model = model_factory(parent_script(call("refund", order="A-1", amount=300)))
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    with armed_fault("journal.after_reply", kill=True), pytest.raises(InjectedKill):
        run_agent(sid, 0, deps)  # decided False, journaled with the reply; then the worker died
    assert list(journaled_rules(sid).values()) == [False]
    a_scan_after_every_lease_lapsed(deps)
    settle(deps)
    assert requests() == []  # the journaled "no person" stands: no request, no wait
    assert tools.starts == [("refund", sid, {"order": "A-1", "amount": 300})]
    assert len(tools.rule.asked) == 1  # never asked again
    assert invariants() == []


def test_a_round_journaled_before_its_tool_had_a_callable_asks_it_once_and_a_crash_after_keeps_that_decision(
    model_factory: ModelFactory, tools: Tools
) -> None:
    tools.register_refund(with_rule=False)
    model = model_factory(parent_script(call("refund", order="A-1", amount=300)))
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    with armed_fault("journal.after_reply", kill=True), pytest.raises(InjectedKill):
        run_agent(sid, 0, deps)
    assert journaled_rules(sid) == {} and requests() == []
    tools.register_refund()  # the deploy adds the callable
    tools.rule.answers = [True, False]
    a_scan_after_every_lease_lapsed(deps)
    with armed_fault("approval.after_rule", kill=True), pytest.raises(InjectedKill):
        settle(deps)  # asked now, its decision and the request committed, then the worker died
    assert list(journaled_rules(sid).values()) == [True]
    a_scan_after_every_lease_lapsed(deps)
    settle(deps)
    assert len(tools.rule.asked) == 1 and tools.starts == []  # the journaled True stands
    assert phase_of(sid) == Phase.WAITING_APPROVAL
    (req,) = requests()
    assert approve(sid, req.call_id, deps).resumed
    settle(deps)
    assert [s[0] for s in tools.starts] == ["refund"]
    assert invariants() == []


# --- 2. this tool for the rest of this session ----------------------------------------------------


def test_an_approval_for_the_session_lets_later_calls_of_that_tool_in_that_session_pass_recorded_as_the_grant(
    model_factory: ModelFactory, tools: Tools
) -> None:
    model = model_factory(
        rounds_script(
            [call("refund", order="A-1", amount=300)],
            [call("refund", order="A-2", amount=500), call("wire_money", amount=7)],
        )
    )
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    other = create_session("main", "go too")
    assert run_agent(sid, 0, deps) == "waiting_approval"
    (first,) = requests()
    result = approve(sid, first.call_id, deps, for_session=True)
    assert result.outcome == DecisionOutcome.DECIDED and result.granted == [first.call_id]
    assert "refund approved for the rest of session" in result.describe()
    settle(deps)
    # The second refund passed the gate (the grant); wire_money (another tool) waits.
    assert [s[2] for s in tools.starts] == [{"order": "A-1", "amount": 300}, {"order": "A-2", "amount": 500}]
    assert phase_of(sid) == Phase.WAITING_APPROVAL
    by_tool = {r.call_id: r for r in requests()}
    second = next(r for r in by_tool.values() if r.tool == "refund" and r.call_id != first.call_id)
    with transaction() as s:
        (grant,) = s.execute(select(ApprovalGrant)).scalars()
    assert (second.status, second.decided_by, second.grant_id) == (ApprovalStatus.APPROVED, "alice", grant.id)
    assert (grant.session_id, grant.tool, grant.granted_by) == (sid, "refund", "alice")
    wire = next(r for r in by_tool.values() if r.tool == "wire_money")
    assert wire.status == ApprovalStatus.PENDING
    assert deny(sid, wire.call_id, deps, "no wires").resumed
    settle(deps)
    assert phase_of(sid) == Phase.WAITING_USER
    # Another session of the same agent is not covered by the grant.
    model2 = model_factory(parent_script(call("refund", order="B-1", amount=900)))
    assert run_agent(other, 0, loop_deps(model2.base_url, RecordingScheduler())) == "waiting_approval"
    assert invariants() == []


def test_an_approval_for_the_session_approves_the_tools_other_pending_calls_beside_it(
    model_factory: ModelFactory, tools: Tools
) -> None:
    model = model_factory(
        parent_script(call("refund", order="A-1", amount=300), call("refund", order="A-2", amount=400))
    )
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "waiting_approval"
    first, second = requests()
    result = approve(sid, first.call_id, deps, for_session=True)
    assert result.granted == [first.call_id, second.call_id] and result.resumed
    settle(deps)
    assert [s[2]["amount"] for s in tools.starts] == [300, 400]
    assert invariants() == []


# --- 3. several decisions at once (the CLI) ------------------------------------------------------


def test_the_cli_decides_several_calls_or_all_of_a_session_each_its_own_compare_and_set(
    model_factory: ModelFactory, tools: Tools, capsys: pytest.CaptureFixture[str]
) -> None:
    from cli.approval import EXIT_CONFLICT, EXIT_NOT_FOUND
    from cli.main import main

    model = model_factory(
        parent_script(
            call("refund", order="A-1", amount=300),
            call("refund", order="A-2", amount=400),
            call("wire_money", amount=1),
        )
    )
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "waiting_approval"
    a, b, c = requests()
    assert deny(sid, b.call_id, deps, "not that one").outcome == DecisionOutcome.DECIDED
    capsys.readouterr()
    code = main(["approve", str(sid), a.call_id, b.call_id, "nope", "--by", "carol"])
    out, err = capsys.readouterr()
    assert code == EXIT_CONFLICT  # the first call that did not land: b (denied already)
    assert f"call {a.call_id}: approved by carol" in out
    assert f"call {b.call_id}: refused: the decision that stands is denied by bob" in err
    assert "call nope: no such approval request" in err
    assert [r.status for r in requests()] == [ApprovalStatus.APPROVED, ApprovalStatus.DENIED, ApprovalStatus.PENDING]
    assert main(["deny", str(sid), "--all", "--reason", "enough", "--by", "carol"]) == 0
    out, _ = capsys.readouterr()
    assert (
        out.strip() == f"call {c.call_id}: denied by carol: enough (session {sid}, call {c.call_id}, tool wire_money)"
    )
    assert main(["approve", str(sid), "--all"]) == 0
    assert "no pending approvals" in capsys.readouterr().out
    assert main(["approve", str(sid), a.call_id, "--all"]) == 2  # names and --all: bad arguments
    assert main(["approve", str(sid), "--all", "--arguments", "{}"]) == 2  # edited arguments: one call only
    assert main(["approve", str(sid), "nope"]) == EXIT_NOT_FOUND
    a_scan_after_every_lease_lapsed(deps)  # the CLI sent the loop to the broker; the scan takes it here
    settle(deps)
    assert tool_results(sid) == [
        "refunded 300 on A-1",
        "denied by an approver: not that one",
        "denied by an approver: enough",
    ]


def test_approve_for_session_from_the_cli_grants_the_tool(
    model_factory: ModelFactory, tools: Tools, capsys: pytest.CaptureFixture[str]
) -> None:
    from cli.main import main

    model = model_factory(parent_script(call("refund", order="A-1", amount=300)))
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "waiting_approval"
    (req,) = requests()
    assert main(["approve", str(sid), req.call_id, "--for-session", "--by", "dan"]) == 0
    assert "refund approved for the rest of session" in capsys.readouterr().out
    with transaction() as s:
        assert [(g.tool, g.granted_by) for g in s.execute(select(ApprovalGrant)).scalars()] == [("refund", "dan")]


# --- 4. per-tool approval timeouts ----------------------------------------------------------------


def test_the_agents_file_entry_and_the_tools_timeout_override_the_global_default(
    model_factory: ModelFactory, tools: Tools
) -> None:
    model = model_factory(
        parent_script(
            call("refund", order="A-1", amount=300), call("wire_money", amount=5), call("slow_refund", order="A-3")
        )
    )
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "waiting_approval"
    waits = {r.tool: r.expires_at - r.requested_at for r in requests()}
    assert waits == {
        "refund": timedelta(seconds=86400),  # APPROVAL_TIMEOUT_SECONDS
        "wire_money": timedelta(seconds=600),  # approval_timeout_seconds = { wire_money = 600 }
        "slow_refund": timedelta(seconds=120),  # @tool(approval_timeout_seconds=120)
    }


# --- 6. the approver's name and the model ---------------------------------------------------------


@pytest.mark.parametrize("named", [False, True])
def test_the_approvers_name_reaches_the_model_only_with_approval_name_to_model(
    model_factory: ModelFactory, tools: Tools, monkeypatch: pytest.MonkeyPatch, named: bool
) -> None:
    from settings import get_settings

    if named:
        monkeypatch.setenv("APPROVAL_NAME_TO_MODEL", "true")
    get_settings.cache_clear()
    model = model_factory(
        parent_script(call("refund", order="A-1", amount=300), call("refund", order="A-2", amount=400))
    )
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "waiting_approval"
    first, second = requests()
    approve(sid, first.call_id, deps, by="Alice Smith", arguments={"order": "A-1", "amount": 150})
    deny(sid, second.call_id, deps, "too much", by="Bob Jones")
    settle(deps)
    sent = messages_of(sid)[-1].content or ""  # "parent saw: {tool_results}": what the model received
    edited, denied = tool_results(sid)
    if named:
        assert edited.startswith("note: Alice Smith edited the arguments")
        assert denied == "denied by Bob Jones: too much"
    else:
        assert edited.startswith("note: an approver edited the arguments")
        assert denied == "denied by an approver: too much"
        assert "Alice Smith" not in sent and "Bob Jones" not in sent
    assert ("Bob Jones" in sent) is named
    assert invariants() == []
    os.environ.pop("APPROVAL_NAME_TO_MODEL", None)
    get_settings.cache_clear()


# --- 2 and 3 in the console ---------------------------------------------------------------------


def test_the_console_decides_the_selected_requests_each_on_its_own_and_approves_for_a_session(
    model_factory: ModelFactory, tools: Tools, console: Any
) -> None:
    from tests.integration.test_console_api import client

    model = model_factory(parent_script(call("refund", order="A-1", amount=300), call("wire_money", amount=5)))
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "waiting_approval"
    refund, wire = requests()
    base = console()
    http = client(base, operator="erin")
    page = http.get(f"{base}/approvals", timeout=10).text
    assert f'name="ids" value="{refund.id}" form="batch-decision"' in page and "Approve for this session" in page
    assert http.post(f"{base}/api/approvals/decide", json={"ids": [refund.id], "decision": "deny"}).status_code == 400
    assert http.post(f"{base}/api/approvals/decide", json={"ids": ["one"], "decision": "approve"}).status_code == 400
    done = http.post(
        f"{base}/api/approvals/decide",
        json={"ids": [refund.id, wire.id, 99999], "decision": "approve", "for_session": True},
        timeout=10,
    )
    assert done.status_code == 200
    assert done.json() == {
        "outcome": "partly_decided",
        "results": [
            {"id": refund.id, "outcome": "approved", "status": 200},
            {"id": wire.id, "outcome": "approved", "status": 200},
            {"id": 99999, "outcome": "not_found", "status": 404},
        ],
    }
    again = http.post(
        f"{base}/api/approvals/decide", json={"ids": [refund.id], "decision": "deny", "reason": "no"}, timeout=10
    )
    assert again.status_code == 409 and again.json()["results"][0]["outcome"] == "conflict"
    assert [(r.status, r.decided_by) for r in requests()] == [(ApprovalStatus.APPROVED, "console:erin")] * 2
    with transaction() as s:
        grants = sorted((g.tool, g.granted_by) for g in s.execute(select(ApprovalGrant)).scalars())
    assert grants == [("refund", "console:erin"), ("wire_money", "console:erin")]


def test_the_approvals_page_form_decides_the_checked_requests_and_shows_each_outcome(
    model_factory: ModelFactory, tools: Tools, console: Any
) -> None:
    from tests.integration.test_console_api import client

    model = model_factory(
        parent_script(call("refund", order="A-1", amount=300), call("refund", order="A-2", amount=400))
    )
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "waiting_approval"
    first, second = requests()
    base = console()
    http = client(base, operator="erin")
    form = {"csrf": http.headers["X-CSRF-Token"], "ids": [str(first.id), str(second.id)], "decision": "deny"}
    back = http.post(f"{base}/approvals/decide", data={**form, "reason": "not today"}, timeout=10)
    assert back.status_code == 200 and 'id="batch-results"' in back.text  # followed the redirect to the page
    assert back.text.count("<code>denied</code>") == 2
    assert [r.status for r in requests()] == [ApprovalStatus.DENIED] * 2
    single = http.post(f"{base}/api/approvals/{first.id}/approve", json={"for_session": True}, timeout=10)
    assert single.status_code == 409  # denied already: a grant needs an approval that stands


def test_agent_approve_takes_for_session_and_answers_which_calls_the_grant_approved(
    model_factory: ModelFactory, tools: Tools
) -> None:
    from tasks.approval import approve_task

    model = model_factory(
        parent_script(call("refund", order="A-1", amount=300), call("refund", order="A-2", amount=400))
    )
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url, RecordingScheduler())) == "waiting_approval"
    first, second = requests()
    answer = approve_task.apply(args=[sid, first.call_id], kwargs={"by": "ops", "for_session": True}).get()
    assert answer["outcome"] == "decided" and answer["granted"] == [first.call_id, second.call_id]
    assert answer["resumed"] is True
    assert [(r.status, r.decided_by) for r in requests()] == [(ApprovalStatus.APPROVED, "ops")] * 2


def test_a_delegating_round_waits_only_when_the_callable_asks_for_a_person(
    model_factory: ModelFactory, tools: Tools
) -> None:
    small = model_factory(
        parent_script(call("delegate", agent_type="reviewer", task="t"), call("refund", order="A-1", amount=30))
    )
    deps = loop_deps(small.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) != "waiting_approval"  # the children run: nobody asked
    settle(deps)
    assert requests() == [] and tools.starts == [("refund", sid, {"order": "A-1", "amount": 30})]
    large = model_factory(
        parent_script(call("delegate", agent_type="reviewer", task="t"), call("refund", order="A-2", amount=300))
    )
    deps = loop_deps(large.base_url, RecordingScheduler())
    other = create_session("main", "go")
    assert run_agent(other, 0, deps) == "waiting_approval"  # before any child exists
    (req,) = requests()
    assert approve(other, req.call_id, deps).resumed
    settle(deps)
    assert [s[2]["amount"] for s in tools.starts] == [30, 300]
    assert phase_of(other) == Phase.WAITING_USER
    assert invariants() == []
