"""The round journal, driven in-process on real PostgreSQL and the scripted
model over HTTP: a crash inside a round (an infrastructure error at a journal crash point or
inside a tool: the run ends without writing, as a killed worker's) is recovered by the scan,
and the round continues from the journal. Real worker processes SIGKILLed at the same points
are in tests/crash/test_crash_matrix.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy import select

import harness.journal
import harness.parent
from crashpoints import InjectedKill
from harness.child import start_child
from harness.parent import run_agent
from harness.tools import ToolContext, tool, unregister
from harness.views import create_session
from models import CallStatus, JournalStatus, Phase, RoundJournal, RoundJournalCall, transaction
from tests.helpers import (
    RecordingScheduler,
    drive,
    executions_of,
    expire_leases,
    invariants,
    loop_deps,
    messages_of,
    recorded_statements,
)
from tests.types import ModelFactory

MAIN = "main agent"


class Crash(sa_exc.OperationalError):
    """What a killed worker looks like in-process: an infrastructure error, nothing written."""

    def __init__(self, where: str) -> None:
        super().__init__(f"simulated crash at {where}", None, Exception("crash"))


@dataclass
class Recorder:
    """Counts each tool start (name, session, idempotency key) and crashes the first start of
    the tools named in ``crash_first``."""

    starts: list[tuple[str, int, str]]
    crash_first: set[str]
    #: Tools that kill their worker at every start (a poison call).
    crash_always: set[str] = field(default_factory=set)

    def started(self, name: str, ctx: ToolContext, amount: int) -> str:
        self.starts.append((name, ctx.session_id, ctx.idempotency_key))
        if name in self.crash_always:
            raise InjectedKill(f"tool {name}")
        if name in self.crash_first:
            self.crash_first.discard(name)
            # A worker killed inside a tool: an exception the tool raises is its TOOL result,
            # so the kill is simulated as crashpoints' in-process kill, which nothing catches.
            raise InjectedKill(f"tool {name}")
        return f"{name} did {json.dumps({'amount': amount})}"


AGENTS = """
[agents.main]
system_prompt = "You are the main agent."
[agents.reviewer]
system_prompt = "You are the reviewer subagent."
[agents.researcher]
system_prompt = "You are the researcher subagent."
"""


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[Recorder]:
    """Three user tools: ``charge`` (neither read-only nor idempotent), ``refresh``
    (idempotent) and ``lookup`` (read-only), offered to every agent."""
    from harness.agents import _load
    from settings import get_settings

    agents = tmp_path / "agents.toml"
    agents.write_text(AGENTS, encoding="utf-8")
    monkeypatch.setenv("AGENTS_FILE", str(agents))
    get_settings.cache_clear()
    _load.cache_clear()
    rec = Recorder([], set())

    @tool
    def charge(ctx: ToolContext, amount: int) -> str:
        """Charge the customer (a side effect that must not happen twice)."""
        return rec.started("charge", ctx, amount)

    @tool(idempotent=True)
    def refresh(ctx: ToolContext, amount: int) -> str:
        """Refresh a cache (safe to repeat)."""
        return rec.started("refresh", ctx, amount)

    @tool(read_only=True)
    def lookup(ctx: ToolContext, amount: int) -> str:
        """Look an order up (reads only)."""
        return rec.started("lookup", ctx, amount)

    yield rec
    unregister("charge")
    unregister("refresh")
    unregister("lookup")
    monkeypatch.undo()
    get_settings.cache_clear()
    _load.cache_clear()


def crash_at(monkeypatch: pytest.MonkeyPatch, point: str, *, on_hit: int = 1) -> None:
    """The on_hit-th time ``point`` is reached, the run ends as a killed worker's would (in the
    journal's own steps, and in the parent's delegating round, whose reply is committed with
    its children)."""
    real = harness.journal.crash_point
    hits = {"n": 0}

    def fake(name: str) -> None:
        if name == point:
            hits["n"] += 1
            if hits["n"] == on_hit:
                raise Crash(point)
        real(name)

    monkeypatch.setattr(harness.journal, "crash_point", fake)
    monkeypatch.setattr(harness.parent, "crash_point", fake)


def call(name: str, **args: Any) -> dict[str, Any]:
    return {"name": name, "arguments": args}


def child_script(*calls: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "when": {"system_contains": MAIN, "turn": 0},
            "reply": {"tool_calls": [call("delegate", agent_type="reviewer", task="t")]},
        },
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "final"}},
        {"when": {"system_contains": "subagent", "turn": 0}, "reply": {"tool_calls": list(calls)}},
        {"when": {"system_contains": "subagent", "turn": 1}, "reply": {"content": "child saw: {tool_results}"}},
    ]


def parent_script(*calls: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"when": {"system_contains": MAIN, "turn": 0}, "reply": {"tool_calls": list(calls)}},
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "parent saw: {tool_results}"}},
        {"when": {"system_contains": "subagent"}, "reply": {"content": "child result"}},
    ]


def asked(model: Any, rule: int) -> int:
    return sum(1 for j in model.journal() if j["rule"] == rule)


def crashed_child(model_url: str) -> int:
    """Start a parent that delegates, and run its child once (it crashes); returns the parent."""
    deps = loop_deps(model_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    _, _, children = deps.scheduler.children.pop()
    ((eid, e),) = children
    killed_or_faulted(lambda: start_child(eid, e, deps))
    return sid


def killed_or_faulted(run: Any) -> None:
    """``run`` ended as a killed worker's does: an infrastructure fault at a journal step, or
    the in-process kill inside a tool."""
    try:
        assert run() == "infra_error"
    except InjectedKill:
        pass


def journal_rows() -> tuple[list[RoundJournal], list[RoundJournalCall]]:
    with transaction() as s:
        entries = list(s.execute(select(RoundJournal).order_by(RoundJournal.id)).scalars())
        calls = list(s.execute(select(RoundJournalCall).order_by(RoundJournalCall.id)).scalars())
    return entries, calls


def test_a_child_that_crashed_after_its_reply_was_journaled_finishes_the_round_without_asking_the_model_again(
    model_factory: ModelFactory, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = model_factory(child_script(call("refresh", amount=1)))
    crash_at(monkeypatch, "journal.after_reply", on_hit=2)  # the parent's reply (with its children) is the first
    sid = crashed_child(model.base_url)
    assert recorder.starts == []  # no tool ran before the crash
    drive(model.base_url)
    assert asked(model, 2) == 1  # the child's tool-call reply: asked once, continued from the journal
    assert [s[0] for s in recorder.starts] == ["refresh"]
    (e,) = executions_of(sid)
    assert (e.status, e.delivery_status) == ("COMPLETED", "DELIVERED")
    entries, _ = journal_rows()
    # The child's entry only: the parent's delegating reply is its pending round.
    assert [(j.session_id, j.status, j.replays) for j in entries] == [(e.child_session_id, JournalStatus.CLOSED, 1)]
    assert messages_of(sid)[-1].content == "final"
    assert invariants() == []


def test_an_interrupted_tool_that_is_neither_read_only_nor_idempotent_is_not_run_again_and_the_model_is_told(
    model_factory: ModelFactory, recorder: Recorder
) -> None:
    model = model_factory(child_script(call("charge", amount=5)))
    recorder.crash_first.add("charge")
    sid = crashed_child(model.base_url)
    drive(model.base_url)
    assert [s[0] for s in recorder.starts] == ["charge"]  # started once, never again
    assert asked(model, 2) == 1
    child = executions_of(sid)[0].child_session_id
    tool_row = next(m for m in messages_of(child) if m.role == "TOOL")
    assert "interrupted by a restart" in (tool_row.content or "")
    assert "may or may not have taken effect" in (tool_row.content or "")
    assert '{"amount": 5}' in (tool_row.content or "")  # its arguments, so the model can decide
    _, calls = journal_rows()
    assert [(c.tool_name, c.status, c.starts, c.repeatable) for c in calls] == [
        ("charge", CallStatus.STARTED, 1, False)
    ]
    assert invariants() == []


@pytest.mark.parametrize("name", ["refresh", "lookup"], ids=["idempotent", "read_only"])
def test_an_interrupted_read_only_or_idempotent_tool_runs_again_for_the_same_call(
    model_factory: ModelFactory, recorder: Recorder, name: str
) -> None:
    model = model_factory(child_script(call(name, amount=2)))
    recorder.crash_first.add(name)
    sid = crashed_child(model.base_url)
    drive(model.base_url)
    assert [s[0] for s in recorder.starts] == [name, name]
    assert recorder.starts[0] == recorder.starts[1]  # the same session and idempotency key
    assert asked(model, 2) == 1
    child = executions_of(sid)[0].child_session_id
    tool_row = next(m for m in messages_of(child) if m.role == "TOOL")
    assert tool_row.content == f'{name} did {{"amount": 2}}'
    assert invariants() == []


def test_a_tool_whose_result_was_journaled_is_not_run_again_and_one_that_never_started_runs(
    model_factory: ModelFactory, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = model_factory(child_script(call("charge", amount=1), call("refresh", amount=2)))
    crash_at(monkeypatch, "journal.after_tool_result")
    sid = crashed_child(model.base_url)
    assert [s[0] for s in recorder.starts] == ["charge"]
    drive(model.base_url)
    assert [s[0] for s in recorder.starts] == ["charge", "refresh"]
    assert asked(model, 2) == 1
    child = executions_of(sid)[0].child_session_id
    assert [m.content for m in messages_of(child) if m.role == "TOOL"] == [
        'charge did {"amount": 1}',
        'refresh did {"amount": 2}',
    ]
    assert invariants() == []


def test_a_parent_inline_round_journaled_before_a_crash_continues_without_a_second_model_call(
    model_factory: ModelFactory, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = model_factory(parent_script(call("charge", amount=3), call("echo", text="hi")))
    crash_at(monkeypatch, "journal.after_tool_start")
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url)) == "infra_error"
    drive(model.base_url)
    assert asked(model, 0) == 1
    assert recorder.starts == []  # the crash came after its start was journaled, before it ran
    tools_rows = [m.content or "" for m in messages_of(sid) if m.role == "TOOL"]
    assert "interrupted by a restart" in tools_rows[0] and tools_rows[1] == "hi"
    assert messages_of(sid)[-1].content.startswith("parent saw:")
    assert invariants() == []


MIXED = (
    call("delegate", agent_type="reviewer", task="a"),
    call("echo", text="inline"),
    call("delegate", agent_type="researcher", task="b"),
)


def test_a_delegating_reply_is_committed_with_its_children_and_a_crash_after_it_asks_nothing_again(
    model_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delegating reply's journal entry is its pending round, committed in the transaction
    that creates its children (no journal transaction of its own): right after that commit
    the children exist, and recovery neither asks the model again nor creates them twice."""
    model = model_factory(parent_script(*MIXED))
    crash_at(monkeypatch, "journal.after_reply")
    sid = create_session("main", "go")
    assert run_agent(sid, 0, loop_deps(model.base_url)) == "infra_error"
    assert len(executions_of(sid)) == 2  # committed with the reply
    assert journal_rows() == ([], [])  # the pending round is the reply's journal
    drive(model.base_url)
    assert asked(model, 0) == 1
    execs = executions_of(sid)
    assert len(execs) == 2 and {(e.status, e.delivery_status) for e in execs} == {("COMPLETED", "DELIVERED")}
    tools = [m for m in messages_of(sid) if m.role == "TOOL"]
    assert len(tools) == 3  # two delegations and the inline echo, interrupted or not: once each
    assert invariants() == []


