"""Every state transition of docs/state-machines.md as a compare-and-set: legal land, illegal raise."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import select

from models import (
    AgentSession,
    DeliveryStatus,
    ExecutionStatus,
    IllegalTransition,
    Phase,
    SubagentExecution,
    transaction,
)
from models.execution import (
    finish_execution,
    mark_delivered,
    suppress_execution,
    take_execution,
)
from models.session import hand_over, release_session, request_cancel, set_phase, take_session
from tests.helpers import expire_leases, make_execution, make_session

pytestmark = pytest.mark.usefixtures("db")


def _row(eid: int) -> SubagentExecution:
    with transaction() as s:
        return s.execute(select(SubagentExecution).where(SubagentExecution.id == eid)).scalar_one()


def _take(eid: int, epoch: int = 0, to: ExecutionStatus = ExecutionStatus.RECOVERING, **kw: Any) -> int | None:
    with transaction() as s:
        return take_execution(s, eid, expected_epoch=epoch, to_status=to, owner="w1", lease_seconds=30, **kw)


def _finish(eid: int, epoch: int, status: ExecutionStatus = ExecutionStatus.COMPLETED) -> bool:
    with transaction() as s:
        return finish_execution(s, eid, epoch=epoch, status=status, result={"success": True})


def test_running_to_recovering_to_completed_then_delivered() -> None:
    parent = make_session()
    eid = make_execution(parent, tool_call_id="call_1")
    assert _take(eid) == 1
    assert _row(eid).status == ExecutionStatus.RECOVERING
    assert _finish(eid, 1)
    with transaction() as s:
        assert mark_delivered(s, eid, assistant_message_id=None, tool_message_id=None)
    row = _row(eid)
    assert (row.status, row.delivery_status) == (ExecutionStatus.COMPLETED, DeliveryStatus.DELIVERED)
    assert row.parent_result_delivered_at is not None


@pytest.mark.parametrize("terminal", [ExecutionStatus.COMPLETED, ExecutionStatus.FAILED, ExecutionStatus.CANCELLED])
def test_running_to_each_terminal_status_lands(terminal: ExecutionStatus) -> None:
    eid = make_execution(make_session())
    assert _finish(eid, 0, terminal)
    assert _row(eid).status == terminal


@pytest.mark.parametrize("target", [ExecutionStatus.RUNNING, ExecutionStatus.RECOVERING])
def test_terminal_never_goes_back_to_active(target: ExecutionStatus) -> None:
    eid = make_execution(make_session(), status=ExecutionStatus.COMPLETED)
    with pytest.raises(IllegalTransition):
        _take(eid, 0, target)
    assert _row(eid).status == ExecutionStatus.COMPLETED


def test_recovering_never_goes_back_to_running() -> None:
    eid = make_execution(make_session(), status=ExecutionStatus.RECOVERING)
    with pytest.raises(IllegalTransition):
        _take(eid, 0, ExecutionStatus.RUNNING)


def test_terminal_cannot_finish_again() -> None:
    eid = make_execution(make_session(), status=ExecutionStatus.FAILED)
    with pytest.raises(IllegalTransition):
        _finish(eid, 0, ExecutionStatus.COMPLETED)


@pytest.mark.parametrize("delivery", [DeliveryStatus.SUPPRESSED, DeliveryStatus.LEGACY])
def test_takeover_of_a_non_pending_row_raises(delivery: DeliveryStatus) -> None:
    eid = make_execution(make_session(), status=ExecutionStatus.RUNNING, delivery=delivery)
    with pytest.raises(IllegalTransition):
        _take(eid)


def test_suppress_cancels_an_active_execution_and_fences_it() -> None:
    eid = make_execution(make_session())
    assert _take(eid) == 1
    with transaction() as s:
        assert suppress_execution(s, eid)
    row = _row(eid)
    assert (row.status, row.delivery_status) == (ExecutionStatus.CANCELLED, DeliveryStatus.SUPPRESSED)
    # The child that held epoch 1 can no longer write its result.
    assert not _finish(eid, 1)
    with transaction() as s:
        assert not suppress_execution(s, eid)


def test_stale_epoch_loses_without_raising() -> None:
    eid = make_execution(make_session())
    assert _take(eid, 0) == 1
    assert _take(eid, 0) is None  # a duplicate message handed the old epoch
    assert not _finish(eid, 0)
    assert _row(eid).status == ExecutionStatus.RECOVERING


def test_a_live_lease_blocks_a_takeover_and_its_expiry_frees_it() -> None:
    eid = make_execution(make_session())
    assert _take(eid, 0) == 1
    assert _take(eid, 1) is None
    assert _row(eid).epoch == 1
    expire_leases()
    assert _take(eid, 1) == 2


def test_two_threads_racing_the_same_takeover_exactly_one_wins() -> None:
    eid = make_execution(make_session())
    barrier = threading.Barrier(2)
    results: list[int | None] = []
    errors: list[BaseException] = []

    def race() -> None:
        try:
            barrier.wait(timeout=5)
            results.append(_take(eid, 0))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=race) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    assert sorted(results, key=lambda r: r is None) == [1, None]


def test_session_take_bumps_epoch_and_a_stale_owner_cannot_release() -> None:
    sid = make_session(phase=Phase.RUNNING)
    with transaction() as s:
        assert take_session(s, sid, expected_epoch=0, owner="w1", lease_seconds=30, to_phase=Phase.RUNNING) == 1
    with transaction() as s:
        assert take_session(s, sid, expected_epoch=0, owner="w2", lease_seconds=30, to_phase=Phase.RUNNING) is None
        assert not release_session(s, sid, epoch=0, to_phase=Phase.WAITING_USER)
        assert hand_over(s, sid, epoch=1, to_phase=Phase.RUNNING) == 2


def test_cancelled_session_is_never_taken_nor_moved_back() -> None:
    sid = make_session(phase=Phase.RUNNING)
    with transaction() as s:
        assert request_cancel(s, sid)
    with transaction() as s:
        assert take_session(s, sid, expected_epoch=0, owner="w", lease_seconds=30, to_phase=Phase.RESUMING) is None
        assert not set_phase(s, sid, to_phase=Phase.RUNNING, from_phases=(Phase.RUNNING, Phase.RESUMING))
        assert not request_cancel(s, sid)
    with pytest.raises(IllegalTransition), transaction() as s:
        set_phase(s, sid, to_phase=Phase.RUNNING, from_phases=(Phase.CANCELLED,))


def test_the_session_lock_skips_a_session_held_elsewhere_returns_ascending_ids_and_can_leave_out_stopped_ones() -> None:
    """models.session.lock_unheld_stmt, the one lock of "these sessions unless someone else has
    them" (the scan's deliver and resume steps, the delivery batch, the reservation walk): a
    session another transaction holds is left out at once (no wait), the rest come back locked in
    ascending id with the columns asked for, and ``only_not_stopped`` leaves out a stopped one."""
    from models import get_engine
    from models.session import lock_unheld_stmt

    held, idle, stopped, fresh = (make_session(phase=p) for p in (Phase.RUNNING, Phase.IDLE, Phase.COMPLETED, None))
    ids = [fresh, stopped, held, idle]  # any order in, ascending id out
    holder = get_engine().connect()
    trans = holder.begin()
    holder.execute(select(AgentSession.id).where(AgentSession.id == held).with_for_update())
    try:
        with transaction() as s:
            rows = s.execute(lock_unheld_stmt(("phase", "epoch")), {"b_ids": ids}).all()
            assert [tuple(r) for r in rows] == [
                (idle, Phase.IDLE, 0),
                (stopped, Phase.COMPLETED, 0),
                (fresh, None, 0),
            ]
        with transaction() as s:
            assert list(s.execute(lock_unheld_stmt((), True), {"b_ids": ids}).scalars()) == [idle, fresh]
            # Locked by this transaction: another one now skips them too.
            other = get_engine().connect()
            try:
                with other.begin():
                    left = list(other.execute(lock_unheld_stmt(), {"b_ids": ids}).scalars())
            finally:
                other.close()
            assert left == [stopped]
    finally:
        trans.rollback()
        holder.close()


# --- a take resets the re-send count -------------------------------------------------------------


def test_a_take_of_a_session_resets_its_resends_so_a_later_lost_run_is_re_sent_after_the_first_window() -> None:
    """A parent whose run was re-sent three times before a worker took it: the take starts a
    new life for the count. Its run handed over later and lost again is re-sent after the first
    window (two reservations), not after 2**4 of them."""
    from datetime import timedelta

    from models.base import utcnow
    from models.session import reserve_session

    sid = make_session(phase=Phase.RUNNING, epoch=4, resends=3)
    with transaction() as s:
        new = take_session(s, sid, expected_epoch=4, owner="w1", lease_seconds=30, to_phase=Phase.RUNNING)
    assert new == 5
    assert _session(sid).resends == 0
    with transaction() as s:  # the run ends, later a delivery hands the parent over; its run is lost
        assert release_session(s, sid, epoch=5, to_phase=Phase.RUNNING)
        assert hand_over(s, sid, epoch=5, to_phase=Phase.RUNNING) == 6
    before = utcnow()
    with transaction() as s:
        assert reserve_session(s, sid, expected_epoch=6, to_phase=Phase.RUNNING, reserve_seconds=1.0) == 6
    row = _session(sid)
    assert row.resends == 1
    assert row.lease_expires_at is not None
    # the first re-send's window is two reservations (2 s here); after three re-sends, 16 s
    assert row.lease_expires_at - before < timedelta(seconds=3)


def test_a_take_of_an_execution_resets_its_resends() -> None:
    """The same rule for an execution: a take (a child's or a recovery's) starts the count anew."""
    parent = make_session()
    eid = make_execution(parent, tool_call_id="call_1", epoch=2, resends=3)
    assert _take(eid, epoch=2) == 3
    assert _row(eid).resends == 0


def _session(sid: int) -> AgentSession:
    with transaction() as s:
        return s.execute(select(AgentSession).where(AgentSession.id == sid)).scalar_one()
