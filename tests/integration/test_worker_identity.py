"""Two live processes under one worker name, in-process: the older process is
still alive while a newer one boots under its name. Its leases are taken back once, it can take
or renew nothing any more, and the conflict is recorded for status and the metrics."""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import select

from harness.fence import ExecutionFence
from models import ExecutionStatus, LeaseLost, SubagentExecution, transaction
from models import worker as worker_model
from models.execution import finish_execution, take_execution
from models.worker import WorkerBoot, boot, check_name, lease_free, record_boot, set_identity
from tests.helpers import make_execution, make_session

E = SubagentExecution


@pytest.fixture
def worker_name(db: str) -> Iterator[str]:
    """A worker name of this test alone (worker_boot is not truncated between tests); the
    process's identity is restored after."""
    saved = worker_model.identity()
    name = f"it-{uuid.uuid4().hex[:8]}@host"
    yield name
    worker_model._identity = saved
    with transaction() as s:
        s.query(WorkerBoot).filter(WorkerBoot.name == name).delete()


def _take(eid: int, epoch: int, owner: str, to: ExecutionStatus = ExecutionStatus.RUNNING) -> int | None:
    with transaction() as s:
        return take_execution(
            s,
            eid,
            expected_epoch=epoch,
            to_status=to,
            owner=owner,
            lease_seconds=30,
        )


def _row(eid: int) -> SubagentExecution:
    with transaction() as s:
        row = s.execute(select(E).where(E.id == eid)).scalar_one()
        s.expunge(row)
        return row


def _takeable(eid: int) -> bool:
    """What the scan asks of a lease (models.worker.lease_free)."""
    with transaction() as s:
        return s.execute(select(E.id).where(E.id == eid, lease_free(E))).first() is not None


def test_a_newer_boot_takes_back_the_lease_of_an_older_process_that_still_lives_once(worker_name: str) -> None:
    older = boot(worker_name)  # this process is the older one
    parent = make_session()
    eid = make_execution(parent)
    child = _row(eid).child_session_id
    assert _take(eid, 0, worker_name) == 1
    assert _row(eid).lease_generation == older
    fence = ExecutionFence(session_id=child, epoch=1, lease_seconds=30, execution_id=eid)
    assert fence.renew() and not _takeable(eid)  # a live lease of the current generation

    with transaction() as s:  # another process boots under the same name; this one lives on
        newer = record_boot(s, worker_name)
    assert newer > older
    assert _takeable(eid)  # known replaced: taken back at once, without waiting for the lease

    # The older process can no longer renew, write or take anything.
    assert fence.renew() is False
    with pytest.raises(LeaseLost), transaction() as s:
        ExecutionFence(session_id=child, epoch=1, lease_seconds=30, execution_id=eid).check(s)
    with transaction() as s:  # a cancel or failure of its own child is not written either
        assert not finish_execution(s, eid, epoch=1, status=ExecutionStatus.CANCELLED, result={"success": False})
    assert _row(eid).status == ExecutionStatus.RUNNING
    other = make_execution(parent)
    assert _take(other, 0, worker_name) is None
    assert _row(other).epoch == 0

    # The newer process takes it back once; from then on nobody takes it (no second theft).
    set_identity(worker_name, newer)
    assert _take(eid, 1, worker_name, ExecutionStatus.RECOVERING) == 2
    assert _row(eid).lease_generation == newer
    assert not _takeable(eid)
    set_identity(worker_name, older)
    assert _take(eid, 2, worker_name, ExecutionStatus.RECOVERING) is None
    assert _row(eid).epoch == 2 and _row(eid).lease_generation == newer


def test_the_older_process_records_the_conflict_and_status_shows_it_live(worker_name: str, db: str) -> None:
    from recovery.ops import status_report

    db_url = db
    older = boot(worker_name)
    assert check_name(worker_name, older) is None  # alone under its name: nothing to say
    assert all(c["worker"] != worker_name for c in status_report()["worker_name_conflicts"])
    with transaction() as s:
        newer = record_boot(s, worker_name)
    assert check_name(worker_name, older) == newer
    assert check_name(worker_name, newer) is None  # the newer process is not in conflict
    (row,) = [c for c in status_report()["worker_name_conflicts"] if c["worker"] == worker_name]
    assert row["older_generation"] == older and row["generation"] == newer and row["live"] is True

    from tests.integration.test_cli_input import cli

    shown = cli("status", env={"DATABASE_URL": db_url})
    assert shown.returncode == 0, shown.stderr
    assert f"worker name conflict {worker_name}: generation {older} ran beside generation {newer}" in shown.stdout
    assert "two live processes share this name" in shown.stdout
    listed = cli("status", "--json", env={"DATABASE_URL": db_url})
    assert any(c["worker"] == worker_name for c in json.loads(listed.stdout)["worker_name_conflicts"])