def test_a_delegating_reply_journaled_before_the_upgrade_still_creates_its_children_once(
    model_factory: ModelFactory,
) -> None:
    """An open entry of a delegating reply (journaled by a worker of the previous release,
    which committed the reply before creating the children) is continued: no model call, the
    children created once, the entry closed by their creation."""
    from harness.fence import SessionFence
    from harness.journal import journal_reply
    from harness.model import ModelReply, ToolCall
    from models.session import take_session

    model = model_factory(parent_script(*MIXED))
    sid = create_session("main", "go")
    with transaction() as s:
        assert take_session(s, sid, expected_epoch=0, owner="old", lease_seconds=30, to_phase=Phase.RUNNING) == 1
    calls = tuple(ToolCall(f"call_{n}", c["name"], json.dumps(c["arguments"])) for n, c in enumerate(MIXED, start=1))
    journal_reply(SessionFence(sid, 1, 30), sid, ModelReply(None, calls, 10, 5))
    drive(model.base_url)  # the old worker died: its lease lapses, the scan resumes the parent
    assert asked(model, 0) == 0
    execs = executions_of(sid)
    assert len(execs) == 2 and {(e.status, e.delivery_status) for e in execs} == {("COMPLETED", "DELIVERED")}
    entries, _ = journal_rows()
    assert [(e.status, e.replays) for e in entries] == [(JournalStatus.CLOSED, 1)]
    assert invariants() == []


