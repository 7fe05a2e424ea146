"""A token budget for an agent tree, enforced before each model call by a reservation (one
conditional UPDATE) and settled to the provider's figures with the reply (docs/usage.md,
"Budgets"). Real PostgreSQL, the scripted model over HTTP reporting known usage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from cli.main import main
from harness.parent import run_agent
from harness.views import create_session
from models import AgentSession, Message, Role, SessionType, transaction
from models.budget import DEFAULT_RESERVATION_TOKENS, TreeBudget
from tests.helpers import drive, executions_of, infra_fault_at, loop_deps, make_session
from tests.types import ModelFactory

pytestmark = pytest.mark.usefixtures("db", "redis_url")

MAIN = "main agent"
PER_CALL = 1200  # prompt 1000 + completion 200, every call
USAGE = {"prompt_tokens": 1000, "completion_tokens": 200}
BUDGET = 30_000


def _delegate(task: str) -> dict[str, Any]:
    return {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": task}}


#: A runaway tree: the parent delegates two children again after every round and never
#: answers; each child calls a tool, then answers.
RUNAWAY: list[dict[str, Any]] = [
    {"when": {"system_contains": MAIN}, "reply": {"tool_calls": [_delegate("a"), _delegate("b")], "usage": USAGE}},
    {
        "when": {"system_contains": "reviewer subagent", "turn": 0},
        "reply": {"tool_calls": [{"name": "echo", "arguments": {"text": "again"}}], "usage": USAGE},
    },
    {"when": {"system_contains": "reviewer subagent", "turn": 1}, "reply": {"content": "seen", "usage": USAGE}},
]


def _budget(root: int) -> TreeBudget:
    with transaction() as s:
        row = s.get(TreeBudget, root)
        assert row is not None
        s.expunge(row)
        return row


def test_a_runaway_tree_stops_at_its_budget_and_every_child_result_is_delivered_once(
    model_factory: ModelFactory,
) -> None:
    model = model_factory(RUNAWAY)
    deps = loop_deps(model.base_url)
    sid = create_session("main", "go", budget_tokens=BUDGET)
    run_agent(sid, 0, deps)
    drive(model.base_url, after_crash=False, deps=deps, max_steps=40)

    served = len(model.journal()) * PER_CALL
    # The model served at most the budget plus the reservations in flight: one at a time here,
    # and each call's figure (1200) within its reservation, so not past the budget at all.
    assert 0 < served <= BUDGET
    budget = _budget(sid)
    assert (budget.spent_tokens, budget.reserved_tokens) == (served, 0)  # settled to what was served, exactly

    executions = executions_of(sid)
    assert len(executions) > 2  # the parent delegated again after its children's results
    assert all(e.delivery_status == "DELIVERED" for e in executions)
    assert {str(e.status) for e in executions} == {"COMPLETED", "FAILED"}
    with transaction() as s:
        parent = s.get(AgentSession, sid)
        assert parent is not None
        assert (str(parent.phase), parent.failure_code) == ("FAILED", "budget_exhausted")
        children = [s.get(AgentSession, e.child_session_id) for e in executions]
        assert all(c is not None and c.budget_root_id == sid for c in children)  # they drew on the root's budget
        failed = [c for c, e in zip(children, executions, strict=True) if e.status == "FAILED"]
        assert all(c is not None and c.failure_code == "budget_exhausted" for c in failed)
        tool_results = list(
            s.execute(
                select(Message.tool_call_id).where(Message.session_id == sid, Message.role == Role.TOOL)
            ).scalars()
        )
    # Each child's result reached the parent exactly once.
    assert sorted(tool_results) == sorted(e.parent_tool_call_id for e in executions)


def test_a_tree_without_a_budget_reserves_nothing(model_factory: ModelFactory) -> None:
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "done", "usage": USAGE}}])
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url)) == "waiting_user"
    with transaction() as s:
        parent = s.get(AgentSession, sid)
        assert parent is not None and parent.budget_root_id is None
        assert s.execute(select(TreeBudget)).first() is None


def test_a_crash_after_a_reservation_keeps_it_charged_and_the_recovered_tree_still_ends(
    model_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import harness.loop

    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "done", "usage": USAGE}}])
    sid = create_session("main", "go", budget_tokens=BUDGET)
    with infra_fault_at(harness.loop, "budget.after_reserve"):
        assert run_agent(sid, 0, loop_deps(model.base_url)) == "infra_error"
    assert model.journal() == []
    # The dead call's reservation stays charged: the books overcount, never under.
    held = _budget(sid).reserved_tokens
    assert _budget(sid).spent_tokens == 0 and DEFAULT_RESERVATION_TOKENS < held < DEFAULT_RESERVATION_TOKENS + 100
    drive(model.base_url)
    assert len(model.journal()) == 1
    with transaction() as s:
        parent = s.get(AgentSession, sid)
        assert parent is not None and str(parent.phase) == "WAITING_USER"
    # The recovered run's take charged the dead call's reservation as estimated.
    budget = _budget(sid)
    assert (budget.spent_tokens, budget.reserved_tokens, budget.estimated_tokens) == (PER_CALL, 0, held)


@pytest.fixture
def budgeted_main(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[None]:
    """AGENTS_FILE: the built-in agents, ``main`` with ``budget = { tokens = 5000 }`` and
    ``max_tokens = 1000`` (its calls reserve 1000 each)."""
    from harness.agents import DEFAULT_AGENTS_TOML, _load
    from settings import get_settings

    agents = tmp_path / "agents.toml"
    agents.write_text(
        DEFAULT_AGENTS_TOML.replace(
            "max_rounds = 20\n", "max_rounds = 20\nmax_tokens = 1000\nbudget = { tokens = 5000 }\n", 1
        ),
        encoding="utf-8",
    )
    monkeypatch.setenv("AGENTS_FILE", str(agents))
    get_settings.cache_clear()
    _load.cache_clear()
    yield
    monkeypatch.undo()
    get_settings.cache_clear()
    _load.cache_clear()


@pytest.mark.usefixtures("budgeted_main")
def test_an_agents_budget_applies_to_every_tree_rooted_at_it_unless_submit_names_one(
    model_factory: ModelFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    model = model_factory(
        [
            {
                "when": {"system_contains": MAIN},
                "reply": {"tool_calls": [{"name": "echo", "arguments": {"text": "x"}}], "usage": USAGE},
            }
        ]
    )
    sid = create_session("main", "go")
    assert _budget(sid).budget_tokens == 5000
    assert create_session("main", "go", budget_tokens=777) and _budget(sid + 1).budget_tokens == 777
    assert run_agent(sid, 0, loop_deps(model.base_url)) == "failed"
    # 1000 reserved per call: calls start at spent 0, 1200, 2400, 3600; at 4800 the next is refused.
    assert len(model.journal()) == 4
    assert (_budget(sid).spent_tokens, _budget(sid).reserved_tokens) == (4 * PER_CALL, 0)
    with transaction() as s:
        parent = s.get(AgentSession, sid)
        assert parent is not None and parent.failure_code == "budget_exhausted"
    capsys.readouterr()
    assert main(["session", "show", str(sid), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["budget"] == {
        **shown["budget"],
        **{"root_session_id": sid, "tokens": 5000, "spent": 4 * PER_CALL, "reserved": 0, "estimated": 0},
    }
    assert (shown["budget"]["usd"], shown["budget"]["model_calls"], shown["budget"]["calls"]) == (None, None, 4)
    assert shown["usage"]["tree"]["prompt_tokens"] + shown["usage"]["tree"]["completion_tokens"] == 4 * PER_CALL
    assert main(["session", "show", str(sid)]) == 0
    assert f"budget: tree of session {sid}: 4800 of 5000 tokens spent, 0 reserved" in capsys.readouterr().out


def test_an_agents_budget_must_be_a_table_of_positive_tokens() -> None:
    from harness.agents import parse_agents
    from harness.errors import AgentConfigError

    base = '[agents.a]\nsystem_prompt = "p"\n'
    assert parse_agents(base + "budget = { tokens = 9 }\n")["a"].budget_tokens == 9
    assert parse_agents(base)["a"].budget_tokens is None
    for bad in ("budget = 9", "budget = { tokens = 0 }", "budget = { dollars = 2.0 }", 'budget = { tokens = "9" }'):
        with pytest.raises(AgentConfigError, match="budget"):
            parse_agents(base + bad + "\n")


def _statements_of_this_thread(run: Any) -> list[str]:
    """The SQL this thread sends while ``run()`` runs (a heartbeat's thread is left out)."""
    import threading

    from sqlalchemy import event

    from models import get_engine

    me, seen = threading.get_ident(), []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        # The installation's id and the worker's release are read (the release registered) once
        # per process, by whichever run comes first: this test's first when it runs alone.
        once = "FROM installation" in statement or "agent_release" in statement
        if threading.get_ident() == me and not once:
            seen.append(" ".join(statement.split()))

    engine = get_engine()
    event.listen(engine, "before_cursor_execute", record)
    try:
        run()
    finally:
        event.remove(engine, "before_cursor_execute", record)
    return seen


def test_a_budgeted_model_call_costs_one_statement_more_and_an_unbudgeted_one_none(
    model_factory: ModelFactory,
) -> None:
    script = [
        {
            "when": {"system_contains": MAIN, "turn": turn},
            "reply": {"tool_calls": [{"name": "echo", "arguments": {"text": "x"}}], "usage": USAGE},
        }
        for turn in (0, 1)
    ] + [{"when": {"system_contains": MAIN, "turn": 2}, "reply": {"content": "done", "usage": USAGE}}]
    plain_model, budgeted_model = model_factory(script), model_factory(script)
    plain, budgeted = create_session("main", "go"), create_session("main", "go", budget_tokens=BUDGET)
    without = _statements_of_this_thread(lambda: run_agent(plain, 0, loop_deps(plain_model.base_url)))
    with_budget = _statements_of_this_thread(lambda: run_agent(budgeted, 0, loop_deps(budgeted_model.base_url)))
    calls = len(budgeted_model.journal())
    assert calls == len(plain_model.journal()) == 3
    assert not [q for q in without if "tree_budget" in q]
    assert len(with_budget) - len(without) == calls  # the reservation; the settlement rides in the usage INSERT
    # One reservation per call: the tree's conditional UPDATE and the session's held tokens, one statement.
    assert len([q for q in with_budget if q.startswith("WITH granted AS (UPDATE tree_budget")]) == calls
    assert (_budget(budgeted).spent_tokens, _budget(budgeted).reserved_tokens) == (calls * PER_CALL, 0)


def test_a_round_continued_from_the_journal_after_a_crash_reserves_and_spends_nothing_more(
    model_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import harness.journal

    model = model_factory(
        [
            {
                "when": {"system_contains": MAIN, "turn": 0},
                "reply": {"tool_calls": [{"name": "echo", "arguments": {"text": "a"}}], "usage": USAGE},
            },
            {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "done", "usage": USAGE}},
        ]
    )
    sid = create_session("main", "go", budget_tokens=BUDGET)
    with infra_fault_at(harness.journal, "journal.after_reply"):
        assert run_agent(sid, 0, loop_deps(model.base_url)) == "infra_error"
    # The journaled reply settled its reservation in its own transaction.
    assert (_budget(sid).spent_tokens, _budget(sid).reserved_tokens) == (PER_CALL, 0)
    drive(model.base_url)
    assert len(model.journal()) == 2
    assert (_budget(sid).spent_tokens, _budget(sid).reserved_tokens) == (2 * PER_CALL, 0)  # the replay added 0


def test_parallel_reservations_never_take_a_tree_past_its_budget() -> None:
    """Eight threads reserve at once against one tree: the conditional UPDATE grants exactly
    what fits, whatever the interleaving (PostgreSQL re-checks the WHERE on the locked row)."""
    from concurrent.futures import ThreadPoolExecutor

    from models.budget import reserve

    sid = create_session("main", "go", budget_tokens=1000)

    def attempts(_: int) -> int:
        granted = 0
        for _ in range(20):
            with transaction() as s:
                granted += reserve(s, sid, 100)
        return granted

    with ThreadPoolExecutor(8) as pool:
        granted = sum(pool.map(attempts, range(8)))
    assert granted == 10
    assert (_budget(sid).spent_tokens, _budget(sid).reserved_tokens) == (0, 1000)


def test_a_reservation_is_the_prompts_estimate_plus_the_completion_limit() -> None:
    from harness.loop import reservation_tokens
    from harness.model import ModelOptions

    prompt = [{"role": "system", "content": "x" * 400}, {"role": "assistant", "content": None, "tool_calls": []}]
    assert reservation_tokens(ModelOptions(max_tokens=1000), prompt) == 100 + 1000
    assert reservation_tokens(ModelOptions(max_tokens=1000, max_completion_tokens=300), prompt) == 100 + 300
    assert reservation_tokens(None, prompt) == 100 + DEFAULT_RESERVATION_TOKENS


#: The parent delegates two children and never answers; each child calls a tool after every
#: round and never answers either.
NEVER_STOP: list[dict[str, Any]] = [
    {"when": {"system_contains": MAIN}, "reply": {"tool_calls": [_delegate("a"), _delegate("b")], "usage": USAGE}},
    {
        "when": {"system_contains": "reviewer subagent"},
        "reply": {"tool_calls": [{"name": "echo", "arguments": {"text": "again"}}], "usage": USAGE},
    },
]


def test_children_that_never_stop_end_budget_exhausted_once_each_and_the_parents_answer_says_so(
    model_factory: ModelFactory,
) -> None:
    budget = 12_000
    model = model_factory(NEVER_STOP)
    deps = loop_deps(model.base_url)
    sid = create_session("main", "go", budget_tokens=budget)
    run_agent(sid, 0, deps)
    drive(model.base_url, after_crash=False, deps=deps, max_steps=40)

    served = len(model.journal()) * PER_CALL
    assert 0 < served <= budget
    assert (_budget(sid).spent_tokens, _budget(sid).reserved_tokens) == (served, 0)
    executions = executions_of(sid)
    assert len(executions) == 2 and {str(e.status) for e in executions} == {"FAILED"}
    assert all(e.delivery_status == "DELIVERED" for e in executions)
    with transaction() as s:
        for e in executions:
            child = s.get(AgentSession, e.child_session_id)
            assert child is not None and child.failure_code == "budget_exhausted"
        parent = s.get(AgentSession, sid)
        assert parent is not None and (str(parent.phase), parent.failure_code) == ("FAILED", "budget_exhausted")
        rows = list(s.execute(select(Message).where(Message.session_id == sid).order_by(Message.id)).scalars())
    tool_results = [m for m in rows if m.role == Role.TOOL]
    # Each child's failed result reached the parent once, and says why.
    assert sorted(m.tool_call_id for m in tool_results) == sorted(e.parent_tool_call_id for e in executions)
    assert all("budget" in (m.content or "") for m in tool_results)
    # The parent's answer says the budget ran out.
    assert rows[-1].role == Role.ASSISTANT and "budget" in (rows[-1].content or "")
    assert f"{budget}" in (rows[-1].content or "")


def test_a_reply_the_worker_never_stored_stays_charged_as_estimated_and_the_totals_say_how_much(
    model_factory: ModelFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    import harness.loop
    from models.usage import session_usage, tree_usage

    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "done", "usage": USAGE}}])
    sid = create_session("main", "go", budget_tokens=BUDGET)
    # The provider answered; the worker died before the reply's transaction.
    with infra_fault_at(harness.loop, "model.after_reply"):
        assert run_agent(sid, 0, loop_deps(model.base_url)) == "infra_error"
    assert len(model.journal()) == 1
    held = _budget(sid).reserved_tokens
    assert held > 0 and _budget(sid).spent_tokens == 0
    drive(model.base_url)  # the recovered run: its take finds the dead call's reservation
    assert len(model.journal()) == 2
    budget = _budget(sid)
    assert (budget.spent_tokens, budget.reserved_tokens, budget.estimated_tokens) == (PER_CALL, 0, held)
    with transaction() as s:
        own, tree = session_usage(s, sid), tree_usage(s, sid)
    assert own == tree
    assert (tree.prompt_tokens + tree.completion_tokens, tree.model_calls) == (PER_CALL, 1)
    assert (tree.estimated_tokens, tree.estimated_calls) == (held, 1)
    capsys.readouterr()
    assert main(["session", "show", str(sid), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["usage"]["tree"]["estimated_tokens"] == held
    assert shown["budget"]["estimated"] == held
    assert main(["session", "show", str(sid)]) == 0
    out = capsys.readouterr().out
    assert f"estimated={held}" in out and f"{held} estimated" in out
    assert main(["usage", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"]["estimated_tokens"] == held


@pytest.fixture
def capped_children(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[None]:
    """AGENTS_FILE: the built-in agents, ``main`` with ``child_budget = { tokens = 6000 }``."""
    from harness.agents import DEFAULT_AGENTS_TOML, _load
    from settings import get_settings

    agents = tmp_path / "agents.toml"
    agents.write_text(
        DEFAULT_AGENTS_TOML.replace("max_rounds = 20\n", "max_rounds = 20\nchild_budget = { tokens = 6000 }\n", 1),
        encoding="utf-8",
    )
    monkeypatch.setenv("AGENTS_FILE", str(agents))
    get_settings.cache_clear()
    _load.cache_clear()
    yield
    monkeypatch.undo()
    get_settings.cache_clear()
    _load.cache_clear()


@pytest.mark.usefixtures("capped_children")
def test_a_capped_child_draws_at_most_its_cap_and_its_unused_part_returns_to_the_tree_when_it_ends(
    model_factory: ModelFactory,
) -> None:
    from models.usage import tree_usage

    model = model_factory(
        [
            {
                "when": {"system_contains": MAIN, "turn": 0},
                "reply": {"tool_calls": [_delegate("a"), _delegate("b")], "usage": USAGE},
            },
            {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "done anyway", "usage": USAGE}},
            NEVER_STOP[1],
        ]
    )
    deps = loop_deps(model.base_url)
    sid = create_session("main", "go", budget_tokens=BUDGET)
    assert run_agent(sid, 0, deps) == "yielded"
    executions = executions_of(sid)
    # Both allocations are set aside with the delegating round.
    assert _budget(sid).reserved_tokens == 2 * 6000
    with transaction() as s:
        assert [s.get(AgentSession, e.child_session_id).cap_tokens for e in executions] == [6000, 6000]  # type: ignore[union-attr]
    drive(model.base_url, after_crash=False, deps=deps)

    with transaction() as s:
        children = [s.get(AgentSession, e.child_session_id) for e in executions]
        drawn = [tree_usage(s, e.child_session_id) for e in executions]
        parent = s.get(AgentSession, sid)
        assert parent is not None and str(parent.phase) == "WAITING_USER"  # the parent still answered
    assert all(c is not None and c.failure_code == "budget_exhausted" and c.cap_tokens is None for c in children)
    # Each child stopped at its cap (a call reserves ~4150 tokens, each spends 1200).
    assert [d.prompt_tokens + d.completion_tokens for d in drawn] == [2 * PER_CALL, 2 * PER_CALL]
    # The unused parts came back: nothing stays reserved, spent is what was served.
    assert (_budget(sid).spent_tokens, _budget(sid).reserved_tokens) == (len(model.journal()) * PER_CALL, 0)
    assert len(model.journal()) == 2 + 4


def test_an_agents_child_budget_must_be_a_table_of_positive_tokens() -> None:
    from harness.agents import parse_agents
    from harness.errors import AgentConfigError

    base = '[agents.a]\nsystem_prompt = "p"\n'
    assert parse_agents(base + "child_budget = { tokens = 50 }\n")["a"].child_budget_tokens == 50
    for bad in ("child_budget = 5", "child_budget = { tokens = 0 }", "child_budget = { usd = 1 }"):
        with pytest.raises(AgentConfigError, match="child_budget"):
            parse_agents(base + bad + "\n")


def test_an_operator_raises_a_running_trees_budget_and_the_audit_says_who(
    model_factory: ModelFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    from models.operator_action import latest

    model = model_factory(FOREVER_ECHO)
    sid = create_session("main", "go", budget_tokens=5000)
    child = make_session(session_type=SessionType.SUBAGENT, phase=None, parent_session_id=sid, budget_root_id=sid)
    capsys.readouterr()
    # A session of the tree (a child here) names its tree; the root's budget is raised.
    assert main(["budget", "raise", str(child), "--tokens", "2500", "--by", "ada"]) == 0
    assert "raised" in capsys.readouterr().out
    assert _budget(sid).budget_tokens == 7500
    unbudgeted = create_session("main", "go")
    assert main(["budget", "raise", str(unbudgeted), "--tokens", "10", "--by", "ada"]) == 1
    assert main(["budget", "raise", "999999", "--tokens", "10", "--by", "ada"]) == 1
    with transaction() as s:
        actions = latest(s, limit=3)
    assert [(a["actor"], a["action"], a["outcome"], a["session_id"], a["amount"]) for a in actions] == [
        ("ada", "budget_raise", "not_found", 999999, 10),
        ("ada", "budget_raise", "no_budget", unbudgeted, 10),
        ("ada", "budget_raise", "raised", child, 2500),
    ]
    # The raised budget is drawn on at once: a call reserves ~4150 tokens and spends 1200, so
    # 5000 would let 1 call through, 7500 lets 3.
    assert run_agent(sid, 0, loop_deps(model.base_url)) == "failed"
    assert len(model.journal()) == 3


FOREVER_ECHO: list[dict[str, Any]] = [
    {
        "when": {"system_contains": MAIN},
        "reply": {"tool_calls": [{"name": "echo", "arguments": {"text": "x"}}], "usage": USAGE},
    }
]


def test_a_child_refused_for_budget_passes_what_it_had_said_to_its_parent_as_a_partial_result(
    model_factory: ModelFactory,
) -> None:
    model = model_factory(
        [
            {"when": {"system_contains": MAIN, "turn": 0}, "reply": {"tool_calls": [_delegate("a")], "usage": USAGE}},
            {"when": {"system_contains": MAIN}, "reply": {"content": "done", "usage": USAGE}},
            {
                "when": {"system_contains": "reviewer subagent"},
                "reply": {
                    "tool_calls": [{"name": "echo", "arguments": {"text": "more"}}],
                    "message_fields": {"content": "so far: 3 files read"},
                    "usage": USAGE,
                },
            },
        ]
    )
    deps = loop_deps(model.base_url)
    # The parent's call and the child's first fit; the child's second (1200 + 1200 spent, and
    # ~4150 to reserve) does not.
    sid = create_session("main", "go", budget_tokens=6000)
    run_agent(sid, 0, deps)
    drive(model.base_url, after_crash=False, deps=deps)
    (execution,) = executions_of(sid)
    assert (str(execution.status), execution.delivery_status) == ("FAILED", "DELIVERED")
    with transaction() as s:
        (result,) = s.execute(
            select(Message.content).where(Message.session_id == sid, Message.role == Role.TOOL)
        ).scalars()
    delivered = json.loads(result)
    assert delivered["partial_result"] == "so far: 3 files read"
    assert "budget" in delivered["error"]


def test_the_soaks_budget_check_passes_true_books_and_names_each_broken_one() -> None:
    from bench.soak import _budget_problems
    from models.usage import record_usage

    sid = create_session("main", "go", budget_tokens=BUDGET)
    with transaction() as s:
        record_usage(
            s,
            session_id=sid,
            execution_id=None,
            model="m",
            prompt_tokens=1000,
            completion_tokens=200,
            cached_tokens=0,
            reasoning_tokens=0,
        )
        s.execute(select(TreeBudget).where(TreeBudget.root_session_id == sid)).scalar_one().spent_tokens = PER_CALL
    with transaction() as s:
        assert _budget_problems(s) == []
        s.execute(select(TreeBudget).where(TreeBudget.root_session_id == sid)).scalar_one().reserved_tokens = BUDGET
    with transaction() as s:
        assert _budget_problems(s) == [f"tree {sid}: charged {BUDGET + PER_CALL} > budget {BUDGET}"]
        books = s.execute(select(TreeBudget).where(TreeBudget.root_session_id == sid)).scalar_one()
        books.spent_tokens, books.reserved_tokens = 7, 0
    with transaction() as s:
        assert [p.split(":")[1] for p in _budget_problems(s)] == [" spent 7 != stored usage 1200"]
