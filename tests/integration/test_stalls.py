"""Stalls on real PostgreSQL: a transaction that stops answering with its locks held (a paused
process, a suspended VM) never makes the scan wait on a row, never lets the scan resume a
parent whose round is being written, and is ended by the server within half a lease."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, text, update

from models import AgentSession, PendingRound, Phase, Role, transaction
from models.base import utcnow
from recovery.scan import ScanReport, scan
from tests.helpers import RecordingScheduler, add_message, invariants, make_execution, make_session, wait_until

S = AgentSession


def _open_transaction(*statements: str) -> Any:
    """Another connection's transaction that ran ``statements`` and now stalls (stays open
    with its locks) until the returned connection is committed or closed."""
    from models import get_engine

    conn = get_engine().connect()
    conn.begin()
    for statement in statements:
        conn.execute(text(statement))
    return conn


def _scan_in_thread(sched: RecordingScheduler) -> tuple[threading.Thread, list[ScanReport]]:
    reports: list[ScanReport] = []
    thread = threading.Thread(target=lambda: reports.append(scan(sched, callback_grace_seconds=0)), daemon=True)
    thread.start()
    return thread, reports


def _delegating_transaction(sid: int, epoch: int) -> list[str]:
    """What a parent's delegating transaction writes, in order: the fence (its session row
    locked), a child and its PENDING execution, the pending round, the release of its lease."""
    return [
        f"UPDATE agent_session SET lease_expires_at = now() + interval '30 seconds' WHERE id = {sid}"
        f" AND epoch = {epoch}",
        "INSERT INTO agent_session (user_id, session_type, parent_session_id, agent_type, started_at, updated_at)"
        f" VALUES ('u1', 'SUBAGENT', {sid}, 'reviewer', now(), now())",
        "INSERT INTO pending_round (session_id, tool_calls, inline_results, created_at)"
        f" VALUES ({sid}, '[]', '{{}}', now())",
        "INSERT INTO subagent_execution (parent_session_id, child_session_id, agent_type, task_description,"
        " status, delivery_status, started_at, pending_round_id, epoch)"
        f" SELECT {sid}, max(c.id), 'reviewer', 'review', 'RUNNING', 'PENDING', now(),"
        f" (SELECT id FROM pending_round WHERE session_id = {sid}), 0"
        f" FROM agent_session c WHERE c.parent_session_id = {sid}",
        f"UPDATE agent_session SET lease_owner = NULL, lease_expires_at = NULL WHERE id = {sid}",
    ]


# --- a second final answer ----------------------------------------------------------------------


def test_a_parent_whose_delegating_transaction_stalls_past_its_lease_is_never_resumed_by_the_scan(db: str) -> None:
    """The delegation commits while the scan's take of the parent would wait on its row: the
    take must not see the released row as free and resume a parent whose children are PENDING."""
    sid = make_session(lease_owner="stalled@host", lease_expires_at=utcnow() - timedelta(seconds=5), epoch=3)
    add_message(sid, Role.USER, "hi")
    stalled = _open_transaction(*_delegating_transaction(sid, 3))
    sched = RecordingScheduler()
    try:
        scanner, reports = _scan_in_thread(sched)
        scanner.join(5)
        stalled.commit()  # the stalled worker wakes up and commits its round
    finally:
        stalled.close()
    scanner.join(10)
    assert not scanner.is_alive()
    assert sched.resumed == [], "a parent with PENDING children and an open round was resumed"
    with transaction() as s:
        row = s.execute(select(S.epoch, S.phase).where(S.id == sid)).one()
    assert tuple(row) == (3, Phase.RUNNING), "the scan wrote nothing to the parent"
    assert reports and reports[0].skipped >= 1, "the pass says it passed the parent over"


def test_the_checker_flags_an_assistant_message_written_inside_a_closed_round(db: str) -> None:
    sid = make_session()
    add_message(sid, Role.USER, "hi")
    with transaction() as s:
        rnd = PendingRound(session_id=sid, tool_calls=[], inline_results={}, created_at=utcnow())
        s.add(rnd)
        s.flush()
        rid = rnd.id
    answer = add_message(sid, Role.ASSISTANT, "a final answer while the children run")
    with transaction() as s:
        s.execute(update(PendingRound).where(PendingRound.id == rid).values(closed_at=utcnow()))
    problems = [p for p in invariants(settled=False) if p.startswith("I3")]
    assert any(f"final answers [{answer}]" in p and f"round {rid}" in p for p in problems), problems


# --- no scan step waits on a row lock ------------------------------------------------------------


@pytest.mark.parametrize("step", ["suppress", "deliver", "recover", "resume"])
def test_no_scan_step_waits_on_a_parent_row_another_path_holds_and_the_pass_says_it_skipped(
    db: str, step: str, caplog: pytest.LogCaptureFixture
) -> None:
    if step == "suppress":
        parent = make_session(phase=Phase.CANCELLED)
        make_execution(parent)
    elif step == "deliver":
        parent = make_session(lease_owner=None)
        from models import ExecutionStatus

        make_execution(parent, status=ExecutionStatus.COMPLETED, completed_at=utcnow() - timedelta(seconds=60))
    elif step == "recover":  # a dead execution: its lease lapsed
        parent = make_session(lease_owner=None)
        make_execution(parent, epoch=1, lease_owner="dead@host", lease_expires_at=utcnow() - timedelta(seconds=5))
    else:
        parent = make_session(lease_owner="dead@host", lease_expires_at=utcnow() - timedelta(seconds=5))
        add_message(parent, Role.USER, "hi")
    holder = _open_transaction(f"SELECT id FROM agent_session WHERE id = {parent} FOR UPDATE")
    sched = RecordingScheduler()
    caplog.set_level(logging.INFO)
    try:
        started = time.monotonic()
        scanner, reports = _scan_in_thread(sched)
        scanner.join(5)
        assert not scanner.is_alive(), f"the {step} step waited on the parent's row lock"
        assert time.monotonic() - started < 5
    finally:
        holder.close()
        scanner.join(10)
    assert reports[0].skipped == 1
    assert sched.resumed == [] and sched.deliveries == [] and sched.recoveries == []
    lines = [r.getMessage() for r in caplog.records]
    assert any("event=subagent_recovery_scan" in m and "skipped=1" in m for m in lines), lines
    again = RecordingScheduler()
    report = scan(again, callback_grace_seconds=0)
    assert report.skipped == 0, "the next pass takes it"


# --- server-side bounds on every connection ------------------------------------------------------


@pytest.fixture
def short_lease(db: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """LEASE_SECONDS=3 for this process: a transaction idle for 1.5 s is ended by the server."""
    from models.db import dispose_engines
    from settings import get_settings

    monkeypatch.setenv("LEASE_SECONDS", "3")
    get_settings.cache_clear()
    dispose_engines()
    yield
    dispose_engines()
    get_settings.cache_clear()


def test_a_transaction_stalled_with_a_row_locked_is_ended_by_the_server_within_half_a_lease(short_lease: None) -> None:
    from sqlalchemy.exc import OperationalError

    from harness.errors import is_infrastructure_error

    sid = make_session()
    stalled = _open_transaction(f"SELECT id FROM agent_session WHERE id = {sid} FOR UPDATE")
    try:
        time.sleep(2.5)  # the client stalls (SIGSTOP, a suspended VM) past half a lease
        with transaction() as s:
            got = s.execute(text(f"SELECT id FROM agent_session WHERE id = {sid} FOR UPDATE NOWAIT")).scalar_one()
        assert got == sid, "the row is free again"
        with pytest.raises(OperationalError) as cut:
            stalled.execute(text("SELECT 1"))
        assert is_infrastructure_error(cut.value), "a killed idle transaction is an infrastructure fault"
    finally:
        stalled.close()


def test_every_connection_asks_the_server_to_find_a_vanished_client_within_the_lease(short_lease: None) -> None:
    """Server-side TCP keepalives, ``tcp_user_timeout`` and ``client_connection_check_interval``
    (PostgreSQL 14+) on every connection, beside the idle-transaction and lock bounds."""
    names = (
        "idle_in_transaction_session_timeout",
        "lock_timeout",
        "tcp_keepalives_idle",
        "tcp_keepalives_interval",
        "tcp_keepalives_count",
        "tcp_user_timeout",
        "client_connection_check_interval",
    )
    with transaction() as s:
        rows = s.execute(text("SELECT name, setting FROM pg_settings WHERE name IN :names"), {"names": names}).all()
    # LEASE_SECONDS=3: half a lease is 1.5 s; probes every second (at least 1 s), 3 of them.
    assert dict(rows) == {
        "idle_in_transaction_session_timeout": "1500",
        "lock_timeout": "1500",
        "tcp_keepalives_idle": "1",
        "tcp_keepalives_interval": "1",
        "tcp_keepalives_count": "3",
        "tcp_user_timeout": "1500",
        "client_connection_check_interval": "1000",
    }


def test_a_client_that_vanishes_in_the_middle_of_a_statement_holds_its_row_locks_no_longer(short_lease: None) -> None:
    """The client's connection is reset while its statement runs on the server with a row
    locked: the server notices at its next client check, ends the statement and frees the row,
    instead of running the statement to its end for nobody."""
    from sqlalchemy.exc import OperationalError

    from models import get_engine
    from tests.faultproxy import FaultProxy

    sid = make_session()
    url = get_engine().url.render_as_string(hide_password=False)
    with FaultProxy.for_url(url) as proxy:
        conn = get_engine(proxy.rewrite(url)).connect()
        conn.begin()
        conn.execute(text(f"SELECT id FROM agent_session WHERE id = {sid} FOR UPDATE"))
        errors: list[BaseException] = []

        def long_statement() -> None:
            try:
                conn.execute(text("SELECT pg_sleep(60)"))
            except OperationalError as exc:
                errors.append(exc)

        runner = threading.Thread(target=long_statement, daemon=True)
        runner.start()
        time.sleep(0.3)  # the statement runs on the server
        assert proxy.cut_all() == 1  # the client is gone (both sides see a reset)
        cut = time.monotonic()

        def free() -> bool:
            try:
                with transaction() as s:
                    s.execute(text(f"SELECT id FROM agent_session WHERE id = {sid} FOR UPDATE NOWAIT"))
                return True
            except OperationalError:
                return False

        wait_until(free, timeout=10, interval=0.1, what="the vanished client's row lock released")
        assert time.monotonic() - cut < 3.0, "found at the next client check (every second here)"
        runner.join(5)
        assert errors, "the client saw its connection fail"
        conn.invalidate()
        conn.close()


def test_a_scan_statement_that_meets_a_lock_times_out_as_an_infrastructure_fault_never_a_result(
    short_lease: None,
) -> None:
    from sqlalchemy.exc import OperationalError

    from harness.errors import is_infrastructure_error
    from recovery.scan import scan_transaction

    sid = make_session()
    holder = _open_transaction(f"SELECT id FROM agent_session WHERE id = {sid} FOR UPDATE")
    try:
        started = time.monotonic()
        with pytest.raises(OperationalError) as cut, scan_transaction() as s:
            s.execute(text(f"UPDATE agent_session SET updated_at = now() WHERE id = {sid}"))
        assert time.monotonic() - started < 1.5, "the wait was bounded by the lock timeout"
        assert is_infrastructure_error(cut.value)
    finally:
        holder.close()


# --- a queued first run keeps its epoch ----------------------------------------------------------


def test_a_child_whose_first_run_is_still_queued_keeps_epoch_0_through_the_scans_and_its_queued_run_still_takes_it(
    db: str,
) -> None:
    from models import ExecutionStatus, SubagentExecution
    from models.execution import take_execution
    from tests.helpers import expire_leases

    parent = make_session()
    # The creation reservation names its creator (a booted worker); its run_child(eid, 0)
    # still waits in a long queue when it lapses.
    eid = make_execution(parent, lease_owner="creator@host", lease_expires_at=utcnow() - timedelta(seconds=1))
    for _ in range(3):
        sched = RecordingScheduler()
        scan(sched, callback_grace_seconds=0)
        assert [c for _, _, children in sched.recoveries for c in children] == [(eid, 0)]
        expire_leases()
    with transaction() as s:
        row = s.execute(select(SubagentExecution).where(SubagentExecution.id == eid)).scalar_one()
        assert (row.epoch, row.status, row.resends) == (0, ExecutionStatus.RUNNING, 3)
        taken = take_execution(
            s, eid, expected_epoch=0, to_status=ExecutionStatus.RUNNING, owner="runner@host", lease_seconds=30
        )
    assert taken == 1, "the queued first run is still valid"


# --- parents get the same re-send back-off -------------------------------------------------------


def test_a_queued_parent_run_is_re_sent_with_a_doubling_reservation_so_a_long_queue_is_not_flooded(
    model_factory: Any,
) -> None:
    from harness.views import create_session
    from settings import get_settings
    from tests.helpers import expire_leases

    model_factory([{"when": {}, "reply": {"content": "hello"}}])
    sid = create_session("main", "hi")  # reserved for agent.run(sid, 0), still in a long queue
    lease = get_settings().LEASE_SECONDS
    windows = []
    for _ in range(4):
        expire_leases()
        sched = RecordingScheduler()
        scan(sched, callback_grace_seconds=0)
        assert sched.resumed == [(sid, 0)]
        again = RecordingScheduler()
        scan(again, callback_grace_seconds=0)
        assert again.resumed == [], "nothing is re-sent while the reservation lasts"
        with transaction() as s:
            until = s.execute(select(S.lease_expires_at).where(S.id == sid)).scalar_one()
        assert until is not None
        windows.append(round((until - utcnow()).total_seconds() / lease))
    assert windows == [4, 8, 16, 32]


# --- a boot scan that meets a pass in flight runs right after it -------------------------------


def test_a_boot_scan_that_meets_a_pass_in_flight_runs_right_after_it_instead_of_being_dropped(db: str) -> None:
    from models.worker import release_scan_right, take_scan_right

    eid = make_execution(make_session(), lease_owner="gone@host", lease_expires_at=utcnow() - timedelta(seconds=5))
    with transaction() as s:
        assert take_scan_right(s, "beat/in-flight", 30)
    ends = threading.Timer(0.5, lambda: _release(release_scan_right, "beat/in-flight"))
    ends.start()
    sched = RecordingScheduler()
    try:
        report = scan(sched, callback_grace_seconds=0, wait_for_right=10)
    finally:
        ends.join()
    assert report.ran, "the boot scan was dropped"
    assert [eid for _, _, children in sched.recoveries for eid, _ in children] == [eid]


def _release(release: Any, holder: str) -> None:
    with transaction() as s:
        release(s, holder)


def test_the_boot_scan_task_asks_to_wait_for_the_pass_in_flight(db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import tasks.recovery as tasks_recovery

    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(tasks_recovery.scan_task, "apply_async", lambda **kw: sent.append(kw))
    tasks_recovery._boot_scan()
    assert sent == [{"kwargs": {"boot": True}}]


# --- record_boot is atomic for a name's first boot -----------------------------------------------


def test_two_processes_booting_at_once_under_a_new_name_get_two_generations_and_no_error(db: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from models.worker import record_boot

    names = [f"twin{i}@host" for i in range(10)]
    barrier = threading.Barrier(2 * len(names))

    def boot(name: str) -> int:
        barrier.wait(5)
        with transaction() as s:
            return record_boot(s, name)

    with ThreadPoolExecutor(2 * len(names)) as pool:
        futures = {name: [pool.submit(boot, name), pool.submit(boot, name)] for name in names}
        generations = {name: sorted(f.result(timeout=30) for f in pair) for name, pair in futures.items()}
    assert generations == {name: [1, 2] for name in names}


# --- a row with an unknown status is quarantined once --------------------------------------------


def test_an_execution_with_an_unknown_status_is_quarantined_once_and_the_rest_of_the_pass_goes_on(
    db: str, caplog: pytest.LogCaptureFixture
) -> None:
    from models import ExecutionStatus
    from recovery.metrics import build_registry

    corrupt_parent, healthy_parent = make_session(lease_owner=None), make_session(lease_owner=None)
    done = utcnow() - timedelta(seconds=60)
    corrupt = make_execution(corrupt_parent, status=ExecutionStatus.COMPLETED, completed_at=done)
    make_execution(healthy_parent, status=ExecutionStatus.COMPLETED, completed_at=done)
    with transaction() as s:  # a value written by a newer version (or a corrupt one)
        check = s.execute(
            text("SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'ck_subagent_execution_status'")
        ).scalar_one()
        s.execute(text("ALTER TABLE subagent_execution DROP CONSTRAINT ck_subagent_execution_status"))
        s.execute(text(f"UPDATE subagent_execution SET status = 'PAUSED_BY_FUTURE' WHERE id = {corrupt}"))
    caplog.set_level(logging.INFO)
    try:
        for _ in range(3):
            sched = RecordingScheduler()
            scan(sched, callback_grace_seconds=0)
            assert [p for p, _ in sched.deliveries] == [healthy_parent], "the corrupt parent is left alone"
    finally:  # this worker's later tests share the database: its schema goes back as it was
        with transaction() as s:
            s.execute(text(f"UPDATE subagent_execution SET status = 'COMPLETED' WHERE id = {corrupt}"))
            s.execute(text(f"ALTER TABLE subagent_execution ADD CONSTRAINT ck_subagent_execution_status {check}"))
    errors = [r.getMessage() for r in caplog.records if "event=execution_quarantined" in r.getMessage()]
    assert len(errors) == 1 and f"execution_id={corrupt}" in errors[0] and "PAUSED_BY_FUTURE" in errors[0]
    assert all(r.levelno == logging.ERROR for r in caplog.records if "event=execution_quarantined" in r.getMessage())
    scraped = {m.name: m.samples[0].value for m in build_registry().collect() if m.samples}
    assert scraped["agent_recovery_quarantined_executions"] == 1


# --- a monotonic clock that stood still ----------------------------------------------------------


def test_a_scan_right_written_by_a_clock_that_stood_still_is_refused_and_the_clock_resynced(db: str) -> None:
    import models.clock as clock
    from models.worker import renew_scan_right, take_scan_right

    utcnow()  # synced
    with transaction() as s:
        assert take_scan_right(s, "sleeper", 30)
    anchor = clock._anchor
    assert anchor is not None
    # The host was suspended for two minutes: CLOCK_MONOTONIC did not advance meanwhile, so the
    # estimate of the database's time is two minutes behind it.
    clock._anchor = (anchor[0], anchor[1] - timedelta(seconds=120))
    with transaction() as s:
        assert not renew_scan_right(s, "sleeper", 30), "a right that would already be past was written"
    assert abs((utcnow() - _db_now()).total_seconds()) < 5, "the clock was measured again"
    with transaction() as s:
        assert take_scan_right(s, "sleeper", 30), "once resynced, the right is taken again"


def _db_now() -> Any:
    with transaction() as s:
        return s.execute(text("SELECT now()")).scalar_one()


# --- the resume step is set-based, renews per batch and stops when the right is lost ------------


def test_the_resume_step_stops_at_the_batch_where_its_right_to_scan_passed_to_another_scanner(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import recovery.scan as scan_module
    from models import RecoveryScan
    from recovery.scan import ScanRight

    sessions = [
        make_session(lease_owner="dead@host", lease_expires_at=utcnow() - timedelta(seconds=5)) for _ in range(3)
    ]
    for sid in sessions:
        add_message(sid, Role.USER, "hi")
    monkeypatch.setattr(scan_module, "RESUME_BATCH", 1)
    thief = ScanRight()
    real_resume = RecordingScheduler.resume_parent

    def steal_after_first(self: RecordingScheduler, parent_id: int, epoch: int) -> None:
        real_resume(self, parent_id, epoch)
        with transaction() as s:  # another scanner takes the right while this one is frozen
            s.execute(update(RecoveryScan).where(RecoveryScan.id == 1).values(held_until=utcnow()))
        assert thief.take()

    monkeypatch.setattr(RecordingScheduler, "resume_parent", steal_after_first)
    sched = RecordingScheduler()
    report = scan(sched, callback_grace_seconds=0)
    assert report.right_lost and [sid for sid, _ in sched.resumed] == sessions[:1]


def test_the_resume_step_reserves_every_dead_plain_session_in_batches_each_once(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import recovery.scan as scan_module

    sessions = [
        make_session(lease_owner="dead@host", lease_expires_at=utcnow() - timedelta(seconds=5), epoch=2)
        for _ in range(5)
    ]
    for sid in sessions:
        add_message(sid, Role.USER, "hi")
    monkeypatch.setattr(scan_module, "RESUME_BATCH", 2)
    sched = RecordingScheduler()
    scan(sched, callback_grace_seconds=0)
    assert sched.resumed == [(sid, 3) for sid in sessions]


def test_a_session_lease_written_by_a_clock_that_stood_still_is_refused_and_the_clock_resynced(db: str) -> None:
    import models.clock as clock
    from models.session import fence_session

    sid = make_session(lease_owner="sleeper@host", lease_expires_at=utcnow() + timedelta(seconds=30), epoch=1)
    anchor = clock._anchor
    assert anchor is not None
    clock._anchor = (anchor[0], anchor[1] - timedelta(seconds=120))  # the monotonic clock stood still
    with transaction() as s:
        assert not fence_session(s, sid, epoch=1, lease_seconds=30), "a lease already past was written"
    with transaction() as s:
        assert fence_session(s, sid, epoch=1, lease_seconds=30), "once resynced, the owner renews"
        until = s.execute(select(S.lease_expires_at).where(S.id == sid)).scalar_one()
    assert until is not None and until > _db_now()


def _stand_still(seconds: float = 120) -> None:
    """The host was suspended: CLOCK_MONOTONIC did not advance meanwhile, so this process's
    estimate of the database's time is ``seconds`` behind it."""
    import models.clock as clock

    utcnow()  # synced
    anchor = clock._anchor
    assert anchor is not None
    clock._anchor = (anchor[0], anchor[1] - timedelta(seconds=seconds))


