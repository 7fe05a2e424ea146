"""Stale IN_PROGRESS keys and retention on real PostgreSQL.

A stale invocation is IN_PROGRESS past its lease: with takeover off nothing ever ends it, so
operators list it (``stale``) and fail it (``release``, fenced by the epoch). Expired finished
invocations and artifacts are purged in batches.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text

from doubles.superagent import SuperAgentStub
from fieldrecovery.artifacts import ArtifactDraft, put_artifacts
from fieldrecovery.eml import parse_eml
from fieldrecovery.orchestrator import FieldRecoveryOrchestrator, RecoveryStatus
from fieldrecovery.request_builder import build_request, render_message, request_hash
from fieldrecovery.retention import purge_expired
from fieldrecovery.schemas import SourceKind, SourceRef
from fieldrecovery.store import (
    RELEASED_CODE,
    InvocationMeta,
    InvocationStore,
    ProviderAudit,
    ReleaseOutcome,
    stale_count,
)
from fieldrecovery.tables import ArtifactType
from settings import FieldRecoverySettings
from tests.field_helpers import clean_field_tables, sample_eml

SOURCE = SourceRef(message_id="<stale@test>", revision=1, channel=SourceKind.MANUAL_EML)
AMBIGUOUS = sample_eml("ambiguous")
KEY = "df_open_stale_test"


@pytest.fixture
def field_db(db: str) -> Iterator[str]:
    clean_field_tables(db)
    yield db


def _meta(key: str) -> InvocationMeta:
    return InvocationMeta(key, f"frq_{key}", 1, SOURCE.message_id, 1, "o" * 64, "pv1", "r" * 64)


def _sql(url: str, sql: str) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text(sql))
    finally:
        engine.dispose()


def test_stale_lists_only_in_progress_keys_past_their_lease_with_their_age(field_db: str) -> None:
    dead = InvocationStore(field_db, lease_seconds=0.01)
    live = InvocationStore(field_db, lease_seconds=60)
    assert dead.claim(_meta("dead"), "host:1:a", stale_takeover=False).owned
    assert live.claim(_meta("live"), "host:2:b", stale_takeover=False).owned
    assert dead.claim(_meta("done"), "host:3:c", stale_takeover=False).owned
    assert dead.finish_failure("done", "host:3:c", 1, code="x", summary="x", audit=ProviderAudit())
    time.sleep(0.05)
    [stale] = live.stale()
    assert (stale.idempotency_key, stale.owner_id, stale.epoch) == ("dead", "host:1:a", 1)
    assert stale.age_seconds >= stale.overdue_seconds > 0
    assert set(stale.to_json()) >= {"idempotency_key", "epoch", "age_seconds", "overdue_seconds", "started_at"}
    assert live.count_stale() == 1 and stale_count(field_db) == 1


def test_release_fails_a_stale_key_fenced_by_its_epoch_and_nothing_else(field_db: str) -> None:
    store = InvocationStore(field_db, lease_seconds=0.01)
    assert store.claim(_meta("k"), "dead-owner", stale_takeover=False).owned
    time.sleep(0.05)
    assert store.release("k", reason="owner SIGKILLed", epoch=2) == ReleaseOutcome.EPOCH_MOVED
    assert store.release("nope", reason="x") == ReleaseOutcome.NOT_FOUND
    assert store.release("k", reason="owner SIGKILLed", epoch=1) == ReleaseOutcome.RELEASED
    record = store.get("k")
    assert record is not None and (record.status.value, record.error_code) == ("FAILED", RELEASED_CODE)
    assert store.release("k", reason="again") == ReleaseOutcome.FINISHED
    # The dead owner comes back: its write names IN_PROGRESS and lands nowhere.
    assert not store.finish_success("k", "dead-owner", 1, {"x": 1}, ProviderAudit())
    assert store.count_stale() == 0


def test_release_never_touches_a_live_owner(field_db: str) -> None:
    store = InvocationStore(field_db, lease_seconds=60)
    assert store.claim(_meta("k"), "live-owner", stale_takeover=False).owned
    assert store.release("k", reason="impatient") == ReleaseOutcome.LEASE_LIVE
    assert store.renew_lease("k", "live-owner", 1)


def test_after_release_a_redelivery_fails_at_once_and_a_new_attempt_calls_the_provider(field_db: str) -> None:
    request = build_request(parse_eml(AMBIGUOUS), profile_version="fixed-channel-field-recovery-qbd-v1")
    assert request is not None
    meta = InvocationMeta(
        request.idempotency_key,
        request.request_id,
        1,
        request.source.message_id,
        request.source.revision,
        request.observation_hash,
        request.profile_version,
        request_hash(render_message(request)),
    )
    store = InvocationStore(field_db, lease_seconds=0.01)
    assert store.claim(meta, "sigkilled-owner", stale_takeover=False).owned
    time.sleep(0.05)
    with SuperAgentStub(api_key=KEY) as stub:
        settings = FieldRecoverySettings.model_validate(
            {"enabled": True, "open_api": {"base_url": stub.base_url, "api_key": KEY}, "max_wait": 1}
        )
        started = time.monotonic()
        blocked = FieldRecoveryOrchestrator(settings, url=field_db).process(AMBIGUOUS)
        assert blocked.error_code == "invocation_in_progress" and time.monotonic() - started >= 1  # the whole wait
        assert store.release(request.idempotency_key, reason="owner gone") == ReleaseOutcome.RELEASED
        started = time.monotonic()
        redelivered = FieldRecoveryOrchestrator(settings, url=field_db).process(AMBIGUOUS)
        assert time.monotonic() - started < 0.5
        assert (redelivered.status, redelivered.error_code, redelivered.replayed) == (
            RecoveryStatus.FAILED,
            RELEASED_CODE,
            True,
        )
        retry = FieldRecoveryOrchestrator(settings, url=field_db).process(AMBIGUOUS, attempt=2)
        assert retry.status == RecoveryStatus.SUCCEEDED and stub.stats()["streams"] == 1


def test_purge_deletes_expired_finished_invocations_and_artifacts_in_batches(field_db: str) -> None:
    store = InvocationStore(field_db, lease_seconds=60)
    for i in range(5):
        key = f"old{i}"
        assert store.claim(_meta(key), "o", stale_takeover=False).owned
        assert store.finish_failure(key, "o", 1, code="x", summary="x", audit=ProviderAudit())
    assert store.claim(_meta("old-running"), "o", stale_takeover=False).owned  # expired yet IN_PROGRESS
    assert store.claim(_meta("fresh"), "o", stale_takeover=False).owned
    assert store.finish_failure("fresh", "o", 1, code="x", summary="x", audit=ProviderAudit())
    with store.transaction() as s:
        drafts = [ArtifactDraft(ArtifactType.PARSED_FACT_SET, SOURCE, {"n": n}) for n in range(3)]
        put_artifacts(s, drafts, retention=store.retention)
    _sql(
        field_db,
        "UPDATE th_hotel_booking.field_recovery_invocation SET retention_until = now() - interval '1 day'"
        " WHERE idempotency_key LIKE 'old%'",
    )
    _sql(
        field_db,
        "UPDATE th_hotel_booking.field_recovery_artifact SET retention_until = now() - interval '1 day'"
        " WHERE content->>'n' <> '2'",
    )
    result = purge_expired(store, batch_size=2)
    assert (result.invocations, result.artifacts, result.more) == (5, 2, False)
    assert result.batches == 3 + 2  # 2+2+1 invocations, then 2+0 artifacts
    assert store.get("old-running") is not None and store.get("fresh") is not None
    assert store.get("old0") is None
    again = purge_expired(store, batch_size=2)
    assert (again.invocations, again.artifacts) == (0, 0)


def test_purge_stops_at_max_batches_and_says_there_is_more(field_db: str) -> None:
    store = InvocationStore(field_db, lease_seconds=60)
    for i in range(3):
        assert store.claim(_meta(f"old{i}"), "o", stale_takeover=False).owned
        assert store.finish_failure(f"old{i}", "o", 1, code="x", summary="x", audit=ProviderAudit())
    _sql(field_db, "UPDATE th_hotel_booking.field_recovery_invocation SET retention_until = now() - interval '1 s'")
    first = purge_expired(store, batch_size=1, max_batches=2)
    assert (first.invocations, first.more) == (2, True)
    assert purge_expired(store, batch_size=1).invocations == 1


def test_purge_task_is_registered_under_its_beat_name(field_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from settings import get_settings
    from tasks.field import purge_expired_task

    monkeypatch.setenv("DATABASE_URL", field_db)
    get_settings.cache_clear()
    try:
        assert purge_expired_task.name == "field.purge_expired"
        result = purge_expired_task.apply().get(timeout=30)
        assert result == {"invocations": 0, "artifacts": 0, "batches": 2, "more": False}
    finally:
        get_settings.cache_clear()


# --- a dead owner's platform run is cancelled -------------------------------------------------


def _ambiguous_meta() -> InvocationMeta:
    request = build_request(parse_eml(AMBIGUOUS), profile_version="fixed-channel-field-recovery-qbd-v1")
    assert request is not None
    return InvocationMeta(
        request.idempotency_key,
        request.request_id,
        1,
        request.source.message_id,
        request.source.revision,
        request.observation_hash,
        request.profile_version,
        request_hash(render_message(request)),
    )


def _start_run_and_abandon_it(stub: SuperAgentStub) -> tuple[str, str]:
    """What a SIGKILLed owner leaves: a session and a run still running on the platform."""
    import json as json_module
    import secrets

    import requests

    def headers() -> tuple[dict[str, str], dict[str, str]]:
        token = secrets.token_urlsafe(24)
        return {"Authorization": f"Bearer {KEY}", "X-CSRF-Token": token}, {"csrf_token": token}

    h, c = headers()
    session_id = requests.post(
        f"{stub.base_url}/open/v1/sessions", json={"external_subject_id": "s" * 64}, headers=h, cookies=c, timeout=5
    ).json()["session_id"]
    h, c = headers()
    message = render_message(build_request(parse_eml(AMBIGUOUS), profile_version="pv1"))  # type: ignore[arg-type]
    stream = requests.post(
        f"{stub.base_url}/open/v1/sessions/{session_id}/messages/stream",
        json={"content": message, "idempotency_key": "dead"},
        headers=h,
        cookies=c,
        stream=True,
        timeout=5,
    )
    for line in stream.iter_lines():
        if line.startswith(b"data:") and b"run_id" in line:
            run_id = str(json_module.loads(line[5:])["run_id"])
            break
    stream.close()
    assert stub.run_status(run_id) == "running"
    return session_id, run_id


def test_the_owner_records_the_run_id_on_the_invocation_as_soon_as_the_stream_names_it(field_db: str) -> None:
    from doubles.superagent import Behaviour
    from tests.field_helpers import wait_until

    with SuperAgentStub(api_key=KEY) as stub:
        stub.configure(behaviour=Behaviour.SLOW, stall_seconds=30)
        settings = FieldRecoverySettings.model_validate(
            {"enabled": True, "open_api": {"base_url": stub.base_url, "api_key": KEY}, "max_wait": 3}
        )
        store = InvocationStore(field_db)
        key = _ambiguous_meta().idempotency_key
        done: list[object] = []
        import threading

        worker = threading.Thread(
            target=lambda: done.append(FieldRecoveryOrchestrator(settings, url=field_db).process(AMBIGUOUS))
        )
        worker.start()

        def recorded_while_in_progress() -> bool:
            record = store.get(key)
            return record is not None and record.status.value == "IN_PROGRESS" and record.provider_run_id is not None

        assert wait_until(recorded_while_in_progress, timeout=2.5)
        worker.join(timeout=10)


def test_a_stale_takeover_cancels_the_dead_owners_run_before_calling_again(field_db: str) -> None:
    meta = _ambiguous_meta()
    store = InvocationStore(field_db, lease_seconds=0.01)
    with SuperAgentStub(api_key=KEY) as stub:
        from doubles.superagent import Behaviour

        stub.configure(behaviour=Behaviour.SLOW, stall_seconds=30)
        session_id, dead_run = _start_run_and_abandon_it(stub)
        stub.configure(behaviour=Behaviour.NORMAL)
        assert store.claim(meta, "sigkilled-owner", stale_takeover=True).owned
        assert store.note_run(meta.idempotency_key, "sigkilled-owner", 1, session_id=session_id, run_id=dead_run)
        time.sleep(0.05)
        settings = FieldRecoverySettings.model_validate(
            {
                "enabled": True,
                "stale_takeover": True,
                "open_api": {"base_url": stub.base_url, "api_key": KEY},
                "max_wait": 5,
            }
        )
        run = FieldRecoveryOrchestrator(settings, url=field_db).process(AMBIGUOUS)
        assert run.status == RecoveryStatus.SUCCEEDED, run.error_code
        assert stub.cancelled_runs[0] == dead_run
        assert stub.run_status(dead_run) == "cancelled"
        assert stub.stats()["streams"] == 2  # the dead owner's and the taker's own


def test_field_release_cancels_the_dead_owners_run(field_db: str) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    meta = _ambiguous_meta()
    store = InvocationStore(field_db, lease_seconds=0.01)
    with SuperAgentStub(api_key=KEY) as stub:
        from doubles.superagent import Behaviour

        stub.configure(behaviour=Behaviour.SLOW, stall_seconds=30)
        session_id, dead_run = _start_run_and_abandon_it(stub)
        assert store.claim(meta, "sigkilled-owner", stale_takeover=False).owned
        assert store.note_run(meta.idempotency_key, "sigkilled-owner", 1, session_id=session_id, run_id=dead_run)
        time.sleep(0.05)
        env = {
            **os.environ,
            "DATABASE_URL": field_db,
            "BOOKING_FIELD_RECOVERY__ENABLED": "true",
            "BOOKING_FIELD_RECOVERY__OPEN_API__BASE_URL": stub.base_url,
            "BOOKING_FIELD_RECOVERY__OPEN_API__API_KEY": KEY,
        }
        done = subprocess.run(
            [sys.executable, "-m", "cli.main", "field", "release", meta.idempotency_key],
            cwd=Path(__file__).resolve().parents[2],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert f"run {dead_run}: cancelled" in done.stdout
        assert stub.run_status(dead_run) == "cancelled"
