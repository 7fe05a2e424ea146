"""Tool-call ids are the provider's; keys and rows are ours. Driven in-process on real
PostgreSQL and the scripted model over HTTP, with models as real providers behave: ``call_0`` in
every reply, one id twice in a reply, ids far over 128 characters.

Every call gets a local id when its reply is journaled: rows, journal entries, unique keys and
``ToolContext.idempotency_key`` use it; the model is shown its own ids."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy import select, update

import harness.journal
from crashpoints import InjectedKill
from harness.agents import get_agent
from harness.child import start_child
from harness.loop import model_messages
from harness.parent import run_agent
from harness.tools import ToolContext, tool, unregister
from harness.views import create_session
from models import Message, Role, RoundJournal, SubagentExecution, transaction
from recovery.invariants import check_all
from tests.helpers import RecordingScheduler, add_message, drive, executions_of, invariants, loop_deps, messages_of
from tests.types import ModelFactory

MAIN = "main agent"
LOCAL_PREFIX = "tc_"  #: harness.callids.LOCAL_PREFIX (spelled out: this module also runs on older code)
LONG_ID = "call_" + "gemini-thought-signature/" * 12  # 305 characters, as LiteLLM carries them

AGENTS = """
[agents.main]
system_prompt = "You are the main agent."
[agents.reviewer]
system_prompt = "You are the reviewer subagent."
"""


@dataclass
class Payments:
    """A payment service that deduplicates by idempotency key, as Stripe does: a key it has
    seen gets the first answer again, and nothing is refunded."""

    refunded: list[int] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    crash_first: bool = False

    def refund(self, ctx: ToolContext, amount: int) -> str:
        key = ctx.idempotency_key
        self.keys.append(key)
        if key in self.answers:
            return self.answers[key]
        if self.crash_first:
            self.crash_first = False
            # A worker killed inside the tool (a tool's own exceptions are its TOOL result).
            raise InjectedKill("simulated crash in refund")
        self.refunded.append(amount)
        self.answers[key] = f"refunded {amount}"
        return self.answers[key]


@pytest.fixture
def payments(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[Payments]:
    """``refund`` (neither read-only nor idempotent) and ``refund_again`` (idempotent: a
    recovery runs it again with the same key), offered to every agent."""
    from harness.agents import _load
    from settings import get_settings

    agents = tmp_path / "agents.toml"
    agents.write_text(AGENTS, encoding="utf-8")
    monkeypatch.setenv("AGENTS_FILE", str(agents))
    get_settings.cache_clear()
    _load.cache_clear()
    service = Payments()

    @tool
    def refund(ctx: ToolContext, amount: int) -> str:
        """Refund an amount to the customer."""
        return service.refund(ctx, amount)

    @tool(idempotent=True)
    def refund_again(ctx: ToolContext, amount: int) -> str:
        """Refund an amount, deduplicated by the service (safe to repeat)."""
        return service.refund(ctx, amount)

    yield service
    unregister("refund")
    unregister("refund_again")
    monkeypatch.undo()
    get_settings.cache_clear()
    _load.cache_clear()


def refund(amount: int, call_id: str = "call_0", name: str = "refund") -> dict[str, Any]:
    return {"name": name, "arguments": {"amount": amount}, "id": call_id}


def child_rounds(*rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A parent that delegates once; its child answers with ``rounds`` of tool calls, then text."""
    rules: list[dict[str, Any]] = [
        {
            "when": {"system_contains": MAIN, "turn": 0},
            "reply": {"tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "t"}}]},
        },
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "parent saw: {tool_results}"}},
    ]
    rules += [
        {"when": {"system_contains": "subagent", "turn": i}, "reply": {"tool_calls": calls}}
        for i, calls in enumerate(rounds)
    ]
    rules.append({"when": {"system_contains": "subagent", "turn": len(rounds)}, "reply": {"content": "child done"}})
    return rules


