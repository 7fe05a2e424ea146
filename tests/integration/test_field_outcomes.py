"""Pipeline outcomes on real PostgreSQL and the stand-in over HTTP: a hostile
nesting depth fails closed, an answer whose patches are rejected needs review,
a lost lease stops the owner's call, an invocation and its artifacts carry their
retention."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from doubles.superagent import Behaviour, SuperAgentStub
from fieldrecovery.orchestrator import FieldRecoveryOrchestrator, RecoveryRun, RecoveryStatus
from fieldrecovery.schemas import Provenance
from settings import FieldRecoverySettings
from tests.field_helpers import clean_field_tables, sample_eml, wait_until

KEY = "df_open_outcomes_test"
AMBIGUOUS = sample_eml("ambiguous")


@pytest.fixture
def field_db(db: str) -> Iterator[str]:
    clean_field_tables(db)
    yield db


@pytest.fixture
def stub() -> Iterator[SuperAgentStub]:
    with SuperAgentStub(api_key=KEY) as server:
        yield server


def _settings(stub: SuperAgentStub, **changes: Any) -> FieldRecoverySettings:
    return FieldRecoverySettings.model_validate(
        {"enabled": True, "open_api": {"base_url": stub.base_url, "api_key": KEY}, "max_wait": 5, **changes}
    )


def _rows(url: str, sql: str) -> list[dict[str, Any]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(text(sql))]
    finally:
        engine.dispose()


def test_deeply_nested_answer_fails_closed_and_the_next_stage_still_runs(field_db: str, stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.DEEP_JSON, deep_json_depth=50_000)
    seen: list[RecoveryRun] = []
    run = FieldRecoveryOrchestrator(_settings(stub), url=field_db, next_stage=seen.append).process(AMBIGUOUS)
    assert seen == [run]
    assert (run.status, run.error_code, run.provider_calls) == (RecoveryStatus.FAILED, "output_not_json", 1)
    assert {f.provenance for f in run.view.facts} == {Provenance.PARSER}
    [row] = _rows(field_db, "SELECT status, error_code FROM th_hotel_booking.field_recovery_invocation")
    assert (row["status"], row["error_code"]) == ("FAILED", "output_not_json")


def test_an_answer_whose_every_patch_is_rejected_needs_review(field_db: str, stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.REJECT_ALL)
    orchestrator = FieldRecoveryOrchestrator(_settings(stub), url=field_db)
    run = orchestrator.process(AMBIGUOUS)
    assert run.status == RecoveryStatus.SUCCEEDED and run.needs_review
    assert run.assembly is not None and run.assembly.accepted == [] and len(run.assembly.rejected) == 3
    assert run.to_json()["needs_review"] is True and run.summary()["needs_review"] is True
    assert {f.provenance for f in run.view.facts} == {Provenance.PARSER}
    replay = orchestrator.process(AMBIGUOUS)  # the stored assembly still says so
    assert replay.replayed and replay.needs_review


def test_a_clean_answer_does_not_need_review(field_db: str, stub: SuperAgentStub) -> None:
    run = FieldRecoveryOrchestrator(_settings(stub), url=field_db).process(AMBIGUOUS)
    assert run.status == RecoveryStatus.SUCCEEDED and not run.needs_review
    assert run.to_json()["needs_review"] is False


def test_an_owner_that_loses_its_lease_stops_calling_and_cancels_the_run(field_db: str, stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.SLOW, stall_seconds=20)
    result: list[RecoveryRun] = []
    settings = _settings(stub, max_wait=15, lease_seconds=0.3)
    worker = threading.Thread(
        target=lambda: result.append(FieldRecoveryOrchestrator(settings, url=field_db).process(AMBIGUOUS))
    )
    worker.start()
    assert wait_until(lambda: stub.stats()["streams"] == 1, timeout=3)
    engine = create_engine(field_db)
    with engine.begin() as conn:  # a newer owner takes the row over while the call is in flight
        conn.execute(
            text("UPDATE th_hotel_booking.field_recovery_invocation SET epoch = epoch + 1, owner_id = 'usurper'")
        )
    engine.dispose()
    fenced_at = time.monotonic()
    worker.join(5)
    assert time.monotonic() - fenced_at < 1.5  # not the 15 s deadline
    [run] = result
    assert (run.status, run.error_code) == (RecoveryStatus.FAILED, "invocation_lost")
    assert len(stub.cancelled_runs) == 1 and stub.stats()["run_status"] == 0
    [row] = _rows(field_db, "SELECT status, owner_id FROM th_hotel_booking.field_recovery_invocation")
    assert (row["status"], row["owner_id"]) == ("IN_PROGRESS", "usurper")  # the lost owner wrote nothing


def test_invocation_and_artifacts_are_kept_for_the_configured_retention(field_db: str, stub: SuperAgentStub) -> None:
    FieldRecoveryOrchestrator(_settings(stub, retention_days=7), url=field_db).process(AMBIGUOUS)
    days = _rows(
        field_db,
        "SELECT extract(epoch FROM retention_until - created_at) / 86400 AS days"
        " FROM th_hotel_booking.field_recovery_invocation"
        " UNION ALL SELECT extract(epoch FROM retention_until - created_at) / 86400"
        " FROM th_hotel_booking.field_recovery_artifact",
    )
    assert len(days) == 5 and all(abs(float(d["days"]) - 7) < 0.01 for d in days)
