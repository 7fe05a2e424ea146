"""Delivery (docs/tasks.md, "Delivery"): a parent's results are delivered in one transaction, exactly once.

First the end-to-end cases (R3, R9, R10, R23, R24 and duplicate messages), driven in-process on
real PostgreSQL + Redis with the scripted model: a "crash" is what a dead worker leaves in the
database, every lease lapses and the real scan -> recover_child -> deliver_round -> agent loop
code runs; each ends with invariants I1–I5 over the whole database. Then the delivery status
rules of the execution row (mark_delivered, set_delivery_status) and the races on them.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import select, update

from crashpoints import InjectedFault, armed_fault
from harness.child import start_child
from harness.delivery import deliver_round
from harness.parent import run_agent
from models import (
    AgentSession,
    DeliveryStatus,
    ExecutionStatus,
    IllegalTransition,
    Message,
    PendingRound,
    Phase,
    Role,
    SubagentExecution,
    transaction,
)
from models.execution import (
    finish_execution,
    mark_delivered,
    set_delivery_status,
)
from recovery.child import recover_child
from recovery.ops import RedeliverOutcome, redeliver_parent
from recovery.scan import scan
from tests.helpers import (
    MAIN,
    TWO,
    TWO_CHILDREN,
    RecordingScheduler,
    add_message,
    children_done_delivery_lost,
    drive,
    execution_row,
    executions_of,
    expire_leases,
    invariants,
    loop_deps,
    make_execution,
    make_session,
    messages_of,
    one_child_script,
    parent_yielded,
    rule_calls,
    yielded_with_children,
)
from tests.types import ModelFactory


@pytest.fixture(autouse=True)
def _db(db: str) -> None:
    pass


@pytest.mark.parametrize("attempt", range(4))
def test_r3_two_recovered_siblings_finishing_at_the_same_moment_deliver_the_round_exactly_once(
    model_factory: Any, attempt: int
) -> None:
    """Both children of a recovered round end at once (threads released by a barrier): their
    finishing transactions serialize on the parent row, exactly one of them sees the round
    complete and delivers it, and the parent is resumed once."""
    model = model_factory(TWO)
    sid, _ = parent_yielded(model.base_url)
    expire_leases()
    sched = RecordingScheduler()
    deps = loop_deps(model.base_url, sched)
    scan(sched, callback_grace_seconds=0)
    ((_, _, children),) = sched.recoveries
    barrier = threading.Barrier(len(children))
    outcomes: list[str] = []

    def finish(eid: int, epoch: int) -> None:
        barrier.wait(timeout=10)
        outcomes.append(recover_child(eid, epoch, deps))

    threads = [threading.Thread(target=finish, args=pair) for pair in children]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert sorted(outcomes) == ["completed", "completed"]
    assert {e.delivery_status for e in executions_of(sid)} == {"DELIVERED"}
    assert len(sched.resumed) == 1, f"resumed {len(sched.resumed)} times"
    assert [m.role for m in messages_of(sid)] == ["USER", "ASSISTANT", "TOOL", "TOOL"]
    assert invariants(settled=False) == []


def test_r9_a_crash_inside_the_delivery_transaction_delivers_once_on_the_next_run(model_factory: ModelFactory) -> None:

    model = model_factory(TWO)
    sid, epoch = children_done_delivery_lost(model.base_url)
    with armed_fault("deliver.mid_round"), pytest.raises(InjectedFault):
        deliver_round(sid, epoch)
    assert [m.role for m in messages_of(sid)] == ["USER"]
    drive(model.base_url)
    assert [m.role for m in messages_of(sid)] == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    assert invariants() == []


def test_r10_a_crash_after_delivery_commit_does_not_deliver_again(model_factory: ModelFactory) -> None:

    model = model_factory(TWO)
    sid, epoch = children_done_delivery_lost(model.base_url)
    with armed_fault("deliver.before_resume"), pytest.raises(InjectedFault):
        deliver_round(sid, epoch)  # committed; the process "died" before enqueueing the parent
    assert {e.delivery_status for e in executions_of(sid)} == {"DELIVERED"}
    delivered = [m.id for m in messages_of(sid)]
    drive(model.base_url)
    msgs = messages_of(sid)
    assert [m.id for m in msgs][: len(delivered)] == delivered
    assert [m.role for m in msgs] == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    assert rule_calls(model, 0) == 1
    assert invariants() == []


def test_r23_results_are_delivered_in_ascending_execution_id_whatever_finished_first(
    model_factory: ModelFactory,
) -> None:
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}}])
    parent = make_session(phase=Phase.RUNNING)
    add_message(parent, Role.USER, "q")
    low = make_execution(parent, status=ExecutionStatus.RUNNING, tool_call_id="call_low")
    high = make_execution(parent, status=ExecutionStatus.RUNNING, tool_call_id="call_high")

    for eid in (high, low):  # the higher id finishes first
        with transaction() as s:
            finish_execution(s, eid, epoch=0, status=ExecutionStatus.COMPLETED, result={"success": True, "id": eid})
        time.sleep(0.01)
    drive(model.base_url)
    tools = [m for m in messages_of(parent) if m.role == Role.TOOL]
    assert [t.tool_call_id for t in tools] == ["call_low", "call_high"]
    assert invariants() == []


def test_the_same_recover_child_and_deliver_round_messages_several_times_deliver_once(
    model_factory: ModelFactory,
) -> None:
    model = model_factory(TWO)
    sid, _ = parent_yielded(model.base_url)
    expire_leases()
    sched = RecordingScheduler()
    deps = loop_deps(model.base_url, sched)
    scan(sched, callback_grace_seconds=0)
    ((_, epoch, children),) = sched.recoveries
    for eid, e in children:
        assert recover_child(eid, e, deps) == "completed"
        assert recover_child(eid, e, deps) == "stale"
        assert recover_child(eid, e, deps) == "stale"
    # The last recovered child delivered the round itself and asked for the parent's run once.
    assert [p for p, _ in sched.resumed] == [sid]
    kinds = [deliver_round(sid, epoch).kind for _ in range(3)]  # late deliver_rounds, three times
    assert kinds == ["stale", "stale", "stale"]
    assert sum(1 for m in messages_of(sid) if m.role == Role.TOOL) == 2
    assert invariants(settled=False) == []


def test_r23_inside_a_pending_round_results_follow_ascending_execution_id(model_factory: ModelFactory) -> None:
    """The round lists call_b before call_a, but call_a's execution is older: its result comes first."""

    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}}])
    parent = make_session(phase=Phase.RUNNING)
    add_message(parent, Role.USER, "q")
    calls = [
        {"id": cid, "type": "function", "function": {"name": "delegate", "arguments": "{}"}}
        for cid in ("call_b", "call_a")
    ]
    with transaction() as s:
        rnd = PendingRound(session_id=parent, assistant_content="", tool_calls=calls, inline_results={})
        s.add(rnd)
        s.flush()
        round_id = rnd.id
    low = make_execution(parent, status=ExecutionStatus.RUNNING, tool_call_id="call_a")
    high = make_execution(parent, status=ExecutionStatus.RUNNING, tool_call_id="call_b")

    with transaction() as s:
        s.execute(
            update(SubagentExecution).where(SubagentExecution.id.in_((low, high))).values(pending_round_id=round_id)
        )
        for eid in (high, low):  # the higher id finishes first
            finish_execution(s, eid, epoch=0, status=ExecutionStatus.COMPLETED, result={"success": True, "id": eid})
    drive(model.base_url)
    tools = [m for m in messages_of(parent) if m.role == Role.TOOL]
    assert [t.tool_call_id for t in tools] == ["call_a", "call_b"]
    assert invariants() == []


