"""Several parents delivered by one task (docs/tasks.md, "Delivery": ``agent.deliver_rounds``).

Each parent is in the state a last child that died before delivering leaves (every child COMPLETED, nothing
delivered: ``children_done_delivery_lost``); one call of ``deliver_rounds`` then gets a batch
of them, as the scan hands them out. Real PostgreSQL and Redis, the scripted model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import pytest
from sqlalchemy import event, text, update
from sqlalchemy.exc import OperationalError

from crashpoints import InjectedKill, armed_fault
from harness.delivery import DeliveryKind
from harness.delivery_batch import deliver_rounds, deliver_rounds_and_resume
from models import AgentSession, Phase, get_engine, transaction
from tests.faultproxy import FaultProxy
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


# --- one parent's fault never holds back the runs of the parents the batch delivered ---------


@contextmanager
def _lock_waits_cut_after(ms: int) -> Iterator[None]:
    """Every transaction of this process waits at most ``ms`` for a row lock (the engine's
    own bound is half a lease): a lock another connection holds ends the statement with a
    lock timeout (SQLSTATE 55P03) soon."""
    engine = get_engine()

    def bound(conn: Any) -> None:
        conn.exec_driver_sql(f"SET LOCAL lock_timeout = {ms}")

    event.listen(engine, "begin", bound)
    try:
        yield
    finally:
        event.remove(engine, "begin", bound)


@contextmanager
def _row_held(parent_id: int) -> Iterator[None]:
    """Another connection holds the parent's row (FOR UPDATE) meanwhile."""
    holder = get_engine().connect()
    holder.begin()
    holder.execute(text(f"SELECT id FROM agent_session WHERE id = {parent_id} FOR UPDATE"))
    try:
        yield
    finally:
        holder.rollback()
        holder.close()


def test_a_parent_whose_delivery_times_out_on_its_lock_holds_back_none_of_the_runs_the_batch_handed_over(
    model_factory: ModelFactory,
) -> None:
    """Another path holds one parent's row: the batch passes it over (SKIP LOCKED) and delivers
    the two others; that parent's own delivery then ends in a lock timeout. The call still
    raises it, but only after the two parents it handed over were sent their runs: they do
    not wait two leases and a scan. The locked parent is delivered once by a later call."""
    model = model_factory(TWO)
    (a, ea), (locked, e_locked), (c, ec) = _parents(model, 3)
    sched = RecordingScheduler()
    with _row_held(locked), _lock_waits_cut_after(200), pytest.raises(OperationalError) as raised:
        deliver_rounds_and_resume([(a, ea), (locked, e_locked), (c, ec)], sched)
    assert getattr(raised.value.orig, "pgcode", None) == "55P03"
    assert sorted(sched.resumed) == sorted([(a, ea + 1), (c, ec + 1)])
    for sid in (a, c):
        _assert_delivered_once(sid)
    assert _roles(locked) == ["USER"] and _statuses(locked) == {"PENDING"}
    assert deliver_rounds_and_resume([(locked, e_locked)], sched)[locked].kind == DeliveryKind.RESUME
    _assert_delivered_once(locked)
    assert invariants(settled=False) == []


def test_the_batch_task_runs_the_parents_it_handed_over_before_it_raises_another_parents_lock_timeout(
    model_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task ``agent.deliver_rounds`` on a worker that serves agent loops runs the parents it
    handed over itself (ResumeHere): a lock timeout of another parent of its batch does not
    skip those runs."""
    import tasks.agent as agent_tasks

    ran: list[tuple[int, int]] = []
    monkeypatch.setattr(agent_tasks, "run_parent", lambda pid, epoch: ran.append((pid, epoch)) or "done")
    monkeypatch.setattr(agent_tasks, "serves_loops", lambda: True)
    model = model_factory(TWO)
    (a, ea), (locked, e_locked), (c, ec) = _parents(model, 3)
    with _row_held(locked), _lock_waits_cut_after(200), pytest.raises(OperationalError):
        agent_tasks.deliver_rounds_task.run([[a, ea], [locked, e_locked], [c, ec]])
    assert sorted(ran) == sorted([(a, ea + 1), (c, ec + 1)])


@pytest.mark.parametrize("when", ["after", "before"])
def test_a_batch_whose_commit_lands_but_whose_acknowledgement_is_lost_sends_every_run_it_handed_over(
    model_factory: ModelFactory, db: str, monkeypatch: pytest.MonkeyPatch, when: Literal["after", "before"]
) -> None:
    """The batch's COMMIT reaches PostgreSQL, which commits it, but the connection dies before
    the answer comes back (tests/faultproxy.py, ``cut_on(b"COMMIT", when="after")``): the
    batch's task cannot tell from the error whether it landed. It finds out, and sends each
    parent it handed over its run (not STALE, not a wait of two leases and a scan); nothing is
    delivered twice. When the COMMIT never reached the server (``when="before"``), each parent
    is delivered on its own instead, with the same outcome."""
    import harness.delivery_batch as batch_module

    model = model_factory(TWO)
    parents = _parents(model, 3)
    sched = RecordingScheduler()
    with FaultProxy.for_url(db) as proxy:
        proxied = proxy.rewrite(db)
        monkeypatch.setattr(batch_module, "transaction", lambda: transaction(proxied))
        proxy.cut_on(b"COMMIT", when=when)
        try:
            outcomes = deliver_rounds_and_resume(parents, sched)
        finally:
            get_engine(proxied).dispose()
        assert proxy.stats().pattern_hits == 1
    assert {pid: o.kind for pid, o in outcomes.items()} == {sid: DeliveryKind.RESUME for sid, _ in parents}
    assert sorted(sched.resumed) == sorted((sid, epoch + 1) for sid, epoch in parents)
    for sid, _ in parents:
        _assert_delivered_once(sid)
    assert invariants(settled=False) == []
