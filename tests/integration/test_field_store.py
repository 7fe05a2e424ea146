"""Invocation store on real PostgreSQL (docs/field-recovery.md).

Concurrency tests commit real rows and race real threads through a Barrier.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import select, text

from fieldrecovery.artifacts import ArtifactDraft
from fieldrecovery.errors import FieldRecoveryError, StoreUnavailable
from fieldrecovery.schemas import SourceKind, SourceRef
from fieldrecovery.store import (
    ClaimOutcome,
    InvocationMeta,
    InvocationStore,
    LeaseKeeper,
    ProviderAudit,
)
from fieldrecovery.tables import ArtifactType, FieldRecoveryInvocation, InvocationStatus
from tests.field_helpers import clean_field_tables, list_artifacts, wait_until

SOURCE = SourceRef(message_id="<store@test>", revision=1, channel=SourceKind.MANUAL_EML)
PATCH_SET = {"schema_version": "1", "request_id": "frq_1", "attempt": 1, "idempotency_key": "k1", "patches": []}
AUDIT = ProviderAudit(
    session_id="ses_1",
    run_id="run_1",
    resolved_profile_id="prof",
    resolved_profile_version="7",
    model="m",
    prompt_tokens=10,
    completion_tokens=5,
    total_tokens=15,
    duration_ms=1234,
    response_hash="ab" * 32,
)


@pytest.fixture
def field_db(db: str) -> Iterator[str]:
    clean_field_tables(db)
    yield db


@pytest.fixture
def store(field_db: str) -> InvocationStore:
    return InvocationStore(field_db, lease_seconds=30)


def _meta(key: str = "k1") -> InvocationMeta:
    return InvocationMeta(
        idempotency_key=key,
        request_id=f"frq_{key}",
        attempt=1,
        source_message_id=SOURCE.message_id,
        source_revision=1,
        observation_hash="o" * 64,
        profile_version="pv1",
        request_hash="r" * 64,
    )


def _row(store: InvocationStore, key: str = "k1") -> FieldRecoveryInvocation:
    with store.transaction() as s:
        row = s.execute(
            select(FieldRecoveryInvocation).where(FieldRecoveryInvocation.idempotency_key == key)
        ).scalar_one()
        s.expunge(row)
        return row


def test_first_claim_inserts_one_in_progress_row_owned_at_epoch_one(store: InvocationStore) -> None:
    claim = store.claim(_meta(), "owner-a", stale_takeover=False)
    assert claim.outcome == ClaimOutcome.CLAIMED and claim.epoch == 1 and claim.owned
    row = _row(store)
    assert (row.status, row.owner_id, row.epoch) == ("IN_PROGRESS", "owner-a", 1)
    assert row.request_id == "frq_k1" and row.request_hash == "r" * 64 and row.observation_hash == "o" * 64
    assert row.lease_expires_at is not None and row.lease_expires_at > row.started_at
    assert row.created_at.tzinfo is not None and row.retention_until > row.created_at
    again = store.claim(_meta(), "owner-b", stale_takeover=False)
    assert again.outcome == ClaimOutcome.BUSY and not again.owned


def test_concurrent_claims_of_one_key_have_exactly_one_owner(store: InvocationStore) -> None:
    barrier = threading.Barrier(8)

    def claim(i: int) -> ClaimOutcome:
        barrier.wait()
        return store.claim(_meta(), f"owner-{i}", stale_takeover=True).outcome

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(claim, range(8)))
    assert outcomes.count(ClaimOutcome.CLAIMED) == 1
    assert outcomes.count(ClaimOutcome.BUSY) == 7
    with store.transaction() as s:
        assert s.execute(text("SELECT count(*) FROM th_hotel_booking.field_recovery_invocation")).scalar_one() == 1


def test_concurrent_claims_with_artifacts_write_each_artifact_once_and_have_one_owner(
    store: InvocationStore,
) -> None:
    # Every caller reads before it writes: all 8 may see no row and no artifact, and then race
    # on the inserts, whose ON CONFLICT decides.
    barrier = threading.Barrier(8)
    drafts = [
        ArtifactDraft(ArtifactType.PARSED_FACT_SET, SOURCE, {"facts": [1, 2]}),
        ArtifactDraft(ArtifactType.RECOVERY_REQUEST, SOURCE, {"request": "r"}, "k1"),
    ]

    def claim(i: int) -> ClaimOutcome:
        barrier.wait()
        return store.claim(_meta(), f"owner-{i}", stale_takeover=False, artifacts=drafts).outcome

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(claim, range(8)))
    assert outcomes.count(ClaimOutcome.CLAIMED) == 1
    assert outcomes.count(ClaimOutcome.BUSY) == 7
    with store.transaction() as s:
        assert list_artifacts(s, SOURCE) == [
            (ArtifactType.PARSED_FACT_SET, {"facts": [1, 2]}),
            (ArtifactType.RECOVERY_REQUEST, {"request": "r"}),
        ]


def test_claim_of_a_succeeded_key_replays_the_stored_patch_set(store: InvocationStore) -> None:
    claim = store.claim(_meta(), "owner-a", stale_takeover=False)
    assert store.finish_success("k1", "owner-a", 1, PATCH_SET, AUDIT)
    replay = store.claim(_meta(), "owner-b", stale_takeover=True)
    assert replay.outcome == ClaimOutcome.SUCCEEDED and not replay.owned
    assert replay.record is not None and replay.record.patch_set == PATCH_SET
    assert claim.epoch == replay.record.epoch == 1


def test_claim_of_a_failed_key_replays_the_failure(store: InvocationStore) -> None:
    store.claim(_meta(), "owner-a", stale_takeover=False)
    assert store.finish_failure("k1", "owner-a", 1, code="deadline_exceeded", summary="deadline", audit=AUDIT)
    replay = store.claim(_meta(), "owner-b", stale_takeover=True)
    assert replay.outcome == ClaimOutcome.FAILED
    assert replay.record is not None and replay.record.error_code == "deadline_exceeded"


def test_success_cas_lands_once_and_only_for_the_owner_at_its_epoch(store: InvocationStore) -> None:
    store.claim(_meta(), "owner-a", stale_takeover=False)
    assert not store.finish_success("k1", "owner-b", 1, PATCH_SET, AUDIT)  # not the owner
    assert not store.finish_success("k1", "owner-a", 2, PATCH_SET, AUDIT)  # not its epoch
    assert _row(store).status == "IN_PROGRESS"
    assert store.finish_success("k1", "owner-a", 1, PATCH_SET, AUDIT)
    assert not store.finish_success("k1", "owner-a", 1, {**PATCH_SET, "request_id": "x"}, AUDIT)
    assert not store.finish_failure("k1", "owner-a", 1, code="late", summary="late", audit=ProviderAudit())
    row = _row(store)
    assert row.status == "SUCCEEDED" and row.patch_set == PATCH_SET and row.error_code is None
    assert row.completed_at is not None and row.lease_expires_at is None
    # The provider's safe metadata is part of the audit record.
    assert (row.provider_session_id, row.provider_run_id, row.resolved_profile_id) == ("ses_1", "run_1", "prof")
    assert (row.resolved_profile_version, row.model) == ("7", "m")
    assert (row.prompt_tokens, row.completion_tokens, row.total_tokens, row.duration_ms) == (10, 5, 15, 1234)
    assert row.response_hash == "ab" * 32


def test_failure_cas_lands_once_and_a_late_success_is_refused(store: InvocationStore) -> None:
    store.claim(_meta(), "owner-a", stale_takeover=False)
    assert store.finish_failure(
        "k1", "owner-a", 1, code="http_500", summary="the provider answered HTTP 500", audit=AUDIT
    )
    assert not store.finish_success("k1", "owner-a", 1, PATCH_SET, AUDIT)
    row = _row(store)
    assert (row.status, row.error_code, row.error_summary, row.patch_set) == (
        "FAILED",
        "http_500",
        "the provider answered HTTP 500",
        None,
    )


def test_assembly_is_put_if_absent_with_its_artifacts_written_once(store: InvocationStore) -> None:
    store.claim(_meta(), "owner-a", stale_takeover=False)
    store.finish_success("k1", "owner-a", 1, PATCH_SET, AUDIT)
    first = {"accepted": ["a"], "rejected": []}
    second = {"accepted": [], "rejected": ["a"]}

    def drafts(content: dict[str, Any]) -> list[ArtifactDraft]:
        return [ArtifactDraft(ArtifactType.RECOVERY_ASSEMBLY, SOURCE, content, "k1")]

    assert store.put_assembly("k1", first, drafts(first)) == (True, first)
    assert store.put_assembly("k1", second, drafts(second)) == (False, first)
    assert _row(store).assembly_result == first
    with store.transaction() as s:
        assert list_artifacts(s, SOURCE) == [(ArtifactType.RECOVERY_ASSEMBLY, first)]


def test_concurrent_assembly_puts_store_exactly_one(store: InvocationStore) -> None:
    store.claim(_meta(), "owner-a", stale_takeover=False)
    store.finish_success("k1", "owner-a", 1, PATCH_SET, AUDIT)
    barrier = threading.Barrier(6)

    def put(i: int) -> tuple[bool, dict[str, Any]]:
        barrier.wait()
        return store.put_assembly("k1", {"n": i}, [ArtifactDraft(ArtifactType.RECOVERY_ASSEMBLY, SOURCE, {"n": i})])

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(put, range(6)))
    assert sum(written for written, _ in results) == 1
    stored = {tuple(sorted(s.items())) for _, s in results}
    assert len(stored) == 1  # every caller got the one stored assembly
    with store.transaction() as s:
        assert len(list_artifacts(s, SOURCE)) == 1


def test_assembly_needs_a_succeeded_invocation(store: InvocationStore) -> None:
    store.claim(_meta(), "owner-a", stale_takeover=False)
    with pytest.raises(FieldRecoveryError) as exc:
        store.put_assembly("k1", {"x": 1})
    assert exc.value.code == "not_succeeded"


def test_expired_in_progress_is_not_taken_over_when_takeover_is_off(field_db: str) -> None:
    dead = InvocationStore(field_db, lease_seconds=0)  # its lease is expired as soon as it is written
    dead.claim(_meta(), "dead-owner", stale_takeover=False)
    claim = InvocationStore(field_db).claim(_meta(), "owner-b", stale_takeover=False)
    assert claim.outcome == ClaimOutcome.BUSY
    row = _row(dead)
    assert (row.owner_id, row.epoch, row.status) == ("dead-owner", 1, "IN_PROGRESS")


def test_expired_in_progress_is_taken_over_with_a_new_epoch_and_the_old_owner_is_fenced(field_db: str) -> None:
    dead = InvocationStore(field_db, lease_seconds=0)
    dead.claim(_meta(), "dead-owner", stale_takeover=True)
    store = InvocationStore(field_db)
    claim = store.claim(_meta(), "owner-b", stale_takeover=True)
    assert claim.outcome == ClaimOutcome.TAKEN_OVER and claim.epoch == 2
    # The old owner wakes up: none of its writes land.
    assert not dead.renew_lease("k1", "dead-owner", 1)
    assert not dead.finish_success("k1", "dead-owner", 1, PATCH_SET, AUDIT)
    assert not dead.finish_failure("k1", "dead-owner", 1, code="x", summary="x", audit=AUDIT)
    assert _row(store).status == "IN_PROGRESS"
    assert store.finish_success("k1", "owner-b", 2, PATCH_SET, AUDIT)
    row = _row(store)
    assert (row.status, row.owner_id, row.epoch) == ("SUCCEEDED", "owner-b", 2)


def test_a_live_lease_is_never_taken_over(store: InvocationStore) -> None:
    store.claim(_meta(), "owner-a", stale_takeover=True)
    assert store.claim(_meta(), "owner-b", stale_takeover=True).outcome == ClaimOutcome.BUSY
    assert _row(store).epoch == 1


def test_concurrent_takeovers_of_one_expired_row_have_one_winner(field_db: str) -> None:
    InvocationStore(field_db, lease_seconds=0).claim(_meta(), "dead-owner", stale_takeover=True)
    store = InvocationStore(field_db)
    barrier = threading.Barrier(6)

    def take(i: int) -> ClaimOutcome:
        barrier.wait()
        return store.claim(_meta(), f"taker-{i}", stale_takeover=True).outcome

    with ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(take, range(6)))
    assert outcomes.count(ClaimOutcome.TAKEN_OVER) == 1 and outcomes.count(ClaimOutcome.BUSY) == 5
    assert _row(store).epoch == 2


def test_lease_keeper_renews_the_lease_and_notices_a_takeover(field_db: str) -> None:
    owner = InvocationStore(field_db, lease_seconds=0.3)
    owner.claim(_meta(), "owner-a", stale_takeover=True)
    before = _row(owner).lease_expires_at
    with LeaseKeeper(owner, "k1", "owner-a", 1) as keeper:
        assert wait_until(lambda: _row(owner).lease_expires_at > before, timeout=3)
        # Fence the owner out (a takeover after its lease was forced to expire).
        with owner.transaction() as s:
            s.execute(text("UPDATE th_hotel_booking.field_recovery_invocation SET epoch = 2"))
        assert keeper.lost.wait(3)


def test_database_errors_become_safe_store_errors(field_db: str) -> None:
    missing_schema = InvocationStore(field_db, schema="no_such_schema")
    with pytest.raises(StoreUnavailable) as exc:
        missing_schema.claim(_meta(), "owner-a", stale_takeover=False)
    assert exc.value.code == "store_schema_missing"
    assert "INSERT" not in str(exc.value) and exc.value.__cause__ is None
    down = InvocationStore("postgresql+psycopg2://postgres@127.0.0.1:9/nowhere")
    with pytest.raises(StoreUnavailable) as exc:
        down.get("k1")
    assert exc.value.code == "store_unavailable"


def test_store_status_values_are_the_documented_ones() -> None:
    assert [s.value for s in InvocationStatus] == ["IN_PROGRESS", "SUCCEEDED", "FAILED"]
