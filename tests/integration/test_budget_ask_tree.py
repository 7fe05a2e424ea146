"""``on_budget_exhausted = "ask"`` down the tree and for every kind (docs/usage.md, "When the
budget runs out: ask"): a child whose reservation is refused parks on a budget request while
its parent's round waits for it; the request names the kinds that ran out, and an approval
raises those. Real PostgreSQL, the scripted model over HTTP reporting known usage, the loops
in-process with a recording scheduler."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from harness.approval import DecisionRefused, decide
from harness.child import start_child
from harness.delivery import deliver_and_resume
from harness.parent import run_agent
from harness.views import create_session
from models import AgentSession, Message, Role, transaction
from models.approval import ApprovalRequest, ApprovalStatus, Decision
from models.base import utcnow
from models.budget import TreeBudget
from recovery.scan import scan
from tests.helpers import (
    RecordingScheduler,
    executions_of,
    expire_leases,
    infra_fault_at,
    invariants,
    loop_deps,
    phase_of,
    run_one_scheduled,
)
from tests.types import ModelFactory

pytestmark = pytest.mark.usefixtures("db", "redis_url")

USAGE = {"prompt_tokens": 1000, "completion_tokens": 200}
PER_CALL = 1200
AGENTS = """
[agents.main]
system_prompt = "You are the main agent."
tools = ["delegate", "delegate_followup", "echo"]
max_rounds = 20
max_tokens = 1000
{main_asks}
[agents.reviewer]
system_prompt = "You are the reviewer subagent."
tools = ["echo"]
max_rounds = 20
max_tokens = 1000
on_budget_exhausted = "ask"
"""
#: The parent delegates once and answers with its child's result; the child says something
#: beside each of two tool rounds, then answers.
SCRIPT: list[dict[str, Any]] = [
    {
        "when": {"system_contains": "main agent", "turn": 0},
        "reply": {
            "tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "look"}}],
            "usage": USAGE,
        },
    },
    {
        "when": {"system_contains": "main agent", "turn": 1},
        "reply": {"content": "final: {tool_results}", "usage": USAGE},
    },
    {
        "when": {"system_contains": "subagent", "turn": 0},
        "reply": {
            "message_fields": {"content": "looking"},
            "tool_calls": [{"name": "echo", "arguments": {"text": "a"}}],
            "usage": USAGE,
        },
    },
    {
        "when": {"system_contains": "subagent", "turn": 1},
        "reply": {
            "message_fields": {"content": "still looking"},
            "tool_calls": [{"name": "echo", "arguments": {"text": "b"}}],
            "usage": USAGE,
        },
    },
    {"when": {"system_contains": "subagent", "turn": 2}, "reply": {"content": "seen", "usage": USAGE}},
]
#: Three calls fit (the parent's and the child's first two, each reserving about 1010 and
#: spending 1200); the child's third is refused.
BUDGET = 3500


def _agents(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, main_asks: bool) -> Iterator[None]:
    from harness.agents import _load
    from settings import get_settings

    path = tmp_path / "agents.toml"
    path.write_text(AGENTS.format(main_asks='on_budget_exhausted = "ask"' if main_asks else ""), encoding="utf-8")
    monkeypatch.setenv("AGENTS_FILE", str(path))
    get_settings.cache_clear()
    _load.cache_clear()
    yield
    monkeypatch.undo()
    get_settings.cache_clear()
    _load.cache_clear()


@pytest.fixture
def asking_child(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """The reviewer asks when its tree's budget runs out; the main agent stops."""
    yield from _agents(monkeypatch, tmp_path, main_asks=False)


