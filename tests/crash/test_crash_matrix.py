"""The crash matrix: every named crash point × every delegation shape.

Each trial runs a real 2-process worker with CRASH_POINT armed; the pool process that reaches
the point exits with os._exit(137); the test then SIGKILLs the whole worker (main process and
pool) — its unacked broker messages are stranded, as after a machine loss — starts a fresh
worker with its beat, and checks that the parent ends with every result delivered exactly once,
the same child sessions and executions, and invariants I1–I7 over the whole database.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from models import AgentSession, SessionType, SubagentExecution, transaction
from tests.helpers import executions_of, messages_of, wait_until
from tests.types import StackFactory

pytestmark = [pytest.mark.crash, pytest.mark.timeout(150)]

MAIN = "main agent"
AGENTS_LOCAL = str(Path(__file__).resolve().parent.parent / "data" / "agents_local.toml")

CHILD_RULES: list[dict[str, Any]] = [
    # Every child instruction starts with one tool round (a 1 s wait), then answers.
    {
        "when": {"system_contains": "subagent", "last_role": "user"},
        "reply": {"tool_calls": [{"name": "wait", "arguments": {"seconds": 1}}]},
    },
    {"when": {"system_contains": "subagent", "last_role": "tool"}, "reply": {"content": "child answer to {user}"}},
]


ECHO: dict[str, Any] = {"name": "echo", "arguments": {"text": "inline"}}


def delegate(agent: str, task: str) -> dict[str, Any]:
    return {"name": "delegate", "arguments": {"agent_type": agent, "task": task}}


@dataclass(frozen=True)
class Shape:
    name: str
    script: list[dict[str, Any]]
    executions: int
    children: int
    parent_rounds: int  #: assistant tool-call rounds in the parent's final history
    occurrence: int = 1  #: which occurrence of the point to crash at (followup: the second round)
    local: bool = False
    #: Rules (script indexes) with a tool-call reply that the model must answer exactly once:
    #: a journaled reply is never asked for again.
    asked_once: tuple[int, ...] = ()


def _parent(*rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rules = [
        {"when": {"system_contains": MAIN, "turn": i}, "reply": {"tool_calls": calls}} for i, calls in enumerate(rounds)
    ]
    rules.append({"when": {"system_contains": MAIN, "turn": len(rounds)}, "reply": {"content": "final answer"}})
    return rules + CHILD_RULES


SHAPES = {
    "one_child": Shape("one_child", _parent([delegate("reviewer", "review A")]), 1, 1, 1),
    "two_children": Shape(
        "two_children", _parent([delegate("reviewer", "review A"), delegate("researcher", "research B")]), 2, 2, 1
    ),
    "mixed_inline": Shape(
        "mixed_inline",
        _parent(
            [
                delegate("reviewer", "review A"),
                {"name": "echo", "arguments": {"text": "inline"}},
                delegate("researcher", "research B"),
            ]
        ),
        2,
        2,
        1,
        asked_once=(0,),
    ),
    "followup": Shape(
        "followup",
        _parent(
            [delegate("reviewer", "review A")],
            [{"name": "delegate_followup", "arguments": {"child_session_id": 2, "task": "look again"}}],
        ),
        2,
        1,
        2,
        occurrence=2,
    ),
    "local_child": Shape("local_child", _parent([delegate("desktop", "check the local files")]), 1, 1, 1, local=True),
}

#: Shapes only the round journal's points use, beside the matrix's own. The
#: parent's delegating reply is committed first (with its children: its pending round is its
#: journal entry): the child's reply is the second occurrence in one pool process (concurrency 1).
JOURNAL_SHAPES = {
    "child_reply": Shape(
        "child_reply", _parent([delegate("reviewer", "review A")]), 1, 1, 1, occurrence=2, asked_once=(0, 2)
    ),
    "child_two_tools": Shape(
        "child_two_tools",
        [
            *_parent([delegate("reviewer", "review A")])[:2],
            {
                "when": {"system_contains": "subagent", "last_role": "user"},
                "reply": {"tool_calls": [{"name": "wait", "arguments": {"seconds": 1}}, ECHO]},
            },
            CHILD_RULES[1],
        ],
        1,
        1,
        1,
        asked_once=(0, 2),
    ),
    "parent_inline_first": Shape(
        "parent_inline_first",
        _parent([{"name": "wait", "arguments": {"seconds": 1}}, ECHO], [delegate("reviewer", "review A")]),
        1,
        1,
        2,
        asked_once=(0, 1),
    ),
}

#: Provider ids as real providers send them: ``call_0`` in every reply (parent and child),
#: and ids far over 128 characters (a signature carried in the id). Every call gets a local id
#: when its reply is journaled: the child's second ``wait`` under ``call_0`` is a new call, and
#: the parent's round after delivery reuses its delegation's id.
LONG_ID = "call_" + "thought-signature/" * 12


def _call(name: str, call_id: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments, "id": call_id}


def _provider_ids_shape(name: str, call_id: str) -> Shape:
    return Shape(
        name,
        [
            {
                "when": {"system_contains": MAIN, "turn": 0},
                "reply": {"tool_calls": [_call("delegate", call_id, agent_type="reviewer", task="review A")]},
            },
            {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"tool_calls": [_call("echo", call_id, text="x")]}},
            {"when": {"system_contains": MAIN, "turn": 2}, "reply": {"content": "final answer"}},
            {
                "when": {"system_contains": "subagent", "turn": 0},
                "reply": {"tool_calls": [_call("wait", call_id, seconds=1)]},
            },
            {
                "when": {"system_contains": "subagent", "turn": 1},
                "reply": {"tool_calls": [_call("wait", call_id, seconds=0)]},
            },
            {"when": {"system_contains": "subagent", "turn": 2}, "reply": {"content": "child answer"}},
        ],
        1,
        1,
        2,
        asked_once=(0, 1, 3, 4),
    )


JOURNAL_SHAPES["reused_call_0"] = _provider_ids_shape("reused_call_0", "call_0")
JOURNAL_SHAPES["long_id"] = _provider_ids_shape("long_id", LONG_ID)

POINTS = [
    "delegate.after_create",
    "child.mid_tool",
    "child.after_final",
    "deliver.mid_round",
    "deliver.before_resume",
    "parent.after_resume",
]


def _arm(shape: Shape, point: str) -> tuple[dict[str, str], int]:
    """Environment of the crashing worker and its concurrency. parent.after_resume is first
    reached when the parent starts: crash at its next occurrence (the resume after delivery)."""
    after = shape.occurrence + (1 if point == "parent.after_resume" else 0)
    concurrency = 2 if after == 1 else 1  # counts are per process: one pool process then
    return {"CRASH_POINT": point, "CRASH_POINT_AFTER": str(after)}, concurrency


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_crash_at_point_then_recovery_delivers_exactly_once(
    stack_factory: StackFactory, monkeypatch: pytest.MonkeyPatch, shape_name: str, point: str
) -> None:
    crash_trial(stack_factory, monkeypatch, shape_name, point)


#: Points that only some shapes reach: each with one shape that does.
SHAPED_POINTS = [
    ("parent.mid_inline", "mixed_inline"),
    ("parent.before_yield", "mixed_inline"),
    ("child.after_take", "two_children"),
    ("child.after_round", "one_child"),
    ("deliver.before_run_here", "two_children"),  # the last child's task delivered, the parent's run here not started
    ("journal.after_reply", "mixed_inline"),  # the parent's delegating reply, committed with its children
    ("journal.after_reply", "child_reply"),  # a child's reply: its round continues, no model call
    ("journal.after_tool_start", "one_child"),  # the child's ``wait`` (not idempotent) started
    ("journal.after_tool_result", "child_two_tools"),  # the child's first result journaled
    ("journal.after_tool_result", "parent_inline_first"),  # a parent inline round's first result
    ("journal.after_tool_start", "reused_call_0"),  # the child's first ``wait`` as call_0 started
    ("journal.after_tool_start", "long_id"),  # the child's first ``wait`` under a 221-character id
]


@pytest.mark.parametrize(("point", "shape_name"), SHAPED_POINTS)
def test_crash_at_a_shape_specific_point_then_recovery_delivers_exactly_once(
    stack_factory: StackFactory, monkeypatch: pytest.MonkeyPatch, shape_name: str, point: str
) -> None:
    crash_trial(stack_factory, monkeypatch, shape_name, point)


#: On a threads pool (the Procfile's ``worker``: many loops per process, a crash ends them all):
#: every point of the matrix with the two-children shape, and the shape-specific points whose
#: crash lands inside a tool or between two children. Not the whole matrix: each trial boots
#: two workers, and the points' commit boundaries are the same code on either pool; what the
#: pool changes (one process for every loop, counts per process) these cover.
THREADS_TRIALS = [(point, "two_children") for point in POINTS] + [
    ("child.after_take", "two_children"),
    ("deliver.before_run_here", "two_children"),
    ("journal.after_tool_start", "one_child"),
]


@pytest.mark.parametrize(("point", "shape_name"), THREADS_TRIALS)
def test_on_a_threads_pool_a_crash_at_point_then_recovery_delivers_exactly_once(
    stack_factory: StackFactory, monkeypatch: pytest.MonkeyPatch, shape_name: str, point: str
) -> None:
    crash_trial(stack_factory, monkeypatch, shape_name, point, pool="threads")


def crash_trial(
    stack_factory: StackFactory, monkeypatch: pytest.MonkeyPatch, shape_name: str, point: str, *, pool: str = "prefork"
) -> None:
    shape = {**SHAPES, **JOURNAL_SHAPES}[shape_name]
    stack = stack_factory(shape.script)
    extra = {"AGENTS_FILE": AGENTS_LOCAL} if shape.local else {}
    if shape.local:
        from harness import events, presence
        from settings import get_settings

        monkeypatch.setenv("AGENTS_FILE", AGENTS_LOCAL)
        get_settings.cache_clear()
        events._redis.cache_clear()
        presence.connect("cli")
    armed, concurrency = _arm(shape, point)
    if pool == "threads":
        concurrency = 8  # one process counts every loop's hits: any concurrency keeps the N-th
    w1 = stack.worker("w1", concurrency=concurrency, pool=pool, **armed, **extra)
    sid = stack.submit("please work", agent="main")
    wait_until(lambda: f"crash_point={point}" in w1.log() or w1.exited, timeout=60, what=f"crash at {point}")
    assert f"crash_point={point}" in w1.log()
    w1.kill()
    before = [(e.id, e.child_session_id) for e in executions_of(sid)]

    stack.worker("w2", beat=True, pool=pool, concurrency=8 if pool == "threads" else 2, **extra)
    snap = stack.wait_phase(sid, timeout=100)

    execs = executions_of(sid)
    assert [(e.id, e.child_session_id) for e in execs][: len(before)] == before  # I4: reused
    assert len(execs) == shape.executions
    assert {(e.status, e.delivery_status) for e in execs} == {("COMPLETED", "DELIVERED")}
    with transaction() as s:
        subagents = s.execute(select(AgentSession.id).where(AgentSession.session_type == SessionType.SUBAGENT)).all()
        assert len(subagents) == shape.children
        assert len(s.execute(select(SubagentExecution.id)).all()) == shape.executions
    rounds = [m for m in messages_of(sid) if m.role == "ASSISTANT" and m.tool_calls]
    assert len(rounds) == shape.parent_rounds
    assert snap["messages"][-1]["content"] == "final answer"
    asked = stack.model.journal()
    for rule in shape.asked_once:
        assert sum(1 for j in asked if j["rule"] == rule) == 1, f"rule {rule} asked again"
    assert stack.invariants() == []


#: Points inside recovery itself: the scan's take, the child's recovery take, the step between
#: two children of a round's recovery message, and a delivery and a child end run by the
#: recovering worker.
RECOVERY_POINTS = [
    "scan.after_take_parent",
    "recover.after_take",
    "recover.between_children",
    "child.after_final",
    "deliver.mid_round",
]


def _all_executions(parent_id: int, condition: Any) -> bool:
    """Every execution of ``parent_id`` meets ``condition`` (SQL on SubagentExecution)."""
    with transaction() as s:
        total, meeting = s.execute(
            select(func.count(), func.count().filter(condition)).where(SubagentExecution.parent_session_id == parent_id)
        ).one()
    return total > 0 and meeting == total


def _all_leases_lapsed(parent_id: int) -> bool:
    """Every execution of ``parent_id`` is free to take over (models.worker.lease_free, in the
    database's time)."""
    from models.worker import lease_free

    return _all_executions(parent_id, lease_free(SubagentExecution))


def _all_taken(parent_id: int) -> bool:
    """Every execution of ``parent_id`` was taken at least once (its epoch moved past creation)."""
    return _all_executions(parent_id, SubagentExecution.epoch >= 1)


@pytest.mark.parametrize("point", RECOVERY_POINTS)
def test_a_crash_during_recovery_then_a_second_restart_delivers_exactly_once(
    stack_factory: StackFactory, point: str
) -> None:
    """Two restarts. The first worker dies mid-tool; the worker that recovers dies
    at ``point`` inside the recovery; a third worker finishes it, exactly once."""
    shape = SHAPES["two_children"]
    stack = stack_factory(shape.script)
    w1 = stack.worker("w1", CRASH_POINT="child.mid_tool")
    sid = stack.submit("please work", agent="main")
    wait_until(lambda: "crash_point=child.mid_tool" in w1.log() or w1.exited, timeout=60, what="first crash")
    if point == "recover.between_children":
        # Both children must have been taken by w1 before it dies. A child whose message w1 had not
        # fetched yet stays queued: w2's one pool process runs that message before its boot scan,
        # the scan finds the other child alone, and no batch of two is sent (a CI run failed so).
        wait_until(lambda: _all_taken(sid), timeout=60, what="both children taken by w1")
    w1.kill()
    before = [(e.id, e.child_session_id) for e in executions_of(sid)]
    slow: dict[str, str] = {}
    if point == "recover.between_children":
        # The point lies between two children of ONE batch. Both must be dead to w2's first pass,
        # or each goes out alone when its own lease lapses (taken and renewed at different times:
        # on a loaded machine, seconds apart); and a cold pool process may take longer than the
        # batch's pass-on window for its first child, which would send the second on alone.
        wait_until(lambda: _all_leases_lapsed(sid), timeout=60, what="both children's leases lapsed")
        slow = {"RECOVERY_BATCH_PASS_ON_SECONDS": "60"}
    w2 = stack.worker("w2", beat=True, concurrency=1, CRASH_POINT=point, **slow)
    try:
        wait_until(lambda: f"crash_point={point}" in w2.log() or w2.exited, timeout=60, what=f"crash at {point}")
    except AssertionError:
        for w in (w1, w2):
            print(f"---- {w.log_path}\n{w.log()[-4000:]}")
        raise
    assert f"crash_point={point}" in w2.log()
    w2.kill()
    stack.worker("w3", beat=True)
    snap = stack.wait_phase(sid, timeout=100)
    execs = executions_of(sid)
    assert [(e.id, e.child_session_id) for e in execs] == before  # I4 across both restarts
    assert {(e.status, e.delivery_status) for e in execs} == {("COMPLETED", "DELIVERED")}
    rounds = [m for m in messages_of(sid) if m.role == "ASSISTANT" and m.tool_calls]
    assert len(rounds) == 1 and snap["messages"][-1]["content"] == "final answer"
    assert sum(1 for j in stack.model.journal() if j["rule"] == 0) == 1  # never delegated again
    assert stack.invariants() == []