def test_a_parent_run_with_no_open_entry_reads_no_journal_its_take_said_so(model_factory: ModelFactory) -> None:
    """The take's RETURNING says whether an entry is open (models.session.JOURNAL_OPEN): a run
    with none sends no journal read of its own (the tests around this one show that a run
    with one still continues it)."""
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "done"}}])
    sid = create_session("main", "go")
    with recorded_statements() as seen:
        assert run_agent(sid, 0, loop_deps(model.base_url)) == "waiting_user"
    takes = [q for q in seen if q.startswith("UPDATE agent_session SET phase=") and "RETURNING" in q]
    assert len(takes) == 1 and "FROM round_journal" in takes[0], takes
    assert not [q for q in seen if q.startswith("SELECT") and "FROM round_journal" in q], seen
    assert messages_of(sid)[-1].content == "done"


def test_a_recovered_child_with_no_open_entry_reads_no_journal_its_load_said_so(model_factory: ModelFactory) -> None:
    """A child recovered before its first round (its worker died before it ran): the load after
    its take says that no entry is open (``ChildInfo.journal_open``), and the recovery sends no
    journal read of its own (a child with one still continues it: the tests above)."""
    from recovery.child import recover_child
    from recovery.scan import scan

    model = model_factory(parent_script(call("delegate", agent_type="reviewer", task="t")))
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    deps.scheduler.children.clear()  # the crash: the child's message was never run
    expire_leases()
    scan(deps.scheduler, callback_grace_seconds=0)
    ((_, _, children),) = deps.scheduler.recoveries
    ((eid, epoch),) = children
    with recorded_statements() as seen:
        assert recover_child(eid, epoch, deps) == "completed"
    assert [q for q in seen if "FROM round_journal" in q and "AS journal_open" in q], seen
    assert not [q for q in seen if q.startswith("SELECT") and "FROM round_journal" in q], seen
    assert [e.status for e in executions_of(sid)] == ["COMPLETED"]


