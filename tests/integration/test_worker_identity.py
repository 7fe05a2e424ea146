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