@pytest.fixture
def asking_main(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    yield from _agents(monkeypatch, tmp_path, main_asks=True)


def _settle(deps: Any, *, max_steps: int = 30) -> None:
    """Run what the scheduler holds until nothing is left (no scan, no lease expiry)."""
    sched: RecordingScheduler = deps.scheduler
    for _ in range(max_steps):
        if not sched.pending():
            return
        run_one_scheduled(deps)
    raise AssertionError("did not settle")


def _requests(sid: int) -> list[ApprovalRequest]:
    with transaction() as s:
        rows = s.execute(select(ApprovalRequest).where(ApprovalRequest.session_id == sid).order_by(ApprovalRequest.id))
        return list(rows.scalars())


def _budget(root: int) -> TreeBudget:
    with transaction() as s:
        row = s.get(TreeBudget, root)
        assert row is not None
        s.expunge(row)
        return row


def _tool_results(sid: int) -> list[tuple[str | None, dict[str, Any]]]:
    with transaction() as s:
        rows = s.execute(
            select(Message.tool_call_id, Message.content)
            .where(Message.session_id == sid, Message.role == Role.TOOL)
            .order_by(Message.id)
        ).all()
    return [(cid, json.loads(content or "{}")) for cid, content in rows]


def _child_parked_on_its_budget(model_url: str) -> tuple[int, int, Any]:
    """A parent that delegated once, whose child's third call was refused: the child asked, and
    the worker died right after (``budget.after_ask``). Returns (parent, child session, deps)."""
    import harness.budget_request

    deps = loop_deps(model_url, RecordingScheduler())
    sid = create_session("main", "go", budget_tokens=BUDGET)
    assert run_agent(sid, 0, deps) == "yielded"
    _, _, children = deps.scheduler.children.pop()
    ((eid, e),) = children
    with infra_fault_at(harness.budget_request, "budget.after_ask"):
        assert start_child(eid, e, deps) == "infra_error"
    (execution,) = executions_of(sid)
    return sid, execution.child_session_id, deps


def _the_parent_keeps_waiting(sid: int, child: int, deps: Any) -> ApprovalRequest:
    """The child is parked (not ended, its execution unowned), the parent's round is not
    delivered by a delivery or a scan, and the child's one budget request is pending."""
    (execution,) = executions_of(sid)
    assert phase_of(child) == "WAITING_APPROVAL"
    assert (execution.status, execution.delivery_status, execution.lease_owner) == ("RUNNING", "PENDING", None)
    (req,) = _requests(child)
    assert (req.tool, req.status, req.execution_id, req.agent_type) == (
        "budget.raise",
        ApprovalStatus.PENDING,
        execution.id,
        "reviewer",
    )
    assert req.call_id == f"budget-{execution.id}-{execution.epoch}" and req.journal_id is None
    assert req.expires_at <= execution.started_at + timedelta(hours=1)  # never past the child's deadline
    deliver_and_resume(sid, 1, deps.scheduler)  # a deliver_round (the scan's, an operator's): the barrier holds
    for _ in range(2):
        expire_leases()
        scan(deps.scheduler, callback_grace_seconds=0)  # never dead work, never delivered
    assert not deps.scheduler.pending()
    assert _tool_results(sid) == [] and phase_of(child) == "WAITING_APPROVAL"
    return req


@pytest.mark.usefixtures("asking_child")
def test_a_child_out_of_budget_asks_its_parent_waits_and_an_approval_lets_it_answer_delivered_once(
    model_factory: ModelFactory,
) -> None:
    model = model_factory(SCRIPT)
    sid, child, deps = _child_parked_on_its_budget(model.base_url)
    assert len(model.journal()) == 3  # the refused call asked no model
    req = _the_parent_keeps_waiting(sid, child, deps)
    asked = json.loads(req.arguments)
    books = _budget(sid)
    assert list(asked) == ["tokens"] and asked["tokens"] >= books.spent_tokens - BUDGET  # what it lacks
    # The approver names the amount: the tree is raised in the decision's transaction and the
    # child handed back to recovery (a new epoch of its execution).
    result = decide(child, req.call_id, Decision(True, "ada", "", '{"tokens": 5000}'), deps.scheduler)
    assert result.resumed and deps.scheduler.recoveries
    assert _budget(sid).budget_tokens == BUDGET + 5000
    _settle(deps)
    assert len(model.journal()) == 5  # the child's answer, then the parent's
    (execution,) = executions_of(sid)
    assert (execution.status, execution.delivery_status) == ("COMPLETED", "DELIVERED")
    ((call_id, result_json),) = _tool_results(sid)  # delivered exactly once
    assert call_id == execution.parent_tool_call_id and result_json["success"] and result_json["result"] == "seen"
    assert phase_of(sid) == "WAITING_USER"
    assert [r.status for r in _requests(child)] == [ApprovalStatus.APPROVED]
    books = _budget(sid)
    assert (books.spent_tokens, books.reserved_tokens) == (5 * PER_CALL, 0)
    assert invariants() == []


@pytest.mark.parametrize("how", ["denied", "expired"])
@pytest.mark.usefixtures("asking_child")
def test_a_child_whose_raise_is_not_approved_fails_budget_exhausted_with_its_partial_answer_delivered_once(
    model_factory: ModelFactory, how: str
) -> None:
    model = model_factory(SCRIPT)
    sid, child, deps = _child_parked_on_its_budget(model.base_url)
    req = _the_parent_keeps_waiting(sid, child, deps)
    if how == "denied":
        assert decide(child, req.call_id, Decision(False, "ada", "enough"), deps.scheduler).resumed
    else:
        with transaction() as s:
            s.execute(update(ApprovalRequest).values(expires_at=utcnow() - timedelta(seconds=1)))
        scan(deps.scheduler, callback_grace_seconds=0)  # the backstop expires it and hands the child back
        assert deps.scheduler.recoveries
    _settle(deps)
    assert len(model.journal()) == 3  # not approved: no model call more
    decided = ApprovalStatus.DENIED if how == "denied" else ApprovalStatus.EXPIRED
    assert [r.status for r in _requests(child)] == [decided]
    (execution,) = executions_of(sid)
    assert (execution.status, execution.delivery_status) == ("FAILED", "DELIVERED")
    with transaction() as s:
        row = s.get(AgentSession, child)
        assert row is not None and row.failure_code == "budget_exhausted"
    ((call_id, result_json),) = _tool_results(sid)  # delivered exactly once, as any failure
    assert call_id == execution.parent_tool_call_id and not result_json["success"]
    assert result_json["partial_result"] == "still looking"
    assert "a raise was not approved" in result_json["error"]
    # The parent ran again with the failed result; its own call does not fit either: it stops.
    assert phase_of(sid) == "FAILED"
    assert invariants() == []


@pytest.mark.usefixtures("asking_main")
def test_a_tree_out_of_model_calls_asks_for_model_calls_and_the_approval_raises_them(
    model_factory: ModelFactory,
) -> None:
    forever = [
        {
            "when": {"system_contains": "main agent"},
            "reply": {"tool_calls": [{"name": "echo", "arguments": {"text": "x"}}], "usage": USAGE},
        }
    ]
    model = model_factory(forever)
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go", budget_model_calls=2)
    assert run_agent(sid, 0, deps) == "waiting_approval"
    assert len(model.journal()) == 2
    (req,) = _requests(sid)
    assert json.loads(req.arguments) == {"model_calls": 1}  # the kind that ran out, and only it
    assert decide(sid, req.call_id, Decision(True, "ada", "", {"model_calls": 3}), deps.scheduler).resumed
    budget = _budget(sid)
    assert (budget.budget_model_calls, budget.budget_tokens, budget.budget_usd) == (5, None, None)
    _settle(deps)  # three calls more, then it asks again
    assert len(model.journal()) == 5 and phase_of(sid) == "WAITING_APPROVAL"
    first, second = _requests(sid)
    assert json.loads(first.approved_arguments or "") == {"model_calls": 3}
    assert second.status == ApprovalStatus.PENDING and json.loads(second.arguments) == {"model_calls": 1}


@pytest.fixture
def prices(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    from models.prices import load_prices
    from settings import get_settings

    path = tmp_path / "prices.toml"
    path.write_text('["scripted"]\ninput = 1.0\ncached_input = 0.5\noutput = 2.0\n', encoding="utf-8")
    monkeypatch.setenv("MODEL_PRICES_FILE", str(path))
    get_settings.cache_clear()
    load_prices.cache_clear()
    yield path
    monkeypatch.undo()
    get_settings.cache_clear()
    load_prices.cache_clear()


@pytest.mark.usefixtures("asking_main", "prices")
def test_a_tree_out_of_dollars_asks_for_dollars_and_edited_amounts_are_checked(model_factory: ModelFactory) -> None:
    forever = [
        {
            "when": {"system_contains": "main agent"},
            "reply": {"tool_calls": [{"name": "echo", "arguments": {"text": "x"}}], "usage": USAGE},
        }
    ]
    model = model_factory(forever)
    deps = loop_deps(model.base_url, RecordingScheduler())
    # A call reserves its prompt's estimate at $1 and 1000 completion tokens at $2 per million
    # (about $0.00201) and spends 1000 x $1 + 200 x $2 ($0.0014): two calls fit in $0.004.
    sid = create_session("main", "go", budget_usd=0.004, budget_tokens=100_000)
    assert run_agent(sid, 0, deps) == "waiting_approval"
    assert len(model.journal()) == 2
    (req,) = _requests(sid)
    asked = json.loads(req.arguments)
    assert list(asked) == ["usd"] and 0.002 < asked["usd"] < 0.0021  # tokens still fit: not asked for
    for bad in ({"usd": 0}, {"usd": -1}, {"tokens": 1.5}, {"gold": 1}, {}, {"usd": 0.01, "note": "x"}, [1]):
        with pytest.raises(DecisionRefused):
            decide(sid, req.call_id, Decision(True, "ada", "", bad), deps.scheduler)  # type: ignore[arg-type]
    assert _requests(sid)[0].status == ApprovalStatus.PENDING  # a refused edit decides nothing
    assert decide(sid, req.call_id, Decision(True, "ada", "", {"usd": 0.01, "tokens": 500}), deps.scheduler).resumed
    budget = _budget(sid)
    assert (float(budget.budget_usd or 0), budget.budget_tokens) == (pytest.approx(0.014), 100_500)
    _settle(deps)
    assert len(model.journal()) > 2  # it asked the model again


def test_a_capped_child_that_asks_stops_when_its_own_cap_runs_out_since_a_raise_of_the_tree_would_not_let_it_run(
    model_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    capped = AGENTS.format(main_asks="child_budget = { tokens = 1500 }")
    path = tmp_path / "capped.toml"
    path.write_text(capped, encoding="utf-8")
    from harness.agents import _load
    from settings import get_settings

    monkeypatch.setenv("AGENTS_FILE", str(path))
    get_settings.cache_clear()
    _load.cache_clear()
    try:
        model = model_factory(SCRIPT)
        deps = loop_deps(model.base_url, RecordingScheduler())
        sid = create_session("main", "go", budget_tokens=100_000)
        run_agent(sid, 0, deps)
        _settle(deps)
    finally:
        get_settings.cache_clear()
        _load.cache_clear()
    (execution,) = executions_of(sid)
    assert _requests(execution.child_session_id) == []  # nothing asked: the tree has budget left
    assert (execution.status, execution.delivery_status) == ("FAILED", "DELIVERED")
    ((_, result_json),) = _tool_results(sid)
    assert "its own cap (child_budget) ran out" in result_json["error"]
    assert result_json["partial_result"] == "looking"


@pytest.mark.parametrize("first_answer", ["approved", "denied"])
@pytest.mark.usefixtures("asking_main")
def test_a_child_followed_up_asks_again_under_a_call_id_of_its_new_execution(
    model_factory: ModelFactory, first_answer: str
) -> None:
    model = model_factory(
        [
            {
                "when": {"system_contains": "main agent", "turn": 0},
                "reply": {
                    "tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "look"}}],
                    "usage": USAGE,
                },
            },
            {
                "when": {"system_contains": "main agent", "turn": 1},
                "reply": {
                    "tool_calls": [
                        {"name": "delegate_followup", "arguments": {"child_session_id": 2, "task": "again"}}
                    ],
                    "usage": USAGE,
                },
            },
            {"when": {"system_contains": "main agent"}, "reply": {"content": "final: {tool_results}", "usage": USAGE}},
            {"when": {"system_contains": "subagent"}, "reply": {"content": "seen", "usage": USAGE}},
        ]
    )
    deps = loop_deps(model.base_url, RecordingScheduler())
    # Every call after the first is refused until a person raises the tree by what it lacks.
    sid = create_session("main", "go", budget_tokens=1500)
    assert run_agent(sid, 0, deps) == "yielded"
    for _ in range(12):
        _settle(deps)
        with transaction() as s:
            waiting = s.execute(
                select(ApprovalRequest).where(ApprovalRequest.status == ApprovalStatus.PENDING)
            ).scalars()
            asks = [(r.session_id, r.call_id) for r in waiting]
        if not asks:
            break
        for session_id, call_id in asks:
            # The child's first run is refused its raise when so asked: its follow-up (a new run)
            # asks again all the same, since only a person's no to that run stops it.
            yes = not (first_answer == "denied" and session_id == 2 and not _requests(2)[:-1])
            assert decide(session_id, call_id, Decision(yes, "ada", "" if yes else "no"), deps.scheduler).resumed
    first, second = executions_of(sid)
    assert first.child_session_id == second.child_session_id == 2
    ended = "COMPLETED" if first_answer == "approved" else "FAILED"
    assert [(e.status, e.delivery_status) for e in (first, second)] == [
        (ended, "DELIVERED"),
        ("COMPLETED", "DELIVERED"),
    ]
    asked = [r.call_id for r in _requests(2)]
    assert asked == [f"budget-{first.id}-1", f"budget-{second.id}-1"]  # each run asked once, distinctly
    assert phase_of(sid) == "WAITING_USER" and len(_tool_results(sid)) == 2
    assert invariants() == []
