"""Fencing (docs/invariants.md I6, harness/fence.py): every write of a running loop carries its epoch.

The fence is checked inside the write's own transaction: a stale epoch raises LeaseLost and a
stopped session raises Cancelled, and either way the whole write rolls back. These tests write a
message and check the fence in one transaction, then look at what committed. The heartbeat
renews a lease only while its holder's database calls come back.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from harness.errors import Cancelled
from harness.fence import ExecutionFence, Heartbeat, SessionFence
from harness.history import append_message
from harness.parent import run_agent
from harness.views import create_session
from models import (
    AgentSession,
    ExecutionStatus,
    LeaseLost,
    Phase,
    Role,
    transaction,
)
from models.execution import take_execution
from models.session import hand_over, request_cancel, take_session
from tests.helpers import (
    MAIN,
    TWO,
    RecordingScheduler,
    execution_row,
    executions_of,
    expire_leases,
    loop_deps,
    make_execution,
    make_session,
    messages_of,
    wait_until,
)
from tests.types import ModelFactory


@pytest.fixture(autouse=True)
def _db(db: str) -> None:
    pass


def _taken_session() -> int:
    """A RUNNING session taken by "w1": epoch 1 with a live lease."""
    sid = make_session(phase=Phase.RUNNING)
    with transaction() as s:
        assert take_session(s, sid, expected_epoch=0, owner="w1", lease_seconds=30, to_phase=Phase.RUNNING) == 1
    return sid


def _write(s: Session, session_id: int) -> None:
    append_message(s, session_id, Role.ASSISTANT, "a write the fence must guard")
    s.flush()


def test_a_stale_session_epochs_write_raises_lease_lost_and_rolls_back() -> None:
    sid = _taken_session()
    with transaction() as s:  # the holder of epoch 1 hands the session on: epoch 2
        assert hand_over(s, sid, epoch=1, to_phase=Phase.RUNNING) == 2
    fence = SessionFence(session_id=sid, epoch=1, lease_seconds=30)
    with pytest.raises(LeaseLost), transaction() as s:
        _write(s, sid)
        fence.check(s)
    assert messages_of(sid) == []
    assert fence.lost and fence.should_stop()


def test_a_cancel_makes_the_session_fence_raise_cancelled_inside_the_writes_transaction() -> None:
    sid = _taken_session()
    with transaction() as s:
        assert request_cancel(s, sid)
    fence = SessionFence(session_id=sid, epoch=1, lease_seconds=30)
    with pytest.raises(Cancelled), transaction() as s:
        _write(s, sid)
        fence.check(s)
    assert messages_of(sid) == []
    assert not fence.lost and fence.should_stop()


def test_the_session_fence_of_the_current_epoch_lets_the_write_commit() -> None:
    sid = _taken_session()
    fence = SessionFence(session_id=sid, epoch=1, lease_seconds=30)
    with transaction() as s:
        _write(s, sid)
        fence.check(s)
    assert [m.role for m in messages_of(sid)] == [Role.ASSISTANT]
    assert not fence.lost


def test_a_stale_execution_epochs_write_raises_lease_lost_and_rolls_back_its_tokens_too() -> None:
    eid = make_execution(make_session())
    child = execution_row(eid).child_session_id
    with transaction() as s:
        assert (
            take_execution(s, eid, expected_epoch=0, to_status=ExecutionStatus.RECOVERING, owner="w1", lease_seconds=30)
            == 1
        )
    expire_leases()  # w1 stalls past its lease
    with transaction() as s:  # a newer recovery takes it over: epoch 2
        assert (
            take_execution(s, eid, expected_epoch=1, to_status=ExecutionStatus.RECOVERING, owner="w2", lease_seconds=30)
            == 2
        )
    fence = ExecutionFence(session_id=child, epoch=1, lease_seconds=30, execution_id=eid)
    with pytest.raises(LeaseLost), transaction() as s:
        _write(s, child)
        fence.check(s, prompt_tokens=5, completion_tokens=7)
    assert messages_of(child) == []
    row = execution_row(eid)
    assert (row.epoch, row.prompt_tokens, row.completion_tokens) == (2, 0, 0)
    assert fence.lost and fence.renew() is False


def test_a_cancel_fences_a_parent_in_the_middle_of_a_round(model_factory: ModelFactory) -> None:
    """The cancel lands while the model is answering: the round is not committed, no child."""
    model = model_factory(
        [{"when": {"system_contains": MAIN}, "delay_seconds": 1.5, "reply": TWO[0]["reply"]}, *TWO[1:]]
    )
    import threading

    from harness.cancel import cancel_session

    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    timer = threading.Timer(0.5, cancel_session, args=(sid,))
    timer.start()
    outcome = run_agent(sid, 0, deps)
    timer.join()
    assert outcome == "cancelled"
    assert executions_of(sid) == [] and [m.role for m in messages_of(sid)] == ["USER"]


def test_a_session_lease_lapses_while_its_holders_statement_has_been_in_flight_past_half_a_lease() -> None:
    """The holder's statement does not come back (here it sleeps on the server, as a frozen
    connection would never answer): its heartbeat stops renewing, the lease lapses in the
    database's time while the statement is still in flight, and the scan may take the work."""
    lease_seconds = 3.0
    sid = make_session(phase=Phase.RUNNING)
    with transaction() as s:
        assert take_session(s, sid, expected_epoch=0, owner="w1", lease_seconds=lease_seconds, to_phase=Phase.RUNNING)
    fence = SessionFence(session_id=sid, epoch=1, lease_seconds=lease_seconds)
    began = time.monotonic()

    def holder() -> None:
        with Heartbeat(fence), transaction() as s:
            s.execute(text("SELECT pg_sleep(:t)"), {"t": 2.5 * lease_seconds})

    stuck = threading.Thread(target=holder, daemon=True)
    stuck.start()

    def lapsed() -> bool:
        with transaction() as s:
            until = s.execute(select(AgentSession.lease_expires_at).where(AgentSession.id == sid)).scalar_one()
            return bool(s.execute(select(text("now() > :until")), {"until": until}).scalar_one())

    try:
        # Renewed at most until half a lease into the call, so lapsed within 1.5 leases of it.
        wait_until(lapsed, timeout=2 * lease_seconds, interval=0.1, what="the stuck holder's lease lapsed")
        assert stuck.is_alive(), "the statement is still in flight"
        assert time.monotonic() - began >= lease_seconds  # not before a whole lease had passed
        assert not fence.lost
    finally:
        stuck.join(4 * lease_seconds)


