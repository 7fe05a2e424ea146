"""Several parents delivered by one task (docs/tasks.md, "Delivery": ``agent.deliver_rounds``).

Each parent is in the state a last child that died before delivering leaves (every child COMPLETED, nothing
delivered: ``children_done_delivery_lost``); one call of ``deliver_rounds`` then gets a batch
of them, as the scan hands them out. Real PostgreSQL and Redis, the scripted model.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import update

from crashpoints import InjectedKill, armed_fault
from harness.delivery import DeliveryKind
from harness.delivery_batch import deliver_rounds, deliver_rounds_and_resume
from models import AgentSession, Phase, transaction
from tests.helpers import (
    TWO,
    RecordingScheduler,
    children_done_delivery_lost,
    drive,
    executions_of,
    invariants,
    messages_of,
    recorded_statements,
)
from tests.types import ModelFactory


@pytest.fixture(autouse=True)
def _db(db: str) -> None:
    pass


def _parents(model: Any, n: int) -> list[tuple[int, int]]:
    return [children_done_delivery_lost(model.base_url, f"job {i}") for i in range(n)]


def _statuses(sid: int) -> set[str]:
    return {str(e.delivery_status) for e in executions_of(sid)}


def _roles(sid: int) -> list[str]:
    return [str(m.role) for m in messages_of(sid)]


def _assert_delivered_once(sid: int) -> None:
    """The parent's history holds its round once: one assistant with both calls, their two
    results, each execution DELIVERED and pointing at them."""
    msgs = messages_of(sid)
    assert [str(m.role) for m in msgs][:4] == ["USER", "ASSISTANT", "TOOL", "TOOL"]
    assert sum(1 for m in msgs if m.tool_calls) == 1
    executions = executions_of(sid)
    assert {str(e.delivery_status) for e in executions} == {"DELIVERED"}
    assert {e.parent_assistant_message_id for e in executions} == {msgs[1].id}
    assert sorted(e.parent_tool_message_id for e in executions) == [msgs[2].id, msgs[3].id]
    assert [json.loads(m.content)["success"] for m in msgs[2:4]] == [True, True]


def test_one_task_delivers_many_parents_once_while_busy_cancelled_and_stale_ones_are_left_alone(
    model_factory: ModelFactory,
) -> None:
    """Five parents in one batch (one of them named twice): the two ready ones are delivered
    and resumed once; a parent a loop holds is PARENT_BUSY, a cancelled one has its results
    SUPPRESSED, one handed with an old epoch is STALE; none of them is written to. The same
    batch again delivers nothing twice, and the busy parent's delivery lands once freed."""
    model = model_factory(TWO)
    (a, ea), (b, eb), (busy, e_busy), (cancelled, e_cancelled), (stale, e_stale) = _parents(model, 5)
    with transaction() as s:
        s.execute(update(AgentSession).where(AgentSession.id == busy).values(lease_owner="busy-loop"))
        s.execute(update(AgentSession).where(AgentSession.id == cancelled).values(phase=Phase.CANCELLED))
    batch = [(a, ea), (b, eb), (busy, e_busy), (cancelled, e_cancelled), (stale, e_stale + 7), (a, ea)]
    sched = RecordingScheduler()

    outcomes = deliver_rounds_and_resume(batch, sched)

    assert {pid: o.kind for pid, o in outcomes.items()} == {
        a: DeliveryKind.RESUME,
        b: DeliveryKind.RESUME,
        busy: DeliveryKind.PARENT_BUSY,
        cancelled: DeliveryKind.SUPPRESSED,
        stale: DeliveryKind.STALE,
    }
    assert sorted(sched.resumed) == sorted([(a, ea + 1), (b, eb + 1)])
    for sid in (a, b):
        _assert_delivered_once(sid)
    for sid in (busy, cancelled, stale):
        assert _roles(sid) == ["USER"]
    assert _statuses(busy) == _statuses(stale) == {"PENDING"}
    assert _statuses(cancelled) == {"SUPPRESSED"}

    again = deliver_rounds_and_resume(batch, sched)
    assert again[a].kind == again[b].kind == DeliveryKind.STALE
    assert len(sched.resumed) == 2
    for sid in (a, b):
        _assert_delivered_once(sid)

    with transaction() as s:
        s.execute(update(AgentSession).where(AgentSession.id == busy).values(lease_owner=None))
    assert deliver_rounds([(busy, e_busy), (stale, e_stale + 7)])[busy].kind == DeliveryKind.RESUME
    _assert_delivered_once(busy)
    assert invariants(settled=False) == []