def test_a_boot_clears_the_conflict_and_a_still_living_older_process_records_it_again(worker_name: str) -> None:
    from recovery.ops import worker_name_conflicts

    older = boot(worker_name)
    with transaction() as s:
        record_boot(s, worker_name)
    check_name(worker_name, older)
    with transaction() as s:
        newest = record_boot(s, worker_name)
    assert all(c["worker"] != worker_name for c in worker_name_conflicts())
    assert check_name(worker_name, older) == newest
    assert [c["generation"] for c in worker_name_conflicts() if c["worker"] == worker_name] == [newest]


def test_the_name_watcher_logs_the_conflict_at_error_once(worker_name: str, caplog: pytest.LogCaptureFixture) -> None:
    from tasks.signals import NameWatcher

    older = boot(worker_name)
    watcher = NameWatcher(None, worker_name, older, period_seconds=60)
    assert watcher.tick() is None
    with transaction() as s:
        newer = record_boot(s, worker_name)
    with caplog.at_level(logging.INFO, logger="tasks.signals"):
        assert watcher.tick() == newer
        assert watcher.tick() == newer
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "event=worker_name_conflict" in errors[0]
    assert errors[0] == (
        f"event=worker_name_conflict worker={worker_name} generation={older} newer_generation={newer} "
        f"hostname=- pid={os.getpid()} action=stopped_consuming"
    )


def test_the_metrics_count_a_name_two_live_processes_share(worker_name: str) -> None:
    from recovery.metrics import RecoveryCollector

    def conflicts() -> float:
        metrics = {m.name: m for m in RecoveryCollector().collect()}
        return float(metrics["agent_recovery_worker_name_conflicts"].samples[0].value)

    before = conflicts()
    older = boot(worker_name)
    with transaction() as s:
        record_boot(s, worker_name)
    check_name(worker_name, older)
    assert conflicts() == before + 1


def test_the_scan_takes_back_a_lease_of_a_replaced_process_that_still_lives_exactly_once(worker_name: str) -> None:
    from recovery.scan import scan
    from tests.helpers import RecordingScheduler

    older = boot(worker_name)
    parent = make_session()
    eid = make_execution(parent)
    assert _take(eid, 0, worker_name) == 1
    assert eid not in scan(RecordingScheduler()).recovering  # a live lease of the current generation

    with transaction() as s:
        newer = record_boot(s, worker_name)
    first = scan(RecordingScheduler())
    assert eid in first.recovering
    reserved = _row(eid)
    assert reserved.epoch == 2 and reserved.lease_owner is None

    assert _take(eid, 2, worker_name, ExecutionStatus.RECOVERING) is None  # the older one: refused
    set_identity(worker_name, newer)
    assert _take(eid, 2, worker_name, ExecutionStatus.RECOVERING) == 3  # the newer one
    for _ in range(3):
        assert eid not in scan(RecordingScheduler()).recovering
    assert _row(eid).epoch == 3 and _row(eid).lease_generation == newer
    assert older < newer


# --- a boot pass leaves a restarted creator's first runs to their queued messages ---------------


def _first_run(parent: int, creator: str, generation: int, *, expires_in: float = 60.0) -> int:
    """A child created by ``creator`` and never taken: epoch 0, its creation reservation."""
    from datetime import timedelta

    from models.base import utcnow

    return make_execution(
        parent,
        epoch=0,
        lease_owner=creator,
        lease_generation=generation,
        lease_expires_at=utcnow() + timedelta(seconds=expires_in),
    )


def test_a_boot_pass_leaves_the_first_runs_of_a_restarted_creator_and_a_plain_pass_sends_them(
    worker_name: str,
) -> None:
    """The broker holds as many messages in the children's queue as the boot pass is told: it
    leaves that many of the NEWEST first runs (a queue is consumed oldest first: the oldest
    were fetched by the dead process) and re-sends the others at once."""
    from recovery.scan import scan
    from tests.helpers import RecordingScheduler

    older = boot(worker_name)
    parent = make_session()
    fetched = _first_run(parent, worker_name, older)  # the dead process had fetched its message
    queued = _first_run(parent, worker_name, older)
    running = make_execution(parent)
    assert _take(running, 0, worker_name) == 1  # the dead process was running this one
    with transaction() as s:
        record_boot(s, worker_name)  # it restarted under its name: every row is free now
    assert _takeable(queued) and _takeable(fetched) and _takeable(running)

    report = scan(RecordingScheduler(), leave_first_runs=1)
    assert sorted(report.recovering) == sorted([fetched, running]) and report.left_to_queue == 1
    left = _row(queued)
    assert (left.epoch, left.lease_owner, left.resends) == (0, worker_name, 0), "left as it was"
    assert _row(fetched).resends == 1

    # Its queued message finds it as it was created; lost, the next plain pass sends it.
    again = scan(RecordingScheduler())
    assert again.recovering == [queued] and again.left_to_queue == 0
    resent = _row(queued)
    assert (resent.epoch, resent.lease_owner, resent.resends) == (0, None, 1)  # the same epoch