@pytest.mark.parametrize("legacy", [False, True], ids=["starts_recorded", "written_before_starts_were_recorded"])
def test_an_inline_call_without_a_result_is_reported_interrupted_when_it_started_and_not_run_when_it_never_did(
    model_factory: ModelFactory, legacy: bool
) -> None:
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "parent continues"}}])
    parent = make_session(phase=Phase.RUNNING)
    add_message(parent, Role.USER, "q")
    calls = [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": '{"order": "A-1"}'}}
        for cid, name in (("c_child", "delegate"), ("c_done", "charge"), ("c_started", "charge"), ("c_never", "charge"))
    ]
    with transaction() as s:
        rnd = PendingRound(
            session_id=parent,
            assistant_content="",
            tool_calls=calls,
            inline_results={"c_done": "charged"},
            inline_started=None if legacy else ["c_done", "c_started"],
        )
        s.add(rnd)
        s.flush()
        round_id = rnd.id
    eid = make_execution(parent, status=ExecutionStatus.RUNNING, tool_call_id="c_child")
    with transaction() as s:
        s.execute(update(SubagentExecution).where(SubagentExecution.id == eid).values(pending_round_id=round_id))
        finish_execution(s, eid, epoch=0, status=ExecutionStatus.COMPLETED, result={"success": True})
    drive(model.base_url)
    told = {m.tool_call_id: m.content or "" for m in messages_of(parent) if m.role == Role.TOOL}
    assert told["c_done"] == "charged"
    assert "may or may not have taken effect" in told["c_started"]
    # A start is committed under the parent's fence before a call runs: a call with none did not run.
    never = "may or may not have taken effect" if legacy else "was not run"
    assert never in told["c_never"] and ("was not run:" in told["c_never"]) is not legacy
    assert invariants() == []


