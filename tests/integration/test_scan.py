"""The recovery scan (recovery/scan.py) on real PostgreSQL: a pass visits each row at most once,
the right to scan is bounded in time, rows are locked parent first, queued runs keep their
epoch, and an invalid compaction boundary ends the work instead of a take that rolls back
forever."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import create_engine, event, select, text, update

from harness.cancel import cancel_session
from harness.parent import run_agent
from harness.views import create_session
from models import (
    AgentSession,
    DeliveryStatus,
    ExecutionStatus,
    Phase,
    RecoveryScan,
    Role,
    SessionType,
    SubagentExecution,
    transaction,
)
from models.base import utcnow
from models.worker import take_scan_right
from recovery.child import recover_child
from recovery.scan import ScanRight, ScanRightLost, scan
from tests.helpers import (
    RecordingScheduler,
    add_message,
    executions_of,
    expire_leases,
    invariants,
    loop_deps,
    make_execution,
    make_session,
    messages_of,
)

E = SubagentExecution


def _sent(sched: RecordingScheduler) -> list[int]:
    return [eid for _, _, children in sched.recoveries for eid, _ in children]


# --- a pass visits each row at most once ------------------------------------------


def _seed_legacy_backlog(url: str, parents: int, per_parent: int, started: datetime) -> None:
    """Pre-upgrade rows (schema 0001): RUNNING parents with RUNNING executions, no leases; the
    child ``i`` of each parent has the task ``old task i``. Four statements (one a row took 4,800
    round trips: about 30 s of a loaded machine before the test began)."""
    engine = create_engine(url)
    child_index = "row_number() OVER (PARTITION BY parent_session_id ORDER BY id) - 1"
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO agent_session (user_id, session_type, agent_type, phase, started_at, updated_at)"
                " SELECT 'u1', 'NORMAL', 'main', 'RUNNING', :t, :t FROM generate_series(1, :n)"
            ),
            {"t": started, "n": parents},
        )
        conn.execute(
            text(
                "INSERT INTO agent_session (user_id, session_type, parent_session_id, agent_type, phase,"
                " started_at, updated_at)"
                " SELECT 'u1', 'SUBAGENT', p.id, 'reviewer', 'RUNNING', :t, :t"
                " FROM agent_session p CROSS JOIN generate_series(1, :k)"
                " WHERE p.session_type = 'NORMAL' ORDER BY p.id"
            ),
            {"t": started, "k": per_parent},
        )
        conn.execute(
            text(
                "INSERT INTO message (session_id, role, content, created_at)"
                f" SELECT id, 'USER', 'old task ' || ({child_index}), :t"
                " FROM agent_session WHERE session_type = 'SUBAGENT' ORDER BY id"
            ),
            {"t": started},
        )
        conn.execute(
            text(
                "INSERT INTO subagent_execution (parent_session_id, child_session_id, agent_type,"
                " task_description, status, started_at)"
                f" SELECT parent_session_id, id, 'reviewer', 'old task ' || ({child_index}), 'RUNNING', :t"
                " FROM agent_session WHERE session_type = 'SUBAGENT' ORDER BY id"
            ),
            {"t": started},
        )
    engine.dispose()


@pytest.fixture
def upgrade_day_db(fresh_db_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A database at schema 0001 holding 300 parents x 5 RUNNING executions from two days ago,
    then upgraded to head, as `agent-recovery db upgrade` does on upgrade day."""
    from alembic import command

    from migrations import alembic_config
    from models.db import dispose_engines
    from settings import get_settings

    cfg = alembic_config(fresh_db_url)
    command.upgrade(cfg, "0001")
    _seed_legacy_backlog(fresh_db_url, 300, 5, datetime.now(UTC) - timedelta(days=2))
    command.upgrade(cfg, "head")
    monkeypatch.setenv("DATABASE_URL", fresh_db_url)
    get_settings.cache_clear()
    dispose_engines()
    yield fresh_db_url
    dispose_engines()
    get_settings.cache_clear()