def parent_rounds(*rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = [
        {"when": {"system_contains": MAIN, "turn": i}, "reply": {"tool_calls": calls}} for i, calls in enumerate(rounds)
    ]
    rules.append({"when": {"system_contains": MAIN, "turn": len(rounds)}, "reply": {"content": "done"}})
    return rules


def run_child(model_url: str) -> tuple[int, SubagentExecution]:
    """Run a delegating parent, its child and the delivery in-process; (parent, execution)."""
    deps = loop_deps(model_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    _, _, children = deps.scheduler.children.pop()
    ((eid, e),) = children
    start_child(eid, e, deps)
    drive(model_url, after_crash=False, deps=deps)
    (execution,) = executions_of(sid)
    return sid, execution


def tool_rows(session_id: int) -> list[Message]:
    return [m for m in messages_of(session_id) if m.role == Role.TOOL]


def test_a_child_that_reuses_call_0_for_two_refunds_gets_two_keys_and_both_refunds_happen(
    model_factory: ModelFactory, payments: Payments
) -> None:
    model = model_factory(child_rounds([refund(100)], [refund(250)]))
    _, execution = run_child(model.base_url)
    assert payments.refunded == [100, 250]  # the service saw two keys: 250 was refunded
    assert len(set(payments.keys)) == 2
    assert (execution.status, execution.delivery_status) == ("COMPLETED", "DELIVERED")
    assert [m.content for m in tool_rows(execution.child_session_id)] == ["refunded 100", "refunded 250"]
    assert invariants() == []


def test_a_parent_call_whose_id_appeared_in_an_earlier_round_is_a_new_call_and_runs(
    model_factory: ModelFactory, payments: Payments
) -> None:
    model = model_factory(parent_rounds([refund(100)], [refund(250)], [refund(300)]))
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url)) == "waiting_user"
    assert payments.refunded == [100, 250, 300]
    assert [m.content for m in tool_rows(sid)] == ["refunded 100", "refunded 250", "refunded 300"]
    assert messages_of(sid)[-1].content == "done"
    assert invariants() == []


def test_a_parent_whose_model_sends_call_0_in_every_reply_delegates_again_and_both_children_deliver(
    model_factory: ModelFactory, payments: Payments
) -> None:
    delegate = {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "t"}, "id": "call_0"}
    model = model_factory(
        [
            {"when": {"system_contains": MAIN, "turn": 0}, "reply": {"tool_calls": [delegate]}},
            {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"tool_calls": [delegate]}},
            {"when": {"system_contains": MAIN, "turn": 2}, "reply": {"content": "done"}},
            {"when": {"system_contains": "subagent"}, "reply": {"content": "child done"}},
        ]
    )
    sid = create_session("main", "go")
    deps = loop_deps(model.base_url, RecordingScheduler())
    assert run_agent(sid, 0, deps) == "yielded"
    drive(model.base_url, after_crash=False, deps=deps)
    execs = executions_of(sid)
    assert [(e.status, e.delivery_status) for e in execs] == [("COMPLETED", "DELIVERED")] * 2
    assert len({e.parent_tool_call_id for e in execs}) == 2  # the unique key holds two calls
    assert all(str(e.parent_tool_call_id).startswith(LOCAL_PREFIX) for e in execs)
    assert messages_of(sid)[-1].content == "done"
    assert invariants() == []


@pytest.mark.parametrize("where", ["parent", "child"])
def test_a_tool_call_id_over_128_characters_runs_once_and_the_model_sees_its_own_id_back(
    model_factory: ModelFactory, payments: Payments, where: str
) -> None:
    if where == "parent":
        model = model_factory(parent_rounds([refund(100, LONG_ID, "refund_again")]))
        sid = create_session("main", "go")
        assert run_agent(sid, 0, loop_deps(model.base_url)) == "waiting_user"
        session, agent = sid, "main"
    else:
        model = model_factory(child_rounds([refund(100, LONG_ID, "refund_again")]))
        sid, execution = run_child(model.base_url)
        assert (execution.status, execution.delivery_status) == ("COMPLETED", "DELIVERED")
        session, agent = execution.child_session_id, "reviewer"
    assert payments.refunded == [100]
    (row,) = tool_rows(session)
    assert row.content == "refunded 100" and str(row.tool_call_id).startswith(LOCAL_PREFIX)
    view = model_messages(session, get_agent(agent))
    call = next(m for m in view if m.get("tool_calls"))["tool_calls"][0]
    function = {"name": "refund_again", "arguments": '{"amount": 100}'}
    assert call == {"id": LONG_ID, "type": "function", "function": function}
    assert next(m for m in view if m["role"] == "tool")["tool_call_id"] == LONG_ID
    assert invariants() == []


@pytest.mark.parametrize("where", ["parent", "child"])
def test_the_same_id_twice_in_one_reply_runs_the_first_call_only_and_the_second_gets_a_tool_error(
    model_factory: ModelFactory, payments: Payments, where: str
) -> None:
    calls = [refund(100), refund(250)]
    if where == "parent":
        model = model_factory(parent_rounds(calls))
        sid = create_session("main", "go")
        assert run_agent(sid, 0, loop_deps(model.base_url)) == "waiting_user"
        session = sid
    else:
        model = model_factory(child_rounds(calls))
        sid, execution = run_child(model.base_url)
        assert (execution.status, execution.delivery_status) == ("COMPLETED", "DELIVERED")
        session = execution.child_session_id
    assert payments.refunded == [100]
    first, second = tool_rows(session)
    assert first.content == "refunded 100"
    assert second.content == "error: the model repeated tool_call id 'call_0' in one reply; this call was not run"
    assert invariants() == []