def test_an_open_entry_asked_from_an_older_history_is_abandoned_not_continued(model_factory: ModelFactory) -> None:
    from harness.history import append_message
    from models import Role
    from models import journal as store

    model = model_factory(parent_script(call("echo", text="x")))
    sid = create_session("main", "go")
    with transaction() as s:
        store.write_reply(
            s, session_id=sid, epoch=0, content=None, tool_calls=[], refused={}, prompt_tokens=0, completion_tokens=0
        )
        append_message(s, sid, Role.ASSISTANT, "an answer the entry never saw")
        append_message(s, sid, Role.USER, "a new instruction")
    assert run_agent(sid, 0, loop_deps(model.base_url)) == "waiting_user"
    entries, _ = journal_rows()
    assert [j.status for j in entries] == [JournalStatus.ABANDONED]
    assert [j["rule"] for j in model.journal()] == [1]  # asked again, from the history as it is


def test_the_invariants_name_a_second_start_of_a_non_idempotent_call_and_a_reply_asked_for_again(
    model_factory: ModelFactory,
) -> None:
    from models import journal as store
    from recovery.invariants import check_journal

    sid = create_session("main", "go")
    reply = {"content": None, "tool_calls": [], "refused": {}, "prompt_tokens": 0, "completion_tokens": 0}
    with transaction() as s:
        first = store.write_reply(s, session_id=sid, epoch=1, **reply)
        store.mark_started(s, first, "call-1", tool_name="charge", repeatable=False)
        assert check_journal(s) == []
        store.mark_started(s, first, "call-1", tool_name="charge", repeatable=False)
        store.write_reply(s, session_id=sid, epoch=1, **reply)  # the same history asked again
        problems = check_journal(s)
    assert [p[:2] for p in problems] == ["J1", "J2"]


def test_an_inline_tool_of_a_mixed_round_interrupted_by_a_crash_is_delivered_as_interrupted_not_run_again(
    model_factory: ModelFactory, recorder: Recorder
) -> None:
    model = model_factory(parent_script(call("delegate", agent_type="reviewer", task="a"), call("charge", amount=7)))
    recorder.crash_first.add("charge")
    sid = create_session("main", "go")
    killed_or_faulted(lambda: run_agent(sid, 0, loop_deps(model.base_url)))
    drive(model.base_url)
    assert [s[0] for s in recorder.starts] == ["charge"]
    assert asked(model, 0) == 1
    charge = [m.content or "" for m in messages_of(sid) if m.role == "TOOL"][1]
    assert "interrupted by a restart" in charge and '{"amount": 7}' in charge
    assert invariants() == []


def test_a_read_only_tool_that_kills_its_worker_every_time_is_reported_interrupted_after_the_bounded_reruns(
    model_factory: ModelFactory, recorder: Recorder
) -> None:
    from recovery.child import recover_child
    from recovery.scan import scan
    from tests.helpers import expire_leases

    model = model_factory(child_script(call("lookup", amount=3)))
    recorder.crash_always.add("lookup")
    sid = crashed_child(model.base_url)
    deps = loop_deps(model.base_url, RecordingScheduler())
    for _ in range(8):  # a poison round would be recovered on every lap, for ever
        expire_leases()
        scan(deps.scheduler, callback_grace_seconds=0)
        if not deps.scheduler.recoveries:
            break
        _, _, reserved = deps.scheduler.recoveries.pop(0)
        for eid, e in reserved:
            try:
                recover_child(eid, e, deps)
            except InjectedKill:
                pass
    drive(model.base_url, deps=deps)
    assert len(recorder.starts) == 1 + 3  # the first run and TOOL_MAX_RERUNS re-runs
    assert asked(model, 2) == 1
    (e,) = executions_of(sid)
    assert (e.status, e.delivery_status) == ("COMPLETED", "DELIVERED")
    tool_row = next(m for m in messages_of(e.child_session_id) if m.role == "TOOL")
    assert "may or may not have taken effect" in (tool_row.content or "")
    assert invariants() == []