def test_r24_parent_side_delivery_after_a_compaction_boundary_with_deleted_rows(model_factory: ModelFactory) -> None:
    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    calls = [{"id": "old1", "type": "function", "function": {"name": "echo", "arguments": '{"text": "x"}'}}]
    # The round committed before the crash sits before its pending round's delivery; build a
    # compacted parent history with a deleted row and an orphan TOOL in its tail.
    add_message(sid, Role.ASSISTANT, "", tool_calls=calls)
    boundary = add_message(sid, Role.TOOL, "x", tool_call_id="old1")
    deleted = add_message(sid, Role.ASSISTANT, "deleted words")
    orphan = add_message(sid, Role.TOOL, "orphan", tool_call_id="ghost")
    with transaction() as s:
        s.execute(update(Message).where(Message.id == deleted).values(deleted=True))
        s.execute(
            update(AgentSession)
            .where(AgentSession.id == sid)
            .values(compaction_boundary_message_id=boundary, compaction_summary="summary")
        )
    drive(model.base_url)
    live = [m.id for m in messages_of(sid)]
    assert boundary in live and deleted not in live and orphan not in live
    (e,) = executions_of(sid)
    assert e.delivery_status == "DELIVERED" and e.parent_tool_message_id in live
    assert messages_of(sid)[-1].content.startswith("parent done")
    assert invariants() == []


def test_schema_refuses_a_delivered_row_that_is_not_terminal() -> None:
    from sqlalchemy.exc import IntegrityError

    with pytest.raises(IntegrityError):
        make_execution(make_session(), status=ExecutionStatus.RUNNING, delivery=DeliveryStatus.DELIVERED)


@pytest.mark.parametrize("to", [DeliveryStatus.PENDING, DeliveryStatus.LEGACY])
def test_delivery_never_moves_back_to_pending_or_legacy(to: DeliveryStatus) -> None:
    eid = make_execution(
        make_session(), status=ExecutionStatus.COMPLETED, delivery=DeliveryStatus.PENDING, tool_call_id="c"
    )
    with transaction() as s:
        assert mark_delivered(s, eid, assistant_message_id=1, tool_message_id=2)
    with pytest.raises(IllegalTransition), transaction() as s:
        set_delivery_status(s, eid, to)
    assert execution_row(eid).delivery_status == DeliveryStatus.DELIVERED


def test_delivering_an_active_execution_raises_barrier() -> None:
    eid = make_execution(make_session())
    with pytest.raises(IllegalTransition), transaction() as s:
        mark_delivered(s, eid, assistant_message_id=None, tool_message_id=None)


