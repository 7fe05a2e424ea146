"""A hostile platform: odd values, compression bombs, a lease that
cannot be renewed, a purge racing a replay, a bare ``end``. Real PostgreSQL, the stand-in over
loopback HTTP; every outcome is a clean FAILED or SUCCEEDED result, never a key left IN_PROGRESS.
"""

from __future__ import annotations

import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, event, text

from doubles.superagent import Behaviour, SuperAgentStub
from fieldrecovery.errors import FieldRecoveryError
from fieldrecovery.orchestrator import FieldRecoveryOrchestrator, RecoveryRun, RecoveryStatus
from models.db import get_engine
from settings import FieldRecoverySettings
from tests.field_helpers import SampleCall, call_provider, clean_field_tables, open_api_client, sample_eml

KEY = "df_open_hostile_peer_test"
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


def _process(url: str, settings: FieldRecoverySettings) -> RecoveryRun:
    return FieldRecoveryOrchestrator(settings, url=url).process(AMBIGUOUS)


def _invocations(url: str) -> list[dict[str, Any]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT * FROM th_hotel_booking.field_recovery_invocation ORDER BY id"))
            return [dict(r._mapping) for r in rows]
    finally:
        engine.dispose()


# --- every value from the peer is checked before hashing or the database ------------


def test_a_lone_surrogate_in_the_final_answer_fails_closed_with_a_code_and_no_key_in_progress(
    field_db: str, stub: SuperAgentStub
) -> None:
    stub.configure(behaviour=Behaviour.LONE_SURROGATE)
    run = _process(field_db, _settings(stub))
    assert run.status == RecoveryStatus.FAILED
    assert run.error_code == "output_bad_text"
    [row] = _invocations(field_db)
    assert row["status"] == "FAILED" and row["error_code"] == "output_bad_text"


@pytest.mark.parametrize("behaviour", [Behaviour.NUL_MODEL, Behaviour.NUL_PROFILE, Behaviour.HUGE_TOKENS])
def test_a_nul_or_an_int32_overflow_in_the_run_status_does_not_lose_the_paid_answer(
    field_db: str, stub: SuperAgentStub, behaviour: Behaviour
) -> None:
    stub.configure(behaviour=behaviour)
    run = _process(field_db, _settings(stub))
    assert run.status == RecoveryStatus.SUCCEEDED, run.error_code
    [row] = _invocations(field_db)
    assert row["status"] == "SUCCEEDED"
    # The odd value is dropped from the audit record; the rest of it is kept.
    assert row["model"] in (None, "superagent-stub-1")
    assert row["total_tokens"] in (None, 976)
    assert row["provider_run_id"] is not None


@pytest.mark.parametrize("value", ["run_1\n", "run_1\r\n", "", "r" * 65, "run 1", "run_\u00e9"])
def test_a_peer_id_or_code_with_a_line_end_or_odd_characters_is_never_taken_as_safe(value: str) -> None:
    # Ids and codes of the peer go into URL paths, the audit record and log lines.
    from fieldrecovery.client import _SAFE_TOKEN, _safe

    assert _SAFE_TOKEN.match(value) is None
    assert _safe(value, "unknown") == "unknown"


def test_an_answer_the_database_refuses_finishes_the_key_failed_not_in_progress(
    field_db: str, stub: SuperAgentStub
) -> None:
    # The database refuses the final write (a data exception, sqlstate 22...): injected with an
    # SQLAlchemy event on the SUCCEEDED update only.
    engine = get_engine(field_db)

    def refuse(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        if statement.startswith("UPDATE") and "patch_set=" in statement:
            cursor.execute("SELECT 'x'::int")  # a real error from the server: 22P02

    event.listen(engine, "before_cursor_execute", refuse)
    try:
        run = _process(field_db, _settings(stub))
    finally:
        event.remove(engine, "before_cursor_execute", refuse)
    assert run.status == RecoveryStatus.FAILED
    assert run.error_code == "store_value_rejected"
    [row] = _invocations(field_db)
    assert row["status"] == "FAILED" and row["error_code"] == "store_value_rejected"


# --- every body read is capped in decoded bytes ------------------------------------


@pytest.mark.parametrize("status", [401, 200])
def test_a_gzip_bomb_body_is_refused_without_being_inflated(stub: SuperAgentStub, status: int) -> None:
    stub.configure(behaviour=Behaviour.GZIP_BOMB, bomb_status=status, bomb_bytes=60_000_000)
    client = open_api_client(stub.base_url, KEY)
    tracemalloc.start()
    try:
        started = time.monotonic()
        with pytest.raises(FieldRecoveryError) as info:
            call_provider(client, SampleCall(), seconds=10)
        elapsed = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.code == ("http_401" if status == 401 else "body_too_large")
    assert peak < 8_000_000, f"{peak / 1e6:.1f} MB held for a bomb body"
    assert elapsed < 3


def test_a_gzip_bomb_event_stream_is_refused_within_its_byte_budget_and_the_run_cancelled(
    stub: SuperAgentStub,
) -> None:
    # The message stream itself: a run.started, then one data line of 60 MB decoded bytes (a
    # ~60 KB gzip body), sent gzip although the request asked for identity.
    stub.configure(behaviour=Behaviour.GZIP_BOMB, bomb_on="stream", bomb_bytes=60_000_000)
    client = open_api_client(stub.base_url, KEY)
    tracemalloc.start()
    try:
        started = time.monotonic()
        with pytest.raises(FieldRecoveryError) as info:
            call_provider(client, SampleCall(), seconds=10)
        elapsed = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.code == "response_too_large"
    # The budget is 8 x 200,000 + 64 KiB decoded bytes; the line held is at most that.
    assert peak < 8_000_000, f"{peak / 1e6:.1f} MB held for a bomb stream"
    assert elapsed < 3
    assert stub.cancelled_runs, "the run was not cancelled"


# --- an owner that cannot renew its lease stops and cancels --------------------------


def test_an_owner_whose_lease_renewals_fail_stops_and_cancels_before_its_lease_runs_out(
    field_db: str, stub: SuperAgentStub
) -> None:
    stub.configure(behaviour=Behaviour.SLOW, stall_seconds=6)
    engine = get_engine(field_db)
    renewals = {"failed": 0}

    def fail_renewals(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        # The renewal is the only UPDATE that sets lease_expires_at to now() + the lease.
        if statement.startswith("UPDATE") and "SET lease_expires_at=(now() +" in statement:
            renewals["failed"] += 1
            cursor.execute("SELECT pg_terminate_backend(-1) FROM pg_sleep(0) WHERE 1/0 = 1")

    event.listen(engine, "before_cursor_execute", fail_renewals)
    try:
        started = time.monotonic()
        run = _process(field_db, _settings(stub, lease_seconds=1, stale_takeover=True, max_wait=10))
        elapsed = time.monotonic() - started
    finally:
        event.remove(engine, "before_cursor_execute", fail_renewals)
    assert renewals["failed"] >= 1
    assert run.status == RecoveryStatus.FAILED
    assert run.error_code == "invocation_lost"
    assert elapsed < 2.5, f"the owner called on for {elapsed:.1f}s past a 1s lease it could not renew"
    assert stub.cancelled_runs, "the run was not cancelled"


# --- a purge racing a replay; a bare ``end`` ---------------------------------------


def _forget_assembly(url: str) -> None:
    """The state an owner leaves when it dies between storing the PatchSet and the assembly."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE th_hotel_booking.field_recovery_invocation SET assembly_result = NULL"))
    finally:
        engine.dispose()


def test_a_purge_between_a_replays_read_and_its_assembly_is_a_failed_result(
    field_db: str, stub: SuperAgentStub
) -> None:
    # A replay assembles (and writes) only a succeeded invocation that has no assembly yet: here
    # its owner died between the two writes. The purge deletes the row between the replay's
    # read of the PatchSet and its put-if-absent of the assembly.
    settings = _settings(stub)
    first = _process(field_db, settings)
    assert first.status == RecoveryStatus.SUCCEEDED
    _forget_assembly(field_db)
    engine = get_engine(field_db)
    other = create_engine(field_db)
    purged = threading.Event()

    def purge_first(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        if statement.startswith("UPDATE") and "assembly_result=" in statement and not purged.is_set():
            purged.set()
            with other.begin() as c:  # what field.purge_expired does to an expired finished row
                c.execute(text("DELETE FROM th_hotel_booking.field_recovery_invocation"))

    event.listen(engine, "before_cursor_execute", purge_first)
    try:
        replay = _process(field_db, settings)
    finally:
        event.remove(engine, "before_cursor_execute", purge_first)
        other.dispose()
    assert purged.is_set()
    assert replay.status == RecoveryStatus.FAILED
    assert replay.error_code == "not_succeeded"
    assert replay.replayed
    assert stub.stats()["sessions"] == 1  # the replay never called the provider


def test_a_purge_after_a_replays_read_of_an_applied_assembly_replays_what_was_read(
    field_db: str, stub: SuperAgentStub
) -> None:
    # The replay of an applied invocation reads the stored assembly in its claim and writes
    # nothing after it: a purge right after that read changes nothing of the result.
    settings = _settings(stub)
    first = _process(field_db, settings)
    assert first.status == RecoveryStatus.SUCCEEDED
    engine = get_engine(field_db)
    other = create_engine(field_db)
    purged = threading.Event()

    def purge_after_read(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if statement.startswith("SELECT") and "assembly_result" in statement and not purged.is_set():
            purged.set()
            with other.begin() as c:
                c.execute(text("DELETE FROM th_hotel_booking.field_recovery_invocation"))

    event.listen(engine, "after_cursor_execute", purge_after_read)
    try:
        replay = _process(field_db, settings)
    finally:
        event.remove(engine, "after_cursor_execute", purge_after_read)
        other.dispose()
    assert purged.is_set()
    assert replay.status == RecoveryStatus.SUCCEEDED and replay.replayed and replay.provider_calls == 0
    assert replay.assembly == first.assembly and replay.view == first.view
    assert _invocations(field_db) == []


def test_a_bare_end_event_without_data_ends_the_stream(field_db: str, stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.BARE_END)
    run = _process(field_db, _settings(stub))
    assert run.status == RecoveryStatus.SUCCEEDED, run.error_code
    assert stub.stats()["events_replays"] == 0