def test_a_boot_pass_told_of_no_queued_message_or_a_lapsed_creation_leaves_nothing(worker_name: str) -> None:
    from recovery.scan import scan
    from tests.helpers import RecordingScheduler

    older = boot(worker_name)
    parent = make_session()
    lapsed = _first_run(parent, worker_name, older, expires_in=-5.0)
    with transaction() as s:
        record_boot(s, worker_name)
    report = scan(RecordingScheduler(), leave_first_runs=5)
    assert report.recovering == [lapsed] and report.left_to_queue == 0

    alive = _first_run(make_session(), worker_name, older)
    report = scan(RecordingScheduler(), leave_first_runs=0)  # the broker lost its messages
    assert report.recovering == [alive] and report.left_to_queue == 0


def test_the_boot_scan_task_sends_a_pass_behind_the_first_runs_it_left(monkeypatch: pytest.MonkeyPatch) -> None:
    import tasks.recovery as tasks_recovery
    from crashpoints import InjectedFault, armed_fault
    from recovery.scan import ScanReport

    passes: list[dict[str, object]] = []
    sent: list[dict[str, object]] = []

    def fake_scan(_scheduler: object, **kwargs: object) -> ScanReport:
        passes.append(kwargs)
        return ScanReport(left_to_queue=min(2, int(kwargs["leave_first_runs"])))  # type: ignore[call-overload]

    depth: dict[str, int | None] = {"queued": 7}
    monkeypatch.setattr(tasks_recovery, "scan", fake_scan)
    monkeypatch.setattr(tasks_recovery, "queued_children", lambda: depth["queued"])
    monkeypatch.setattr(tasks_recovery.scan_task, "apply_async", lambda **kw: sent.append(kw))

    assert tasks_recovery.scan_task(boot=True)["left_to_queue"] == 2
    assert passes[-1]["leave_first_runs"] == 7 and float(passes[-1]["wait_for_right"]) > 0  # type: ignore[arg-type]
    (behind,) = sent
    assert behind["kwargs"] == {"behind_queue": True}
    assert behind["queue"].name == tasks_recovery.app.amqp.router.route({}, "agent.run_child")["queue"].name  # type: ignore[attr-defined]

    # The pass behind the queue leaves nothing and waits for the right as a boot pass does.
    tasks_recovery.scan_task(behind_queue=True)
    assert passes[-1]["leave_first_runs"] == 0 and float(passes[-1]["wait_for_right"]) > 0  # type: ignore[arg-type]
    # A beat's pass neither leaves nor waits.
    tasks_recovery.scan_task()
    assert passes[-1] == {"wait_for_right": 0.0, "leave_first_runs": 0}
    # A broker that cannot tell its queue's depth: nothing is left.
    depth["queued"] = None
    tasks_recovery.scan_task(boot=True)
    assert passes[-1]["leave_first_runs"] == 0
    assert len(sent) == 1, "only a pass that left first runs sends one"

    # Killed before it sends it: nothing is lost, the rows stay dead to the beat's next pass.
    sent.clear()
    depth["queued"] = 7
    with armed_fault("scan.before_pass_behind_queue"), pytest.raises(InjectedFault):
        tasks_recovery.scan_task(boot=True)
    assert sent == []


def test_the_depth_of_the_childrens_queue_is_read_from_the_broker(db: str) -> None:
    import redis

    import tasks.recovery as tasks_recovery

    app = tasks_recovery.app
    broker = redis.Redis.from_url(app.conf.broker_url)
    broker.flushdb()
    try:
        assert tasks_recovery.queued_children() == 0  # a broker that knows no queue holds none
        for eid in (1, 2):
            app.signature("agent.run_child", args=(eid, 0)).apply_async()
        assert tasks_recovery.queued_children() == 2
    finally:
        broker.flushdb()
        broker.close()