def test_legacy_row_cannot_be_delivered() -> None:
    eid = make_execution(make_session(), status=ExecutionStatus.COMPLETED, delivery=DeliveryStatus.LEGACY)
    with pytest.raises(IllegalTransition), transaction() as s:
        mark_delivered(s, eid, assistant_message_id=None, tool_message_id=None)


def test_second_delivery_of_same_execution_returns_false() -> None:
    eid = make_execution(make_session(), status=ExecutionStatus.COMPLETED)
    with transaction() as s:
        assert mark_delivered(s, eid, assistant_message_id=None, tool_message_id=None)
    with transaction() as s:
        assert not mark_delivered(s, eid, assistant_message_id=None, tool_message_id=None)


def test_two_threads_racing_the_same_delivery_exactly_one_wins() -> None:
    eid = make_execution(make_session(), status=ExecutionStatus.COMPLETED)
    barrier = threading.Barrier(2)
    results: list[bool] = []

    def race() -> None:
        barrier.wait(timeout=5)
        with transaction() as s:
            results.append(mark_delivered(s, eid, assistant_message_id=None, tool_message_id=None))

    threads = [threading.Thread(target=race) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(results) == [False, True]


@pytest.mark.parametrize("attempt", range(3))
def test_two_threads_racing_the_same_round_delivery_write_it_exactly_once(
    model_factory: ModelFactory, attempt: int
) -> None:
    """deliver_round itself (messages, markers, round closed, hand-over), not only its marker."""
    from harness.delivery import deliver_round
    from tests.helpers import children_done_delivery_lost, invariants, messages_of

    script = [
        {
            "when": {"system_contains": "main agent", "turn": 0},
            "reply": {
                "tool_calls": [
                    {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "review A"}},
                    {"name": "delegate", "arguments": {"agent_type": "researcher", "task": "research B"}},
                ]
            },
        },
        {"when": {"system_contains": "subagent"}, "reply": {"content": "child answer"}},
    ]
    model = model_factory(script)
    sid, epoch = children_done_delivery_lost(model.base_url)
    barrier = threading.Barrier(2)
    kinds: list[str] = []

    def race() -> None:
        barrier.wait(timeout=5)
        kinds.append(str(deliver_round(sid, epoch).kind))

    threads = [threading.Thread(target=race) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    assert sorted(kinds) == ["resume", "stale"]
    assert [m.role for m in messages_of(sid)] == ["USER", "ASSISTANT", "TOOL", "TOOL"]
    assert invariants(settled=False) == []


def test_redeliver_of_a_settled_parent_changes_nothing(model_factory: ModelFactory) -> None:
    model = model_factory(TWO)
    sid, epoch, children, deps = yielded_with_children(model.base_url)
    for child in children:
        start_child(*child, deps)  # the last one delivers the round and resumes the parent
    (resumed, new_epoch), *more = deps.scheduler.resumed
    assert resumed == sid and not more and deliver_round(sid, epoch).kind == "stale"
    assert run_agent(sid, new_epoch, deps) == "waiting_user"
    calls = len(model.journal())
    with transaction() as s:
        before = s.execute(select(AgentSession.epoch, AgentSession.phase).where(AgentSession.id == sid)).one()
    sched = RecordingScheduler()
    outcome = redeliver_parent(sid, sched)
    assert outcome == "nothing_pending"
    assert outcome is RedeliverOutcome.NOTHING_PENDING  # a member of the outcome enum, not a bare string
    with transaction() as s:
        after = s.execute(select(AgentSession.epoch, AgentSession.phase).where(AgentSession.id == sid)).one()
    assert tuple(after) == tuple(before) == (before.epoch, Phase.WAITING_USER)
    assert not sched.pending() and len(model.journal()) == calls


def test_same_callback_delivered_twice_delivers_once_and_stale_messages_write_nothing(
    model_factory: ModelFactory,
) -> None:
    model = model_factory(TWO_CHILDREN)
    sid, epoch = children_done_delivery_lost(model.base_url)
    first = deliver_round(sid, epoch)
    assert first.kind == "resume" and first.new_epoch == epoch + 1
    count = len(messages_of(sid))
    assert deliver_round(sid, epoch).kind == "stale"  # the duplicate callback
    assert len(messages_of(sid)) == count
    deps = loop_deps(model.base_url)
    assert run_agent(sid, epoch, deps) == "stale"  # a duplicate agent.run with the old epoch
    assert len(messages_of(sid)) == count
    assert run_agent(sid, first.new_epoch, deps) == "waiting_user"
    assert run_agent(sid, first.new_epoch, deps) == "stale"  # the same message delivered twice
    assert [m.role for m in messages_of(sid)][-1] == "ASSISTANT"
    assert len(messages_of(sid)) == count + 1
    assert invariants() == []


def test_a_delivery_to_a_parent_whose_loop_holds_its_lease_is_parent_busy_and_writes_nothing(
    model_factory: ModelFactory,
) -> None:
    """A loop holds the parent (it has not yielded yet): the delivery says PARENT_BUSY, not
    STALE (the epoch is right), writes nothing, and the same delivery lands once the lease is
    gone."""
    from harness.delivery import DeliveryKind

    model = model_factory(TWO_CHILDREN)
    sid, epoch = children_done_delivery_lost(model.base_url)
    with transaction() as s:
        s.execute(update(AgentSession).where(AgentSession.id == sid).values(lease_owner="busy-loop"))
    busy = deliver_round(sid, epoch)
    assert busy.kind == DeliveryKind.PARENT_BUSY and busy.kind != DeliveryKind.STALE
    assert [m.role for m in messages_of(sid)] == ["USER"]
    assert {e.delivery_status for e in executions_of(sid)} == {"PENDING"}
    with transaction() as s:
        s.execute(update(AgentSession).where(AgentSession.id == sid).values(lease_owner=None))
    landed = deliver_round(sid, epoch)
    assert landed.kind == DeliveryKind.RESUME and landed.new_epoch == epoch + 1
    assert {e.delivery_status for e in executions_of(sid)} == {"DELIVERED"}
    assert invariants(settled=False) == []


def test_a_parents_inline_results_are_one_conditional_update_each_and_a_closed_round_takes_none(
    model_factory: ModelFactory,
) -> None:
    from harness.views import create_session
    from models.base import utcnow
    from models.round import record_inline
    from tests.helpers import recorded_statements

    model = model_factory(
        [
            {
                "when": {"system_contains": MAIN, "turn": 0},
                "reply": {
                    "tool_calls": [
                        {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "t"}},
                        {"name": "echo", "arguments": {"text": "one"}},
                        {"name": "echo", "arguments": {"text": "two"}},
                        {"name": "delegate", "arguments": {"agent_type": "nobody", "task": "t"}},
                    ]
                },
            },
            {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "done"}},
            {"when": {"system_contains": "reviewer subagent"}, "reply": {"content": "reviewed"}},
        ]
    )
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    with recorded_statements() as seen:
        assert run_agent(sid, 0, deps) == "yielded"
    assert not [q for q in seen if "FROM pending_round" in q and "FOR UPDATE" in q]
    recorded = [q for q in seen if q.startswith("UPDATE pending_round SET inline_results") and "closed_at IS NULL" in q]
    assert len(recorded) == 2  # one per inline call, each conditional on the round being open
    with transaction() as s:
        rnd = s.execute(select(PendingRound).where(PendingRound.session_id == sid)).scalar_one()
        results = dict(rnd.inline_results)
    # The refused delegation's error (written with the round) and both inline results are kept.
    assert sorted(results.values())[-2:] == ["one", "two"]
    assert len(results) == 3 and any("nobody" in v for v in results.values())
    with transaction() as s:
        s.execute(update(PendingRound).where(PendingRound.id == rnd.id).values(closed_at=utcnow()))
    with transaction() as s:
        assert record_inline(s, rnd.id, {**results, "late": "x"}) is False
    with transaction() as s:
        kept = s.execute(select(PendingRound.inline_results).where(PendingRound.id == rnd.id)).scalar_one()
    assert "late" not in kept
