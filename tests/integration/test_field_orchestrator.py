"""The MANUAL_EML pipeline end to end: real PostgreSQL + the stand-in over HTTP (docs/field-recovery.md).

Covers the orchestrator items (MANUAL_EML recovers before continuing, AGENTBUS does not call),
the adapter failure modes as the pipeline records them, replay, the concurrent claim, the
stale IN_PROGRESS takeover (on and off) and apply-once of the assembly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import create_engine, event, text

from doubles.superagent import Behaviour, SuperAgentStub
from doubles.superagent_agent import answer_for
from fieldrecovery.eml import parse_eml
from fieldrecovery.orchestrator import FieldRecoveryOrchestrator, RecoveryRun, RecoveryStatus
from fieldrecovery.request_builder import build_request, render_message, request_hash
from fieldrecovery.schemas import Provenance, SourceKind
from fieldrecovery.store import InvocationMeta, InvocationStore, ProviderAudit
from models.db import get_engine
from settings import FieldRecoverySettings
from tests.field_helpers import clean_field_tables, sample_eml, wait_until

KEY = "df_open_orchestrator_test"
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
    open_api = {"base_url": stub.base_url, "api_key": KEY, **changes.pop("open_api", {})}
    return FieldRecoverySettings.model_validate(
        {"enabled": True, "open_api": open_api, "max_wait": 5, "poll_interval": 0.02, **changes}
    )


def _process(url: str, settings: FieldRecoverySettings, raw: bytes = AMBIGUOUS, **kw: Any) -> RecoveryRun:
    return FieldRecoveryOrchestrator(settings, url=url).process(raw, **kw)


def _rows(url: str, table: str) -> list[dict[str, Any]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(text(f"SELECT * FROM th_hotel_booking.{table} ORDER BY id"))]
    finally:
        engine.dispose()


def _artifact_types(url: str) -> list[str]:
    return [r["artifact_type"] for r in _rows(url, "field_recovery_artifact")]


def _facts(run: RecoveryRun) -> dict[str, tuple[str | None, str]]:
    return {f.field: (f.value, f.provenance.value) for f in run.view.facts}


def _key(attempt: int = 1, profile_version: str = "fixed-channel-field-recovery-qbd-v1") -> str:
    request = build_request(parse_eml(AMBIGUOUS), profile_version=profile_version, attempt=attempt)
    assert request is not None
    return request.idempotency_key


def test_manual_eml_recovers_and_persists_everything_before_the_next_stage(field_db: str, stub: SuperAgentStub) -> None:
    seen: dict[str, Any] = {}

    def next_stage(run: RecoveryRun) -> None:
        # What the next stage can read at the moment it starts.
        seen["run"] = run
        seen["invocations"] = _rows(field_db, "field_recovery_invocation")
        seen["artifacts"] = _artifact_types(field_db)

    run = FieldRecoveryOrchestrator(_settings(stub), url=field_db, next_stage=next_stage).process(AMBIGUOUS)
    assert seen["run"] is run
    assert run.status == RecoveryStatus.SUCCEEDED and not run.replayed and run.provider_calls == 1
    assert _facts(run)["arrival_date"] == ("2026-03-05", "RECOVERY")
    assert _facts(run)["departure_date"] == ("2026-03-07", "RECOVERY")
    assert _facts(run)["room_type"] == ("Deluxe King", "RECOVERY")
    assert _facts(run)["guest_name"] == ("Jane Doe", "PARSER")
    assert seen["artifacts"] == ["PARSED_FACT_SET", "RECOVERY_REQUEST", "RECOVERY_ASSEMBLY", "EFFECTIVE_FACT_VIEW"]
    [row] = seen["invocations"]
    assert row["status"] == "SUCCEEDED" and row["assembly_result"] is not None
    # Metadata recorded for the audit (docs/field-recovery.md).
    assert row["idempotency_key"] == run.idempotency_key == _key()
    assert row["source_message_id"] == "<fc-20260305-0042@fixed-channel.example>" and row["source_revision"] == 1
    assert row["provider_session_id"].startswith("ses_") and row["provider_run_id"].startswith("run_")
    assert (row["resolved_profile_id"], row["resolved_profile_version"]) == ("prof_fixed_channel_recovery", "7")
    assert (row["model"], row["total_tokens"]) == ("superagent-stub-1", 976)
    assert row["duration_ms"] >= 0 and len(row["request_hash"]) == len(row["response_hash"]) == 64
    assert row["patch_set"]["idempotency_key"] == row["idempotency_key"]
    assert row["error_code"] is None and row["completed_at"] >= row["started_at"] >= row["created_at"]
    view = _rows(field_db, "field_recovery_artifact")[-1]["content"]
    assert {f["field"]: f["provenance"] for f in view["facts"]}["room_type"] == "RECOVERY"


def test_agentbus_source_never_calls_the_provider(field_db: str, stub: SuperAgentStub) -> None:
    run = _process(field_db, _settings(stub), source=SourceKind.AGENTBUS)
    assert run.status == RecoveryStatus.SKIPPED and run.provider_calls == 0
    assert all(f.provenance == Provenance.PARSER for f in run.view.facts)
    assert stub.stats()["sessions"] == stub.stats()["streams"] == 0
    assert _rows(field_db, "field_recovery_invocation") == []
    assert _artifact_types(field_db) == ["PARSED_FACT_SET"]


def test_default_off_configuration_never_builds_a_client_nor_calls(field_db: str, stub: SuperAgentStub) -> None:
    built: list[object] = []
    orchestrator = FieldRecoveryOrchestrator(
        FieldRecoverySettings(),
        url=field_db,
        client_factory=lambda s: built.append(s),  # type: ignore[arg-type, func-returns-value]
    )
    run = orchestrator.process(AMBIGUOUS)
    assert run.status == RecoveryStatus.SKIPPED and built == []
    assert stub.stats()["sessions"] == 0 and _rows(field_db, "field_recovery_invocation") == []


def test_no_recoverable_task_is_a_parser_baseline_without_a_call(field_db: str, stub: SuperAgentStub) -> None:
    run = _process(field_db, _settings(stub), sample_eml("clean"))
    assert run.status == RecoveryStatus.NO_TASKS and run.provider_calls == 0
    assert _facts(run)["room_type"] == ("Superior Twin", "PARSER")
    assert stub.stats()["sessions"] == 0 and _rows(field_db, "field_recovery_invocation") == []


def test_succeeded_invocation_replays_without_calling_the_provider(field_db: str, stub: SuperAgentStub) -> None:
    first = _process(field_db, _settings(stub))
    second = _process(field_db, _settings(stub))
    assert (second.status, second.replayed, second.provider_calls) == (RecoveryStatus.SUCCEEDED, True, 0)
    assert second.view == first.view and second.assembly == first.assembly
    assert stub.stats()["streams"] == 1 and stub.stats()["sessions"] == 1
    assert len(_rows(field_db, "field_recovery_invocation")) == 1
    assert len(_artifact_types(field_db)) == 4  # identical artifacts are not written twice


def test_replay_returns_the_stored_assembly_not_a_new_overlay(field_db: str, stub: SuperAgentStub) -> None:
    _process(field_db, _settings(stub))
    engine = create_engine(field_db)
    with engine.begin() as conn:  # the stored assembly is the one that counts, even if it differs
        conn.execute(
            text(
                "UPDATE th_hotel_booking.field_recovery_invocation SET assembly_result ="
                " json_build_object('schema_version', '1', 'request_id', request_id, 'idempotency_key',"
                " idempotency_key, 'accepted', '[]'::json, 'rejected', '[]'::json, 'unresolved', '[]'::json)"
            )
        )
    engine.dispose()
    replay = _process(field_db, _settings(stub))
    assert replay.replayed and replay.assembly is not None and replay.assembly.accepted == []
    assert _facts(replay)["room_type"] == (None, "PARSER")
    assert stub.stats()["streams"] == 1


def test_a_replay_of_an_applied_key_is_one_read_and_writes_nothing(field_db: str, stub: SuperAgentStub) -> None:
    first = _process(field_db, _settings(stub))
    engine = get_engine(field_db)
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        replay = _process(field_db, _settings(stub))
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert (replay.status, replay.replayed, replay.provider_calls) == (RecoveryStatus.SUCCEEDED, True, 0)
    assert replay.assembly == first.assembly and replay.view == first.view
    # The invocation, its assembly and which artifacts are stored: one SELECT, nothing else.
    assert len(statements) == 1 and statements[0].startswith("SELECT"), statements


def test_a_succeeded_key_without_its_assembly_is_assembled_once_by_the_next_replay(
    field_db: str, stub: SuperAgentStub
) -> None:
    first = _process(field_db, _settings(stub))
    engine = create_engine(field_db)
    with engine.begin() as conn:  # the owner died between storing the PatchSet and the assembly
        conn.execute(text("UPDATE th_hotel_booking.field_recovery_invocation SET assembly_result = NULL"))
        conn.execute(
            text(
                "DELETE FROM th_hotel_booking.field_recovery_artifact"
                " WHERE artifact_type IN ('RECOVERY_ASSEMBLY', 'EFFECTIVE_FACT_VIEW')"
            )
        )
    engine.dispose()
    replays = [_process(field_db, _settings(stub)) for _ in range(2)]
    assert all(r.status == RecoveryStatus.SUCCEEDED and r.replayed and r.provider_calls == 0 for r in replays)
    assert replays[0].assembly == replays[1].assembly == first.assembly
    [row] = _rows(field_db, "field_recovery_invocation")
    assert first.assembly is not None and row["assembly_result"] == first.assembly.model_dump(mode="json")
    assert sorted(_artifact_types(field_db)) == sorted(
        ["PARSED_FACT_SET", "RECOVERY_REQUEST", "RECOVERY_ASSEMBLY", "EFFECTIVE_FACT_VIEW"]
    )
    assert stub.stats()["sessions"] == 1


@pytest.mark.parametrize(
    ("behaviour", "code", "changes"),
    [
        (Behaviour.FENCED, "output_fenced", {}),
        (Behaviour.PROSE, "output_prose", {}),
        (Behaviour.UNKNOWN_FIELD, "output_unknown_field", {}),
        (Behaviour.NON_JSON, "output_not_json", {}),
        (Behaviour.OVERSIZE, "response_too_large", {"max_response_chars": 20_000}),
    ],
)
def test_invalid_answer_fails_closed_with_its_code_and_no_patch_applied(
    field_db: str, stub: SuperAgentStub, behaviour: Behaviour, code: str, changes: dict[str, Any]
) -> None:
    stub.configure(behaviour=behaviour, oversize_chars=30_000)
    run = _process(field_db, _settings(stub, **changes))
    assert (run.status, run.error_code, run.provider_calls) == (RecoveryStatus.FAILED, code, 1)
    assert all(f.provenance == Provenance.PARSER for f in run.view.facts)
    assert _facts(run)["arrival_date"] == (None, "PARSER")
    [row] = _rows(field_db, "field_recovery_invocation")
    assert (row["status"], row["error_code"], row["patch_set"]) == ("FAILED", code, None)
    assert row["response_hash"] is not None and row["provider_run_id"] is not None
    assert "EFFECTIVE_FACT_VIEW" not in _artifact_types(field_db)


@pytest.mark.parametrize(
    ("behaviour", "code"),
    [
        (Behaviour.SERVER_ERROR, "http_500"),
        (Behaviour.UNAUTHORIZED, "http_401"),
        (Behaviour.RUN_FAILED, "run_failed"),
        (Behaviour.STATUS_FAILED, "run_status_failed"),
        (Behaviour.CUT_UNRECOVERABLE, "sse_recovery_exhausted"),
    ],
)
def test_provider_failure_fails_closed_and_is_recorded(
    field_db: str, stub: SuperAgentStub, behaviour: Behaviour, code: str
) -> None:
    stub.configure(behaviour=behaviour, cut_mid_event=True)
    run = _process(field_db, _settings(stub, open_api={"sse_recovery_max_attempts": 1}))
    assert (run.status, run.error_code, run.provider_calls) == (RecoveryStatus.FAILED, code, 1)
    assert _facts(run)["room_type"] == (None, "PARSER")
    [row] = _rows(field_db, "field_recovery_invocation")
    assert (row["status"], row["error_code"]) == ("FAILED", code)
    assert row["error_summary"] and row["completed_at"] is not None


def test_deadline_cancels_the_in_flight_run_and_records_the_failure(field_db: str, stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.SLOW, stall_seconds=20)
    started = time.monotonic()
    run = _process(field_db, _settings(stub, max_wait=1))
    elapsed = time.monotonic() - started
    assert (run.status, run.error_code) == (RecoveryStatus.FAILED, "deadline_exceeded")
    assert elapsed < 2.5
    [row] = _rows(field_db, "field_recovery_invocation")
    assert (row["status"], row["error_code"]) == ("FAILED", "deadline_exceeded")
    assert stub.cancelled_runs == [row["provider_run_id"]]
    assert 900 <= row["duration_ms"] < 2500
    assert _facts(run)["arrival_date"] == (None, "PARSER")


def test_request_over_max_message_chars_is_never_sent(field_db: str, stub: SuperAgentStub) -> None:
    run = _process(field_db, _settings(stub, max_message_chars=500))
    assert (run.status, run.error_code, run.provider_calls) == (RecoveryStatus.FAILED, "request_too_large", 0)
    assert stub.stats()["sessions"] == 0
    [row] = _rows(field_db, "field_recovery_invocation")
    assert (row["status"], row["error_code"]) == ("FAILED", "request_too_large")


def test_failed_invocation_replays_its_failure_and_a_new_attempt_calls_again(
    field_db: str, stub: SuperAgentStub
) -> None:
    stub.configure(behaviour=Behaviour.SERVER_ERROR)
    _process(field_db, _settings(stub))
    stub.configure(behaviour=Behaviour.NORMAL)
    replay = _process(field_db, _settings(stub))
    assert (replay.status, replay.error_code, replay.replayed, replay.provider_calls) == (
        RecoveryStatus.FAILED,
        "http_500",
        True,
        0,
    )
    assert stub.stats()["streams"] == 0  # the failure came at the session call
    retry = _process(field_db, _settings(stub), attempt=2)
    assert retry.status == RecoveryStatus.SUCCEEDED and retry.idempotency_key == _key(attempt=2)
    assert stub.stats()["streams"] == 1


def test_broken_stream_is_recovered_and_applied(field_db: str, stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.CUT_REPLAYABLE, cut_mid_event=True, cut_after=3)
    run = _process(field_db, _settings(stub))
    assert run.status == RecoveryStatus.SUCCEEDED
    assert _facts(run)["departure_date"] == ("2026-03-07", "RECOVERY")
    assert stub.stats()["events_replays"] == 1


def test_rejected_patches_are_reported_and_never_change_parser_facts(field_db: str, stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.BAD_PATCH)
    run = _process(field_db, _settings(stub))
    assert run.status == RecoveryStatus.SUCCEEDED
    assert run.to_json()["rejected"] == [
        {"task_id": "task-arrival_date", "reason": "candidate_value_mismatch"},
        {"task_id": "task-departure_date", "reason": "dependency_unresolved"},
    ]
    assert _facts(run)["arrival_date"] == (None, "PARSER")
    assert _facts(run)["departure_date"] == (None, "PARSER")
    assert _facts(run)["room_type"] == ("Deluxe King", "RECOVERY")


def test_concurrent_callers_share_one_provider_call_and_one_result(field_db: str, stub: SuperAgentStub) -> None:
    stub.configure(event_delay=0.1)  # the owner's call takes ~0.5 s: the others must wait
    settings = _settings(stub)
    barrier = threading.Barrier(6)

    def call(_: int) -> RecoveryRun:
        barrier.wait()
        return _process(field_db, settings)

    with ThreadPoolExecutor(6) as pool:
        runs = list(pool.map(call, range(6)))
    assert {r.status for r in runs} == {RecoveryStatus.SUCCEEDED}
    assert sorted(r.provider_calls for r in runs) == [0, 0, 0, 0, 0, 1]
    assert sum(not r.replayed for r in runs) == 1
    assert all(r.view == runs[0].view for r in runs)
    assert stub.stats()["streams"] == 1 and stub.stats()["sessions"] == 1
    assert len(_rows(field_db, "field_recovery_invocation")) == 1


def _claim_as_other_owner(url: str, lease_seconds: float) -> InvocationStore:
    request = build_request(parse_eml(AMBIGUOUS), profile_version="fixed-channel-field-recovery-qbd-v1")
    assert request is not None
    store = InvocationStore(url, lease_seconds=lease_seconds)
    meta = InvocationMeta(
        idempotency_key=request.idempotency_key,
        request_id=request.request_id,
        attempt=1,
        source_message_id=request.source.message_id,
        source_revision=request.source.revision,
        observation_hash=request.observation_hash,
        profile_version=request.profile_version,
        request_hash=request_hash(render_message(request)),
    )
    assert store.claim(meta, "other-owner", stale_takeover=True).owned
    return store


def test_caller_waits_for_a_live_owner_only_until_its_own_deadline(field_db: str, stub: SuperAgentStub) -> None:
    _claim_as_other_owner(field_db, lease_seconds=60)
    started = time.monotonic()
    run = _process(field_db, _settings(stub, max_wait=0.5, stale_takeover=True))
    assert (run.status, run.error_code, run.provider_calls) == (RecoveryStatus.FAILED, "invocation_in_progress", 0)
    assert 0.5 <= time.monotonic() - started < 1.5
    assert stub.stats()["sessions"] == 0
    [row] = _rows(field_db, "field_recovery_invocation")
    assert (row["status"], row["owner_id"]) == ("IN_PROGRESS", "other-owner")  # a waiter writes nothing


def test_waiter_gets_the_owners_result_when_it_lands_in_time(
    field_db: str, stub: SuperAgentStub, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fieldrecovery")
    owner = _claim_as_other_owner(field_db, lease_seconds=60)
    result: list[RecoveryRun] = []
    waiter = threading.Thread(target=lambda: result.append(_process(field_db, _settings(stub, max_wait=3))))
    waiter.start()
    # The waiter found the row busy and is polling now.
    assert wait_until(lambda: any("outcome=BUSY" in r.getMessage() for r in caplog.records), timeout=2)
    request = build_request(parse_eml(AMBIGUOUS), profile_version="fixed-channel-field-recovery-qbd-v1")
    assert request is not None
    patch_set = answer_for(request).model_dump(mode="json")
    assert owner.finish_success(request.idempotency_key, "other-owner", 1, patch_set, ProviderAudit())
    waiter.join(5)
    [run] = result
    assert (run.status, run.replayed, run.provider_calls) == (RecoveryStatus.SUCCEEDED, True, 0)
    assert _facts(run)["room_type"] == ("Deluxe King", "RECOVERY")
    assert stub.stats()["streams"] == 0


def test_stale_in_progress_is_not_taken_over_when_takeover_is_off(field_db: str, stub: SuperAgentStub) -> None:
    _claim_as_other_owner(field_db, lease_seconds=0)  # the owner died: its lease has expired
    run = _process(field_db, _settings(stub, max_wait=0.5, stale_takeover=False))
    assert (run.status, run.error_code) == (RecoveryStatus.FAILED, "invocation_in_progress")
    assert stub.stats()["streams"] == 0
    [row] = _rows(field_db, "field_recovery_invocation")
    assert (row["status"], row["owner_id"], row["epoch"]) == ("IN_PROGRESS", "other-owner", 1)


def test_stale_in_progress_is_taken_over_when_on_and_the_dead_owner_is_fenced(
    field_db: str, stub: SuperAgentStub
) -> None:
    dead = _claim_as_other_owner(field_db, lease_seconds=0)
    run = _process(field_db, _settings(stub, stale_takeover=True))
    assert (run.status, run.replayed, run.provider_calls) == (RecoveryStatus.SUCCEEDED, False, 1)
    [row] = _rows(field_db, "field_recovery_invocation")
    assert row["epoch"] == 2 and row["owner_id"] != "other-owner" and row["status"] == "SUCCEEDED"
    # The dead owner comes back with its old epoch: nothing it writes lands.
    assert not dead.finish_failure(_key(), "other-owner", 1, code="late", summary="late", audit=ProviderAudit())
    assert _rows(field_db, "field_recovery_invocation")[0]["status"] == "SUCCEEDED"


def test_owner_fenced_out_mid_call_never_applies_its_answer(field_db: str, stub: SuperAgentStub) -> None:
    stub.configure(event_delay=0.15)
    result: list[RecoveryRun] = []
    worker = threading.Thread(target=lambda: result.append(_process(field_db, _settings(stub))))
    worker.start()
    assert wait_until(lambda: stub.stats()["streams"] == 1, timeout=3)
    engine = create_engine(field_db)
    with engine.begin() as conn:  # a newer owner takes the row over while the call is in flight
        conn.execute(
            text("UPDATE th_hotel_booking.field_recovery_invocation SET epoch = epoch + 1, owner_id = 'usurper'")
        )
    engine.dispose()
    worker.join(5)
    [run] = result
    assert (run.status, run.error_code) == (RecoveryStatus.FAILED, "invocation_lost")
    [row] = _rows(field_db, "field_recovery_invocation")
    assert (row["status"], row["owner_id"], row["patch_set"]) == ("IN_PROGRESS", "usurper", None)
    assert "RECOVERY_ASSEMBLY" not in _artifact_types(field_db)


def test_structured_log_lines_for_claim_replay_and_provider_calls(
    field_db: str, stub: SuperAgentStub, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fieldrecovery")
    _process(field_db, _settings(stub))
    _process(field_db, _settings(stub))
    stub.configure(behaviour=Behaviour.SERVER_ERROR)
    _process(field_db, _settings(stub), attempt=2)
    ours = [r for r in caplog.records if r.name.startswith("fieldrecovery.")]
    lines = [r.getMessage() for r in ours]
    events = [dict(part.split("=", 1) for part in line.split()) for line in lines]
    names = [e["event"] for e in events]
    assert names.count("claim") == 3 and names.count("replay") == 1
    assert names.count("provider_call_start") == names.count("provider_call_end") == 2
    ends = [e for e in events if e["event"] == "provider_call_end"]
    assert [e["error_code"] for e in ends] == ["-", "http_500"]
    assert all(int(e["duration_ms"]) >= 0 and len(e["key"]) == 64 for e in ends)
    assert {e["outcome"] for e in events if e["event"] == "claim"} == {"CLAIMED", "SUCCEEDED"}