def test_a_session_take_and_renewal_by_a_clock_that_stood_still_are_refused_and_the_clock_resynced(db: str) -> None:
    from models.session import renew_session_lease, take_session

    sid = make_session(phase=Phase.RUNNING, epoch=1)
    _stand_still()
    with transaction() as s:
        taken = take_session(s, sid, expected_epoch=1, owner="sleeper@host", lease_seconds=30, to_phase=Phase.RUNNING)
    assert taken is None, "a lease already past was written by a take"
    with transaction() as s:
        assert take_session(s, sid, expected_epoch=1, owner="sleeper@host", lease_seconds=30, to_phase=Phase.RUNNING)
    _stand_still()
    with transaction() as s:
        assert not renew_session_lease(s, sid, 2, 30), "a lease already past was written by a renewal"
    with transaction() as s:
        assert renew_session_lease(s, sid, 2, 30), "once resynced, the owner renews"
        until = s.execute(select(S.lease_expires_at).where(S.id == sid)).scalar_one()
    assert until is not None and until > _db_now()


def test_an_execution_take_and_fence_by_a_clock_that_stood_still_are_refused_and_the_clock_resynced(db: str) -> None:
    from models import ExecutionStatus
    from models import SubagentExecution as E
    from models.execution import fence_execution, take_execution

    eid = make_execution(make_session(), epoch=1, lease_expires_at=utcnow() - timedelta(seconds=5))
    _stand_still()
    with transaction() as s:
        taken = take_execution(
            s, eid, expected_epoch=1, owner="sleeper@host", to_status=ExecutionStatus.RECOVERING, lease_seconds=30
        )
    assert taken is None, "a lease already past was written by a take"
    with transaction() as s:
        taken = take_execution(
            s, eid, expected_epoch=1, owner="sleeper@host", to_status=ExecutionStatus.RECOVERING, lease_seconds=30
        )
    assert taken == 2, "once resynced, the take lands"
    _stand_still()
    with transaction() as s:
        assert not fence_execution(s, eid, epoch=2, lease_seconds=30), "a lease already past was written by a fence"
    with transaction() as s:
        assert fence_execution(s, eid, epoch=2, lease_seconds=30), "once resynced, the owner renews"
        until = s.execute(select(E.lease_expires_at).where(E.id == eid)).scalar_one()
    assert until is not None and until > _db_now()