def test_a_session_lease_lapses_while_a_cancel_poll_of_its_fence_on_a_tools_thread_is_frozen(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop waits for its tool (no database call of its own), and the tool polls the fence
    (``ctx.should_stop``) on its own thread over a connection that froze: that poll is the
    holder's database work too, so its heartbeat stops renewing and the lease lapses."""
    from settings import get_settings
    from tests.faultproxy import FaultProxy

    lease_seconds = 3.0
    sid = make_session(phase=Phase.RUNNING)
    with transaction() as s:
        assert take_session(s, sid, expected_epoch=0, owner="w1", lease_seconds=lease_seconds, to_phase=Phase.RUNNING)
    with FaultProxy.for_url(db) as proxy:
        monkeypatch.setenv("DATABASE_URL", proxy.rewrite(db))
        get_settings.cache_clear()
        try:
            fence = SessionFence(session_id=sid, epoch=1, lease_seconds=lease_seconds)
            fence._last_poll = 0.0  # the first poll asks the database at once
            proxy.freeze_on(b"SELECT agent_session.phase")
            tool_done = threading.Event()

            def loop_waiting_for_its_tool() -> None:
                with Heartbeat(fence):
                    tool_done.wait(6 * lease_seconds)

            def tool() -> None:
                try:
                    fence.should_stop()
                except Exception:
                    pass  # the thawed poll fails: its transaction was ended by the server
                finally:
                    tool_done.set()

            holder = threading.Thread(target=loop_waiting_for_its_tool, daemon=True)
            holder.start()
            polling = threading.Thread(target=tool, daemon=True)
            polling.start()
            wait_until(lambda: proxy.stats().frozen == 1, timeout=5, what="the poll froze")

            def lapsed() -> bool:
                with transaction() as s:
                    until = s.execute(select(AgentSession.lease_expires_at).where(AgentSession.id == sid)).scalar_one()
                    return bool(s.execute(select(text("now() > :until")), {"until": until}).scalar_one())

            wait_until(lapsed, timeout=2 * lease_seconds, interval=0.1, what="the holder's lease lapsed")
            assert polling.is_alive(), "the poll is still frozen"
        finally:
            proxy.thaw()
            tool_done.set()
            monkeypatch.setenv("DATABASE_URL", db)
            get_settings.cache_clear()
    holder.join(10)
    polling.join(10)


def test_a_cancel_stops_a_parents_wait_for_a_deaf_tool_at_once_not_at_its_timeout(
    model_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The tool never looks at ``ctx.cancelled()`` and its timeout is 30 s: the cancel of the
    session (another process's compare-and-set) ends the run within a few cancel polls."""
    from harness.agents import _load
    from harness.cancel import cancel_session
    from harness.tools import registry, tool, unregister
    from settings import get_settings

    started, release = threading.Event(), threading.Event()

    @tool(timeout_seconds=30)
    def deaf_to_cancel() -> str:
        started.set()
        release.wait(30)
        return "done"

    model = model_factory(
        [{"when": {"system_contains": MAIN}, "reply": {"tool_calls": [{"name": "deaf_to_cancel", "arguments": {}}]}}]
    )
    agents = tmp_path / "agents.toml"
    agents.write_text('[agents.main]\nsystem_prompt = "You are the main agent."\ntools = ["deaf_to_cancel"]\n')
    monkeypatch.setenv("AGENTS_FILE", str(agents))
    get_settings.cache_clear()
    _load.cache_clear()
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    before = registry.stuck_threads()
    outcome: list[str] = []
    runner = threading.Thread(target=lambda: outcome.append(run_agent(sid, 0, deps)), daemon=True)
    try:
        runner.start()
        assert started.wait(10)
        cancelled_at = time.monotonic()
        cancel_session(sid)
        runner.join(10)
        waited = time.monotonic() - cancelled_at
        assert outcome == ["cancelled"]
        assert waited < 3.0, waited
        assert registry.stuck_threads() == before + 1  # the abandoned call, until it ends
        assert [m.role for m in messages_of(sid)] == ["USER"]  # nothing of the round was written
    finally:
        release.set()
        unregister("deaf_to_cancel")
        monkeypatch.undo()
        get_settings.cache_clear()
        _load.cache_clear()