@pytest.mark.timeout(600)
def test_an_upgrade_day_backlog_of_overdue_executions_ends_in_one_pass_and_each_is_delivered_timed_out_once(
    upgrade_day_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import recovery.scan as scan_module

    monkeypatch.setattr(scan_module, "BATCH", 1000)
    with transaction() as s:
        total = s.execute(select(E.id).where(E.delivery_status == DeliveryStatus.PENDING)).all()
    assert len(total) == 1500  # more than one batch: the first one is full of overdue rows
    first = RecordingScheduler()
    started = time.monotonic()
    report = scan(first, callback_grace_seconds=0)
    assert report.ran and not report.right_lost
    sent = _sent(first)
    assert len(sent) == 1500 and len(set(sent)) == 1500, "every overdue execution is sent exactly once"
    assert time.monotonic() - started < 60
    # The next pass leaves the live reservations alone, overdue or not: nothing is sent twice.
    second = RecordingScheduler()
    assert scan(second, callback_grace_seconds=0).ran
    assert _sent(second) == []
    deps = loop_deps("http://127.0.0.1:9/v1", RecordingScheduler())  # no model call is made
    work = [(eid, epoch) for _, _, children in first.recoveries for eid, epoch in children]
    with ThreadPoolExecutor(4) as pool:  # as several worker slots would
        outcomes = set(pool.map(lambda pair: recover_child(*pair, deps), work))
    assert outcomes == {"timed_out"}
    with transaction() as s:
        rows = s.execute(select(E.status, E.delivery_status, E.error)).all()
        tools = s.execute(text("SELECT count(*), count(DISTINCT tool_call_id) FROM message WHERE role = 'TOOL'")).one()
    assert {(r.status, r.delivery_status) for r in rows} == {(ExecutionStatus.FAILED, DeliveryStatus.DELIVERED)}
    assert all("timed out" in (r.error or "") for r in rows)
    assert tools == (1500, 1500), "one TOOL result per execution, each delivered once"
    assert invariants(settled=False) == []


def test_a_scan_pass_longer_than_its_reservations_never_takes_its_own_overdue_rows_again(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import itertools

    import recovery.scan as scan_module

    for _ in range(3):
        parent = make_session()
        for _ in range(2):
            make_execution(parent, started_ago_seconds=2 * 86400)  # past deadline + grace
    ticks = itertools.count()
    real = scan_module.utcnow
    # Every call is a minute later: each batch's reservations have lapsed by the next batch.
    monkeypatch.setattr(scan_module, "utcnow", lambda: real() + timedelta(seconds=60 * next(ticks)))
    monkeypatch.setattr(scan_module, "BATCH", 2)
    sched = RecordingScheduler()
    scan(sched, callback_grace_seconds=0)
    sent = _sent(sched)
    assert sorted(sent) == sorted(set(sent)) and len(sent) == 6


def test_an_overdue_execution_held_by_a_live_owner_is_taken_once_and_its_reservation_is_left_alone(db: str) -> None:
    parent = make_session()
    eid = make_execution(
        parent, started_ago_seconds=2 * 86400, lease_owner="stuck@host", lease_expires_at=utcnow() + timedelta(hours=1)
    )
    first, second = RecordingScheduler(), RecordingScheduler()
    scan(first, callback_grace_seconds=0)
    scan(second, callback_grace_seconds=0)
    assert _sent(first) == [eid] and _sent(second) == []


# --- the right to scan is bounded in time -----------------------------------------


def _right() -> tuple[str | None, datetime | None]:
    with transaction() as s:
        row = s.execute(select(RecoveryScan.holder, RecoveryScan.held_until).where(RecoveryScan.id == 1)).one()
    return row.holder, row.held_until


def test_a_frozen_scanners_right_passes_to_another_scanner_once_it_expires(db: str) -> None:
    frozen = ScanRight()
    assert frozen.take()
    blocked = scan(RecordingScheduler())
    assert not blocked.ran, "a live right is respected"
    # The frozen scanner never renews: its right lapses in the database's time.
    with transaction() as s:
        s.execute(update(RecoveryScan).where(RecoveryScan.id == 1).values(held_until=utcnow() - timedelta(seconds=1)))
    assert scan(RecordingScheduler()).ran
    assert _right() == (None, None), "the pass gave its right back"
    with pytest.raises(ScanRightLost):
        frozen.renew()  # thawed: its right passed on (even though it is free now): it stops
    assert frozen.take()  # a NEW pass may take it again


def test_a_pass_that_loses_its_right_between_batches_stops_there(db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import recovery.scan as scan_module

    for _ in range(3):
        make_execution(make_session(), lease_expires_at=utcnow() - timedelta(seconds=5))
    monkeypatch.setattr(scan_module, "BATCH", 1)
    thief = ScanRight()
    real_recover_many = RecordingScheduler.recover_many

    def steal_after_first_batch(self: RecordingScheduler, rounds: Any) -> None:
        real_recover_many(self, rounds)
        with transaction() as s:  # another scanner takes the right while this one is frozen
            s.execute(update(RecoveryScan).where(RecoveryScan.id == 1).values(held_until=utcnow()))
        assert thief.take()

    monkeypatch.setattr(RecordingScheduler, "recover_many", steal_after_first_batch)
    sched = RecordingScheduler()
    report = scan(sched)
    assert report.right_lost and len(_sent(sched)) == 1
    assert _right()[0] == thief.holder, "the thief keeps the right: a lost right is not released"


#: The steps of a pass, in the order it runs them.
STEPS = (
    "_quarantine_unknown_statuses",
    "_suppress_stopped_parents",
    "_deliver_waiting_rounds",
    "_act_on_approvals",
    "_recover_dead_executions",
    "_resume_plain_sessions",
)


@pytest.mark.parametrize("step", STEPS)
def test_a_step_that_finds_the_right_passed_on_in_its_own_first_transaction_does_nothing(
    db: str, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """The steps check the right to scan in their own first transaction (no transaction of its
    own before each): another scanner that took the right just before a step starts stops the
    pass there, with nothing that step would have handed over sent, nor anything after it."""
    import recovery.scan as scan_module

    done = {"status": ExecutionStatus.COMPLETED, "completed_at": utcnow() - timedelta(seconds=5)}
    finished = make_session(epoch=2)  # a round whose delivery was lost
    make_execution(finished, **done)
    dead = make_session(lease_owner="dead@host", lease_expires_at=utcnow() - timedelta(seconds=5), epoch=3)
    make_execution(dead, lease_owner="dead@host", lease_expires_at=utcnow() - timedelta(seconds=5), epoch=2)
    plain = make_session(lease_owner="dead@host", lease_expires_at=utcnow() - timedelta(seconds=5))
    add_message(plain, Role.USER, "hi")
    thief = ScanRight()
    real = getattr(scan_module, step)

    def stolen_first(*args: Any) -> None:
        with transaction() as s:  # this pass froze past its right; another scanner took it
            s.execute(update(RecoveryScan).where(RecoveryScan.id == 1).values(held_until=utcnow()))
        assert thief.take()
        real(*args)

    monkeypatch.setattr(scan_module, step, stolen_first)
    sched = RecordingScheduler()
    report = scan(sched, callback_grace_seconds=0)
    assert report.right_lost
    assert _right()[0] == thief.holder
    ran = STEPS[: STEPS.index(step)]
    assert bool(sched.deliveries) == ("_deliver_waiting_rounds" in ran)
    assert bool(sched.recoveries) == ("_recover_dead_executions" in ran)
    assert sched.resumed == []
    with transaction() as s:
        epochs = dict(s.execute(select(AgentSession.id, AgentSession.epoch)).all())
    assert epochs[finished] == 2 and epochs[plain] == 0, "nothing handed over after the right passed on"
    if "_recover_dead_executions" not in ran:
        assert epochs[dead] == 3


def test_a_failing_step_never_leaves_the_right_held(db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import recovery.scan as scan_module

    def broken(*_: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(scan_module, "_recover_dead_executions", broken)
    assert scan(RecordingScheduler()).ran
    assert _right() == (None, None)
    with transaction() as s:
        assert take_scan_right(s, "next", 5.0)


def test_a_renewal_that_meets_another_scanners_take_in_flight_keeps_the_right(db: str) -> None:
    """Two boot scans at once: the second one's take locks the right's row for an instant; the
    first one's renewal skips the lock and must not take that for a lost right (it stopped its
    pass and left the right held by nobody scanning until it lapsed)."""
    from models import get_engine

    right = ScanRight()
    assert right.take()
    conn = get_engine().connect()
    trans = conn.begin()
    conn.execute(text("SELECT id FROM recovery_scan WHERE id = 1 FOR UPDATE"))  # the take in flight
    try:
        right.renew()  # no ScanRightLost
    finally:
        trans.rollback()
        conn.close()
    assert _right()[0] == right.holder
    with transaction() as s:  # once the right has lapsed and passed on, the renewal says so
        s.execute(update(RecoveryScan).where(RecoveryScan.id == 1).values(held_until=utcnow() - timedelta(seconds=1)))
    assert ScanRight().take()
    with pytest.raises(ScanRightLost):
        right.renew()


def test_a_right_locked_by_a_frozen_transaction_is_skipped_not_waited_for(db: str) -> None:
    """A scanner frozen INSIDE its right's transaction holds the row lock: others skip, never wait."""
    from models import get_engine

    conn = get_engine().connect()
    trans = conn.begin()
    conn.execute(text("SELECT id FROM recovery_scan WHERE id = 1 FOR UPDATE"))
    try:
        started = time.monotonic()
        assert not scan(RecordingScheduler()).ran
        assert time.monotonic() - started < 5
    finally:
        trans.rollback()
        conn.close()


# --- one lock order (parent, then its executions) ---------------------------------


class _Interleave:
    """Pauses the scan thread right after its first row-locking statement until the cancel and
    the finishing child have each sent their first locking statement (or a short bound passed),
    so the three transactions overlap on the same parent and executions."""

    def __init__(self) -> None:
        self.scan_locked = threading.Event()
        self.others = threading.Semaphore(0)
        self.local = threading.local()

    def listener(self, conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        role = getattr(self.local, "role", None)
        locking = "FOR UPDATE" in statement or statement.lstrip().upper().startswith("UPDATE")
        if role == "scan" and locking and "recovery_scan" not in statement and not self.scan_locked.is_set():
            self.scan_locked.set()
            for _ in range(2):
                self.others.acquire(timeout=1.0)
            time.sleep(0.2)  # let the others reach their lock waits (bounded; ordering is the assertion)
        elif role in ("cancel", "finish") and locking and not getattr(self.local, "signalled", False):
            self.local.signalled = True
            self.others.release()


def test_cancel_scan_and_a_finishing_child_racing_on_one_parent_never_deadlock(
    db: str, caplog: pytest.LogCaptureFixture
) -> None:
    from harness.child import Completed, finish_child, load_child
    from models import get_engine

    engine = get_engine()
    for _ in range(4):
        parent = make_session(phase=Phase.RUNNING)
        finishing = make_execution(parent, lease_owner="w@h", lease_expires_at=utcnow() + timedelta(seconds=30))
        make_execution(parent, lease_expires_at=utcnow() - timedelta(seconds=5))  # dead: the scan takes it
        with transaction() as s:
            epoch = s.execute(select(E.epoch).where(E.id == finishing)).scalar_one()
        info = load_child(finishing)
        gate = _Interleave()
        event.listen(engine, "before_cursor_execute", gate.listener)
        errors: list[BaseException] = []

        def run(role: str, fn: Any, gate: _Interleave = gate, errors: list[BaseException] = errors) -> None:
            gate.local.role = role
            if role != "scan":
                gate.scan_locked.wait(5)
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        threads = [
            threading.Thread(target=run, args=("scan", lambda: scan(RecordingScheduler(), callback_grace_seconds=0))),
            threading.Thread(target=run, args=("cancel", lambda p=parent: cancel_session(p))),
            threading.Thread(
                target=run,
                args=("finish", lambda i=info, e=epoch: finish_child(i, e, Completed("done"))),
            ),
        ]
        caplog.clear()
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        event.remove(engine, "before_cursor_execute", gate.listener)
        assert errors == [], f"a racer failed: {errors!r}"
        assert "deadlock" not in caplog.text.lower() and "scan_step_failed" not in caplog.text
        with transaction() as s:
            phase = s.execute(select(AgentSession.phase).where(AgentSession.id == parent)).scalar_one()
        assert phase == Phase.CANCELLED
        assert {e.delivery_status for e in executions_of(parent)} == {DeliveryStatus.SUPPRESSED}
    assert invariants(settled=False) == []


def _locked_elsewhere(statement: str) -> Any:
    """A transaction of another connection holding the row locks ``statement`` takes (as a
    cancel, a delivery or a finishing child would), until the returned connection is closed."""
    from models import get_engine

    conn = get_engine().connect()
    conn.begin()
    conn.execute(text(statement))
    return conn


def test_a_parent_locked_elsewhere_is_skipped_not_waited_for_and_the_pass_goes_on_past_it(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import recovery.scan as scan_module

    busy, free = make_session(), make_session()
    busy_rows = [make_execution(busy) for _ in range(2)]
    free_row = make_execution(free)
    monkeypatch.setattr(scan_module, "BATCH", 1)  # the busy parent fills whole batches
    conn = _locked_elsewhere(f"SELECT id FROM agent_session WHERE id = {busy} FOR UPDATE")
    sched = RecordingScheduler()
    scanner = threading.Thread(target=scan, args=(sched,), kwargs={"callback_grace_seconds": 0})
    try:
        scanner.start()
        scanner.join(10)
        assert not scanner.is_alive(), "the pass waited for the busy parent's lock"
    finally:
        conn.close()  # a waiting pass goes on now
        scanner.join(10)
    assert _sent(sched) == [free_row], "the cursor passed the busy parent's rows, visiting each once"
    untouched = {e.id: (e.status, e.epoch) for e in executions_of(busy)}
    assert untouched == {eid: (ExecutionStatus.RUNNING, 0) for eid in busy_rows}
    later = RecordingScheduler()
    scan(later, callback_grace_seconds=0)
    assert sorted(_sent(later)) == busy_rows, "the next pass takes them"


@pytest.mark.parametrize("others", [1, 0], ids=["beside_a_free_parent", "alone"])
def test_rows_passed_over_for_a_parent_locked_for_a_moment_are_taken_by_the_same_pass(db: str, others: int) -> None:
    """A sibling finishing (or a delivery) holds the parent for a moment while the boot scan
    walks: the pass comes back for that round after a short wait instead of leaving it to the
    next scan interval (a restarted worker's round then waited 30 s); also when nothing else
    was dead (the walk could lock no row at all)."""
    import recovery.scan as scan_module

    busy = make_session()
    busy_rows = sorted(make_execution(busy) for _ in range(2))
    free_rows = [make_execution(make_session()) for _ in range(others)]
    conn = _locked_elsewhere(f"SELECT id FROM agent_session WHERE id = {busy} FOR UPDATE")
    release = threading.Timer(scan_module.FOLLOW_UP_WAIT_SECONDS / 2, conn.close)
    sched = RecordingScheduler()
    release.start()
    try:
        scan(sched, callback_grace_seconds=0)
    finally:
        release.join()
    assert sorted(_sent(sched)) == sorted([*busy_rows, *free_rows]), "one pass took every dead row, each once"
    assert {e.id: e.epoch for e in executions_of(busy)} == dict.fromkeys(busy_rows, 1)


def test_a_pass_whose_every_dead_row_has_its_parent_locked_elsewhere_ends_having_taken_none(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import recovery.scan as scan_module

    parents = [make_session() for _ in range(3)]
    for parent in parents:
        make_execution(parent)
    monkeypatch.setattr(scan_module, "BATCH", 1)
    ids = ", ".join(map(str, parents))
    conn = _locked_elsewhere(f"SELECT id FROM agent_session WHERE id IN ({ids}) FOR UPDATE")
    sched = RecordingScheduler()
    scanner = threading.Thread(target=scan, args=(sched,), kwargs={"callback_grace_seconds": 0})
    try:
        scanner.start()
        scanner.join(10)
        assert not scanner.is_alive(), "the pass ended"
    finally:
        conn.close()
        scanner.join(10)
    assert sched.recoveries == []


def test_a_dead_row_of_a_stopped_parent_left_by_the_suppress_step_is_neither_taken_nor_walked_for_again(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancelled parent with a quarantined execution keeps its other PENDING rows (the suppress
    step leaves such a parent alone): the walk meets them as dead rows, takes none and does not
    count them as passed over (which would walk again after a wait, pass after pass)."""
    import recovery.scan as scan_module

    stopped = make_session(phase=Phase.CANCELLED)
    dead = make_execution(stopped, lease_expires_at=utcnow() - timedelta(seconds=5))
    make_execution(stopped, status=ExecutionStatus.COMPLETED, completed_at=utcnow(), quarantined_at=utcnow())
    walks = []
    real_walk = scan_module._walk

    def counted(*args: Any) -> int:
        walks.append(1)
        return real_walk(*args)

    monkeypatch.setattr(scan_module, "_walk", counted)
    monkeypatch.setattr(scan_module, "FOLLOW_UP_WAIT_SECONDS", 0)
    sched = RecordingScheduler()
    report = scan(sched, callback_grace_seconds=0)
    assert report.suppressed == [] and sched.recoveries == []
    assert len(walks) == 1, f"{len(walks)} walks"
    assert {e.id: (e.status, e.epoch) for e in executions_of(stopped)}[dead] == ("RUNNING", 0)


def test_an_execution_locked_elsewhere_is_skipped_while_its_siblings_are_reserved(db: str) -> None:
    parent = make_session()
    locked, sibling = make_execution(parent), make_execution(parent)
    conn = _locked_elsewhere(f"SELECT id FROM subagent_execution WHERE id = {locked} FOR UPDATE")
    sched = RecordingScheduler()
    scanner = threading.Thread(target=scan, args=(sched,), kwargs={"callback_grace_seconds": 0})
    try:
        scanner.start()
        scanner.join(10)
        assert not scanner.is_alive(), "the pass waited for the execution's lock"
    finally:
        conn.close()
        scanner.join(10)
    assert _sent(sched) == [sibling]
    assert {e.id: e.epoch for e in executions_of(parent)} == {locked: 0, sibling: 1}


def test_the_epochs_a_batch_hands_over_are_the_ones_it_wrote(db: str) -> None:
    """A batch reserves and releases in one transaction: every epoch handed over is the row's."""
    lapsed = make_session(lease_owner="dead@host", lease_expires_at=utcnow() - timedelta(seconds=5), epoch=3)
    waiting = make_session(epoch=7)  # yielded: no owner, RUNNING
    live = make_session(lease_owner="live@host", lease_expires_at=utcnow() + timedelta(seconds=60), epoch=5)
    for parent in (lapsed, waiting, live):
        make_execution(parent, lease_owner="dead@host", lease_expires_at=utcnow() - timedelta(seconds=5), epoch=2)
        make_execution(parent)  # never taken: epoch 0, no lease
    sched = RecordingScheduler()
    scan(sched, callback_grace_seconds=0)
    with transaction() as s:
        parents = {r.id: (r.epoch, r.phase, r.lease_owner) for r in s.execute(select(AgentSession)).scalars()}
    assert parents[lapsed] == (4, Phase.RESUMING, None), "its own lease lapsed: fenced out"
    assert parents[waiting] == (7, Phase.RESUMING, None), "its callback's epoch stays valid"
    assert parents[live] == (5, Phase.RUNNING, "live@host"), "its live loop yields with its epoch"
    handed = {pid: (epoch, dict(children)) for pid, epoch, children in sched.recoveries}
    assert set(handed) == {lapsed, waiting, live}
    for pid, (epoch, children) in handed.items():
        assert epoch == parents[pid][0]
        rows = {e.id: e for e in executions_of(pid)}
        assert children == {eid: row.epoch for eid, row in rows.items()}
        assert sorted(row.epoch for row in rows.values()) == [1, 3]
        assert {(row.status, row.lease_owner) for row in rows.values()} == {(ExecutionStatus.RECOVERING, None)}


def test_a_rounds_delivery_is_asked_for_only_once_every_execution_of_it_is_terminal(db: str) -> None:
    live = {"lease_owner": "w@h", "lease_expires_at": utcnow() + timedelta(seconds=60)}
    done = {"status": ExecutionStatus.COMPLETED, "completed_at": utcnow() - timedelta(seconds=5)}
    finished, half, running = make_session(epoch=2), make_session(), make_session()
    for _ in range(2):
        make_execution(finished, **done)
        make_execution(running, **live)
    make_execution(half, **done)
    make_execution(half, **live)
    sched = RecordingScheduler()
    report = scan(sched, callback_grace_seconds=0)
    assert sched.deliveries == [(finished, 2)]
    assert sorted(report.delivering) == sorted(e.id for e in executions_of(finished))
    assert sched.recoveries == []


# --- a queued run keeps its epoch ---------------------------------------------------


def test_a_queued_parent_run_keeps_its_epoch_through_every_scan_pass(model_factory: Any) -> None:
    model = model_factory([{"when": {}, "reply": {"content": "hello"}}])
    sid = create_session("main", "hi")  # reserved for agent.run(sid, 0), still in a long queue
    for _ in range(3):
        expire_leases()  # the queue is slower than the reservation
        sched = RecordingScheduler()
        scan(sched, callback_grace_seconds=0)
        assert sched.resumed == [(sid, 0)], "the scan re-sends the same run, it does not fence the queued one"
    deps = loop_deps(model.base_url)
    assert run_agent(sid, 0, deps) == "waiting_user", "the message queued first still runs the session"
    assert run_agent(sid, 0, deps) == "stale", "its duplicate loses the compare-and-set"


def test_a_dead_loops_session_still_gets_a_new_epoch_from_the_scan(db: str) -> None:
    sid = make_session(lease_owner="dead@host", lease_expires_at=utcnow() - timedelta(seconds=5), epoch=4)
    add_message(sid, Role.USER, "hi")
    sched = RecordingScheduler()
    scan(sched, callback_grace_seconds=0)
    assert sched.resumed == [(sid, 5)]


# --- an invalid compaction boundary ends the work -----------------------------------


def test_a_recovered_child_with_an_invalid_boundary_ends_failed_and_is_delivered_as_a_failure(db: str) -> None:
    parent = make_session(phase=Phase.RUNNING)
    child = make_session(session_type=SessionType.SUBAGENT, phase=Phase.RUNNING, parent_session_id=parent)
    start = add_message(child, Role.USER, "review the change")
    eid = make_execution(
        parent,
        child,
        tool_call_id="call_x",
        execution_start_message_id=start,
        lease_expires_at=utcnow() - timedelta(seconds=5),
    )
    with transaction() as s:
        s.execute(update(AgentSession).where(AgentSession.id == child).values(compaction_boundary_message_id=999999))
    sched = RecordingScheduler()
    scan(sched, callback_grace_seconds=0)
    assert _sent(sched) == [eid]
    (_, _, [(_, epoch)]) = sched.recoveries[0]
    deps = loop_deps("http://127.0.0.1:9/v1", sched)
    assert recover_child(eid, epoch, deps) == "failed"
    (row,) = executions_of(parent)
    assert row.status == ExecutionStatus.FAILED and "compaction boundary" in (row.error or "")
    assert row.delivery_status == DeliveryStatus.DELIVERED, "the last child of the round delivers it"
    tool = [m for m in messages_of(parent) if m.role == Role.TOOL]
    assert len(tool) == 1 and json.loads(tool[0].content or "{}")["success"] is False
    again = RecordingScheduler()
    scan(again, callback_grace_seconds=0)
    assert _sent(again) == [], "nothing is re-sent forever"


def test_a_plain_session_with_an_invalid_boundary_ends_failed_and_is_not_resumed(db: str) -> None:
    sid = make_session(lease_owner="dead@host", lease_expires_at=utcnow() - timedelta(seconds=5))
    add_message(sid, Role.USER, "hi")
    with transaction() as s:
        s.execute(update(AgentSession).where(AgentSession.id == sid).values(compaction_boundary_message_id=999999))
    for _ in range(2):
        sched = RecordingScheduler()
        scan(sched, callback_grace_seconds=0)
        assert sched.resumed == []
    with transaction() as s:
        phase = s.execute(select(AgentSession.phase).where(AgentSession.id == sid)).scalar_one()
    assert phase == Phase.FAILED


def test_an_unclaimed_reservation_is_re_sent_with_a_doubling_reservation_so_a_long_queue_is_not_flooded(
    db: str,
) -> None:
    from settings import get_settings

    eid = make_execution(make_session(), lease_expires_at=utcnow() - timedelta(seconds=5))
    lease = get_settings().LEASE_SECONDS
    windows = []
    for _ in range(4):
        sched = RecordingScheduler()
        scan(sched, callback_grace_seconds=0)
        assert _sent(sched) == [eid]
        (row,) = [e for e in executions_of(executions_of_parent(eid)) if e.id == eid]
        windows.append(round((row.lease_expires_at - utcnow()).total_seconds() / lease))
        assert row.epoch == 1, "every re-send keeps the epoch of the first reservation"
        again = RecordingScheduler()
        scan(again, callback_grace_seconds=0)
        assert _sent(again) == [], "nothing is re-sent while the reservation lasts"
        expire_leases()  # nobody picked it up within the reservation
    assert windows == [2, 4, 8, 16]


def test_recoveries_count_each_take_back_and_not_a_re_send_of_an_unclaimed_reservation(db: str) -> None:
    """``recoveries`` is what the console shows as "recovered ×N": one per take-back of a dead
    execution, none for a re-send of a reservation nobody picked up (its epoch stays too)."""
    from models.execution import take_execution

    eid = make_execution(make_session(), lease_expires_at=utcnow() - timedelta(seconds=5), epoch=1)

    def row() -> Any:
        (found,) = [e for e in executions_of(executions_of_parent(eid)) if e.id == eid]
        return found

    assert row().recoveries == 0
    scan(RecordingScheduler(), callback_grace_seconds=0)
    assert (row().epoch, row().recoveries) == (2, 1)
    expire_leases()  # nobody picked it up: the next pass re-sends it
    scan(RecordingScheduler(), callback_grace_seconds=0)
    assert (row().epoch, row().recoveries) == (2, 1)
    with transaction() as s:  # a recovery takes it, then dies
        taken = take_execution(
            s, eid, expected_epoch=2, owner="w9@h", to_status=ExecutionStatus.RECOVERING, lease_seconds=30
        )
        assert taken == 3
    expire_leases()
    scan(RecordingScheduler(), callback_grace_seconds=0)
    assert (row().epoch, row().recoveries) == (4, 2)


def executions_of_parent(eid: int) -> int:
    with transaction() as s:
        return int(s.execute(select(E.parent_session_id).where(E.id == eid)).scalar_one())


def test_an_overdue_execution_being_ended_by_its_recovery_is_not_taken_from_it_by_the_next_pass(db: str) -> None:
    """Upgrade day under load: a recovery took an overdue row and is ending it as timed out; the
    next pass (every S) must not take it away and start the recovery over."""
    from models.execution import take_execution

    parent = make_session()
    eid = make_execution(parent, started_ago_seconds=2 * 86400)  # legacy: no lease at all
    first = RecordingScheduler()
    scan(first, callback_grace_seconds=0)
    ((_, _, [(_, epoch)]),) = first.recoveries
    with transaction() as s:
        taken = take_execution(
            s,
            eid,
            expected_epoch=epoch,
            to_status=ExecutionStatus.RECOVERING,
            owner="recoverer@host",
            lease_seconds=30,
        )
    assert taken == epoch + 1
    second = RecordingScheduler()
    scan(second, callback_grace_seconds=0)
    assert _sent(second) == []


def test_the_scans_reservation_is_an_in_place_update(db: str) -> None:
    """No index names an execution's status and the table keeps room per page (migration
    0010): the reservation (status, epoch, lease) is a HOT update, which writes no index entry.
    An index on status makes every reservation write all five indexes of the table again
    (178 ms against 42 ms for a batch of 5,000)."""
    from models.reservation import Reserver
    from recovery.scan import BATCH, reservation_seconds

    rows = [make_execution(make_session()) for _ in range(6)]
    counts = text("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = 'subagent_execution'")
    with transaction() as s:
        # NOTE: a backend's counts of earlier transactions (the rows' set-up) may not be flushed
        # yet and show here too: only what the batch adds counts.
        updated_before, in_place_before = s.execute(counts).one()
        batch = Reserver(utcnow(), reservation_seconds(), limit=BATCH).batch(s, 0)
        updated, in_place = s.execute(counts).one()
        updated, in_place = updated - updated_before, in_place - in_place_before
    assert sorted(eid for _, _, kids in batch.rounds for eid, _ in kids) == sorted(rows)
    # NOTE: at least the reservations (the pass's transaction may update more rows: what the
    # count says is that every update in it was in place).
    assert updated >= len(rows) and in_place == updated, f"{in_place} of {updated} updates in place"


# --- the recover step's batch fits the statement timeout -----------------------------------------


@contextmanager
def _statements_over_rows_cut(rows: int) -> Iterator[list[int]]:
    """Every recover-step batch of more than ``rows`` dead executions runs into the server's
    statement timeout (it is replaced by a statement that outlasts a timeout set just before
    it: a slow database, or a lease too short for the batch). Yields the sizes tried."""
    import recovery.scan as scan_module
    from models import get_engine

    engine = get_engine()
    tried: list[int] = []

    def slow(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> Any:
        if "locked_parent" in statement:
            size = scan_module._batch_size.rows()
            tried.append(size)
            if size > rows:
                return "SET LOCAL statement_timeout = 100; SELECT pg_sleep(5)", {}
        return statement, parameters

    event.listen(engine, "before_cursor_execute", slow, retval=True)
    try:
        yield tried
    finally:
        event.remove(engine, "before_cursor_execute", slow)


def test_a_recover_batch_cut_at_the_statement_timeout_is_halved_and_the_pass_still_takes_every_dead_row(
    db: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With a fixed batch, every pass failed the same way on a slow database; the batch is
    halved until it fits, and the pass reserves every dead execution once."""
    import logging

    import recovery.scan as scan_module

    monkeypatch.setattr(scan_module, "BATCH", 16)
    monkeypatch.setattr(scan_module, "_batch_size", scan_module.BatchSize())
    dead = []
    for _ in range(5):
        parent = make_session()
        dead += [make_execution(parent, lease_expires_at=utcnow() - timedelta(seconds=5)) for _ in range(4)]
    sched = RecordingScheduler()
    caplog.set_level(logging.INFO)
    with _statements_over_rows_cut(5) as tried:
        report = scan(sched, callback_grace_seconds=0)
    assert sorted(report.recovering) == sorted(dead)
    assert sorted(_sent(sched)) == sorted(dead)
    # halved twice, then grown back after four full batches that fitted, and halved again
    assert tried[:7] == [16, 8, 4, 4, 4, 4, 8], tried
    cut = sum(1 for size in tried if size > 5)
    assert sum("event=scan_batch_halved" in r.getMessage() for r in caplog.records) == cut
    assert scan_module._batch_size.rows() == 4
    assert invariants(settled=False) == []