def test_every_path_waits_for_a_row_lock_at_most_half_a_lease_as_an_infrastructure_fault(short_lease: None) -> None:
    """A holder that is NOT idle (a statement of its own still running) keeps its row past the
    idle timeout; a delivery (and any other path) waiting behind it gives up within half a lease,
    as an infrastructure fault, and writes nothing."""
    from sqlalchemy.exc import OperationalError

    from harness.delivery import deliver_round
    from harness.errors import is_infrastructure_error

    sid = make_session(phase=Phase.RUNNING, epoch=1)
    holder = _open_transaction(f"SELECT id FROM agent_session WHERE id = {sid} FOR UPDATE")
    busy = threading.Thread(target=lambda: holder.execute(text("SELECT pg_sleep(4)")), daemon=True)
    busy.start()
    try:
        started = time.monotonic()
        with pytest.raises(OperationalError) as cut:
            deliver_round(sid, 1)
        waited = time.monotonic() - started
        assert 1.0 < waited < 3.0, f"the wait was cut at half a lease (1.5 s), not {waited:.1f} s"
        assert getattr(cut.value.orig, "pgcode", None) == "55P03"  # lock_not_available
        assert is_infrastructure_error(cut.value)
        with pytest.raises(OperationalError), transaction() as s:
            s.execute(text(f"UPDATE agent_session SET updated_at = now() WHERE id = {sid}"))
    finally:
        busy.join(timeout=10)
        holder.close()