def test_a_recovered_idempotent_call_runs_again_with_the_key_of_its_first_run(
    model_factory: ModelFactory, payments: Payments
) -> None:
    model = model_factory(child_rounds([refund(100, name="refund_again")]))
    payments.crash_first = True
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    _, _, children = deps.scheduler.children.pop()
    ((eid, e),) = children
    with pytest.raises(InjectedKill):
        start_child(eid, e, deps)
    drive(model.base_url)
    assert payments.refunded == [100]
    first, again = payments.keys
    assert first == again  # stable across the recovery: the local id was read back
    (execution,) = executions_of(sid)
    (row,) = tool_rows(execution.child_session_id)
    from models import installation_id

    with transaction() as s:
        space = installation_id(s)
    assert first == hashlib.sha256(f"{space}:{row.tool_call_id}".encode()).hexdigest()
    assert invariants() == []


def test_an_open_journal_entry_written_before_local_ids_recovers_with_its_old_key(
    model_factory: ModelFactory, payments: Payments, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = model_factory(child_rounds([refund(100, "call_old", "refund_again")]))
    real = harness.journal.crash_point
    hits = {"n": 0}

    def crash_at_child_reply(name: str) -> None:
        if name == "journal.after_reply":
            hits["n"] += 1
            if hits["n"] == 2:  # the parent's delegating reply is the first
                raise sa_exc.OperationalError("simulated crash", None, Exception("crash"))
        real(name)

    monkeypatch.setattr(harness.journal, "crash_point", crash_at_child_reply)
    monkeypatch.setattr(harness.parent, "crash_point", crash_at_child_reply)
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    _, _, children = deps.scheduler.children.pop()
    ((eid, e),) = children
    assert start_child(eid, e, deps) == "infra_error"
    # The entry as a release before local ids wrote it: the provider's id, no provider_id.
    with transaction() as s:
        entry = s.execute(select(RoundJournal).where(RoundJournal.closed_at.is_(None))).scalar_one()
        legacy = [{k: v for k, v in c.items() if k != "provider_id"} | {"id": "call_old"} for c in entry.tool_calls]
        s.execute(update(RoundJournal).where(RoundJournal.id == entry.id).values(tool_calls=legacy))
        child = entry.session_id
    drive(model.base_url)
    assert payments.refunded == [100]
    assert payments.keys == [hashlib.sha256(f"{child}:call_old".encode()).hexdigest()]
    (row,) = tool_rows(child)
    assert row.tool_call_id == "call_old"
    (execution,) = executions_of(sid)
    assert (execution.status, execution.delivery_status) == ("COMPLETED", "DELIVERED")
    assert invariants() == []


def test_the_invariants_name_two_calls_that_share_a_key_and_two_tool_rows_for_one_call(db: str) -> None:
    from tests.helpers import make_session

    a, b = make_session(), make_session()
    call = {"id": "tc_" + "1" * 32, "type": "function", "function": {"name": "echo", "arguments": "{}"}}
    local = {**call, "provider_id": "call_0"}
    # Two distinct calls (two rounds, in two sessions) under one local id: one key for both.
    for sid in (a, b):
        add_message(sid, Role.ASSISTANT, "", tool_calls=[local])
        add_message(sid, Role.TOOL, "x", tool_call_id=call["id"])
    with transaction() as s:
        problems = check_all(s, settled=False)
    assert any(p.startswith("K1") and call["id"] in p for p in problems), problems
    assert any(p.startswith("K2") and call["id"] in p for p in problems), problems


def test_the_installation_id_is_drawn_once_by_the_migration_and_a_rebuilt_table_draws_a_new_one(
    db: str,
) -> None:
    from sqlalchemy import delete

    from models import Installation, installation_id

    with transaction() as s:
        first = installation_id(s)
        assert s.execute(select(Installation.created_at)).scalar_one() is not None  # written by migration 0011
    with transaction() as s:
        assert installation_id(s) == first  # stable
        s.execute(delete(Installation))
    with transaction() as s:
        rebuilt = installation_id(s)
    assert rebuilt != first and len(rebuilt) == 32
    with transaction() as s:
        s.execute(update(Installation).values(installation_id=first))  # leave the test database as it was
