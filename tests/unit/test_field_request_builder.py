"""RecoveryRequestBuilder: exact UNRESOLVED + RECOVERABLE tasks, minimal data, stable identity."""

from __future__ import annotations

import json

from fieldrecovery.eml import parse_eml
from fieldrecovery.request_builder import (
    PROTOCOL_HINT,
    build_request,
    idempotency_key,
    parse_message,
    render_message,
)
from tests.field_helpers import sample_eml


def test_only_unresolved_recoverable_facts_become_tasks_with_dependencies_as_task_ids() -> None:
    request = build_request(parse_eml(sample_eml("ambiguous")), profile_version="pv1")
    assert request is not None
    assert [t.task_id for t in request.tasks] == ["task-arrival_date", "task-departure_date", "task-room_type"]
    assert all(t.status == "UNRESOLVED" and t.recoverability == "RECOVERABLE" for t in request.tasks)
    assert request.tasks[1].depends_on == ["task-arrival_date"]
    # The NOT_RECOVERABLE currency of the multipart sample is not a task.
    multipart = build_request(parse_eml(sample_eml("multipart")), profile_version="pv1")
    assert multipart is not None
    assert {t.field for t in multipart.tasks} == {"arrival_date", "room_type"}


def test_no_task_means_no_request() -> None:
    assert build_request(parse_eml(sample_eml("clean")), profile_version="pv1") is None


def test_request_carries_no_mail_body_attachment_or_url() -> None:
    raw = sample_eml("multipart")
    request = build_request(parse_eml(raw), profile_version="pv1")
    assert request is not None
    message = render_message(request)
    assert "https://" not in message and "fixed-channel.example/" not in message
    assert "JVBERi0" not in message  # the attachment
    assert "Manage your booking" not in message  # a body line that is not evidence
    assert "Marta Kowalska" not in message  # a resolved fact is not sent
    assert "[link removed]" in message


def test_idempotency_key_is_a_stable_hash_of_source_revision_observation_profile_and_attempt() -> None:
    base = ("<m@x>", 1, "obs", "pv1", 1)
    key = idempotency_key(*base)
    assert key == idempotency_key(*base) and len(key) == 64
    for i, other in enumerate(("<n@x>", 2, "obs2", "pv2", 2)):
        changed = list(base)
        changed[i] = other
        assert idempotency_key(*changed) != key, i
    facts = parse_eml(sample_eml("ambiguous"))
    r1 = build_request(facts, profile_version="pv1", attempt=1)
    r2 = build_request(facts, profile_version="pv1", attempt=2)
    assert r1 is not None and r2 is not None
    assert r1.idempotency_key == idempotency_key(
        facts.source.message_id, facts.source.revision, facts.observation_hash, "pv1", 1
    )
    assert r1.idempotency_key != r2.idempotency_key and r1.request_id != r2.request_id


def test_message_is_the_protocol_hint_plus_the_snake_case_request_json() -> None:
    request = build_request(parse_eml(sample_eml("ambiguous")), profile_version="pv1")
    assert request is not None
    message = render_message(request)
    assert message.startswith(PROTOCOL_HINT)
    body = json.loads(message[len(PROTOCOL_HINT) :])
    assert set(body) == {
        "schema_version",
        "request_id",
        "attempt",
        "idempotency_key",
        "source",
        "observation_hash",
        "profile_version",
        "tasks",
    }
    assert parse_message(message) == request