def test_a_batch_delivers_its_parents_in_one_transaction_of_as_many_statements_for_two_as_for_five(
    model_factory: ModelFactory,
) -> None:
    """The common case of every parent of a batch is ONE transaction whose statements do not
    grow with the number of parents (one per step, not one per parent)."""
    model = model_factory(TWO)
    two, five = _parents(model, 2), _parents(model, 5)
    with recorded_statements() as for_two:
        assert {o.kind for o in deliver_rounds(two).values()} == {DeliveryKind.RESUME}
    with recorded_statements() as for_five:
        assert {o.kind for o in deliver_rounds(five).values()} == {DeliveryKind.RESUME}
    assert len(for_five) == len(for_two), (for_two, for_five)
    for sid, _ in two + five:
        _assert_delivered_once(sid)
    assert invariants(settled=False) == []


def test_when_the_batch_transaction_fails_each_parent_is_delivered_alone_exactly_once(
    model_factory: ModelFactory,
) -> None:
    """A fault inside the batch's transaction rolls all of it back; every parent is then
    delivered on its own (a parent whose history can never be legal is stopped there), and
    none of the others' results is lost or written twice."""
    model = model_factory(TWO)
    (a, ea), (bad, e_bad), (c, ec) = _parents(model, 3)
    with transaction() as s:
        s.execute(update(AgentSession).where(AgentSession.id == bad).values(compaction_boundary_message_id=10**9))
    with armed_fault("deliver.batch_mid_round"):
        outcomes = deliver_rounds([(a, ea), (bad, e_bad), (c, ec)])
    assert {pid: o.kind for pid, o in outcomes.items()} == {
        a: DeliveryKind.RESUME,
        bad: DeliveryKind.STOPPED,
        c: DeliveryKind.RESUME,
    }
    for sid in (a, c):
        _assert_delivered_once(sid)
    assert _statuses(bad) == {"SUPPRESSED"} and _roles(bad) == ["USER"]
    assert invariants(settled=False) == []


def test_a_crash_inside_the_batch_transaction_writes_nothing_and_the_next_delivery_lands_once(
    model_factory: ModelFactory,
) -> None:
    """The worker dies inside the batch's transaction (crash point deliver.batch_mid_round):
    nothing of any parent is written; the scan then delivers each round once and every parent
    answers."""
    model = model_factory(TWO)
    parents = _parents(model, 3)
    with armed_fault("deliver.batch_mid_round", kill=True), pytest.raises(InjectedKill):
        deliver_rounds(parents)
    for sid, _ in parents:
        assert _roles(sid) == ["USER"]
        assert _statuses(sid) == {"PENDING"}
    drive(model.base_url)
    for sid, _ in parents:
        _assert_delivered_once(sid)
        assert _roles(sid) == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    assert invariants() == []


def test_a_crash_between_the_parents_a_batch_runs_itself_loses_none_and_runs_none_twice(
    model_factory: ModelFactory,
) -> None:
    """agent.deliver_rounds runs the parents it handed over in its own process (ResumeHere);
    the process dies before the second one's run (crash point deliver.before_run_here): the
    first has answered, the others were handed over (delivered once, RUNNING under a
    reservation) and never run. Once the reservation lapses the scan resumes each of them;
    every parent answers once and no round is delivered twice."""
    from harness.parent import run_agent
    from tasks.scheduler import ResumeHere
    from tests.helpers import loop_deps

    model = model_factory(TWO)
    parents = _parents(model, 3)
    deps = loop_deps(model.base_url)
    here = ResumeHere(deps.scheduler)
    outcomes = deliver_rounds_and_resume(parents, here)
    assert sorted(outcomes) == sorted(sid for sid, _ in parents)
    with armed_fault("deliver.before_run_here", on_hit=2, kill=True), pytest.raises(InjectedKill):
        here.run_kept(lambda pid, epoch: run_agent(pid, epoch, deps))
    (first, _), *rest = sorted(parents)
    assert _roles(first) == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    assert not deps.scheduler.resumed  # nothing was sent: the others wait for the scan
    for sid, _ in rest:
        _assert_delivered_once(sid)
        assert _roles(sid) == ["USER", "ASSISTANT", "TOOL", "TOOL"]
    drive(model.base_url)
    for sid, _ in parents:
        _assert_delivered_once(sid)
        assert _roles(sid) == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    assert invariants() == []
