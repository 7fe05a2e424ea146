"""A canary API key never reaches a log record, an exception text or a database column (I8).

The canary is the only key the stand-in accepts, so every request really carried it. Success,
replay and failure paths run with every logger (ours, urllib3, sseclient, the stand-in) at
DEBUG. The request and answer texts must not reach the logs either (docs/field-recovery.md).
"""

from __future__ import annotations

import logging
import traceback
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text

from doubles.superagent import Behaviour, SuperAgentStub
from fieldrecovery.client import CallProgress, client_for
from fieldrecovery.deadline import Deadline
from fieldrecovery.errors import FieldRecoveryError
from fieldrecovery.orchestrator import FieldRecoveryOrchestrator, RecoveryRun, RecoveryStatus
from fieldrecovery.request_builder import render_message
from fieldrecovery.schemas import RecoveryRequestSet
from settings import FieldRecoverySettings
from tests.field_helpers import clean_field_tables, sample_eml

CANARY = f"df_open_CANARY_{uuid.uuid4().hex}"


@pytest.fixture
def field_db(db: str) -> Iterator[str]:
    clean_field_tables(db)
    yield db


def _texts_of(record: logging.LogRecord) -> list[str]:
    texts = [record.getMessage(), str(record.msg), repr(record.args)]
    if record.exc_info:
        texts.append("".join(traceback.format_exception(*record.exc_info)))
    return texts


def test_canary_key_is_in_no_log_record_no_exception_text_and_no_column(
    field_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    runs: list[RecoveryRun] = []
    errors: list[BaseException] = []
    with SuperAgentStub(api_key=CANARY) as stub:
        settings = FieldRecoverySettings.model_validate(
            {"enabled": True, "open_api": {"base_url": stub.base_url, "api_key": CANARY}, "max_wait": 1}
        )
        orchestrator = FieldRecoveryOrchestrator(settings, url=field_db)
        eml = sample_eml("ambiguous")
        runs.append(orchestrator.process(eml))  # success
        runs.append(orchestrator.process(eml))  # replay
        for attempt, behaviour in enumerate(
            [Behaviour.FENCED, Behaviour.SLOW, Behaviour.SERVER_ERROR, Behaviour.CUT_REPLAYABLE, Behaviour.RUN_FAILED],
            start=2,
        ):
            stub.configure(behaviour=behaviour, stall_seconds=10)
            runs.append(orchestrator.process(eml, attempt=attempt))
        # The client's own exceptions, with their whole chain.
        for behaviour in (Behaviour.UNAUTHORIZED, Behaviour.SLOW, Behaviour.NON_JSON):
            stub.configure(behaviour=behaviour)
            try:
                client_for(settings).recover(
                    render_message(_request()),
                    idempotency_key="k",
                    subject_id="0" * 64,
                    deadline=Deadline(0.5),
                    progress=CallProgress(),
                )
            except FieldRecoveryError as exc:
                errors.append(exc)
        assert stub.bearer_tokens_seen == {CANARY}  # the key really was used
        assert stub.cancelled_runs  # the deadline path ran

    assert [r.status for r in runs] == [RecoveryStatus.SUCCEEDED] * 2 + [
        RecoveryStatus.FAILED,
        RecoveryStatus.FAILED,
        RecoveryStatus.FAILED,
        RecoveryStatus.SUCCEEDED,
        RecoveryStatus.FAILED,
    ]
    assert len(errors) == 2  # 401 and the deadline (NON_JSON is the orchestrator's to refuse)

    records = caplog.records
    messages = [r.getMessage() for r in records]
    assert any("event=provider_call_end" in m and "duration_ms=" in m for m in messages)
    assert any("error_code=deadline_exceeded" in m for m in messages)
    for record in records:
        for item in _texts_of(record):
            assert CANARY not in item, record.name

    for exc in errors:
        chain = "".join(traceback.format_exception(exc))
        assert CANARY not in chain and CANARY not in repr(exc)
    for run in runs:
        assert CANARY not in str(run.to_json())

    engine = create_engine(field_db)
    with engine.connect() as conn:
        for table in ("field_recovery_invocation", "field_recovery_artifact"):
            dumped = conn.execute(text(f"SELECT row_to_json(t)::text FROM th_hotel_booking.{table} t")).scalars().all()
            assert dumped, table
            assert not [row for row in dumped if CANARY in row], table
    engine.dispose()

    # Nor the request or the answer texts (docs/field-recovery.md).
    evidence_line = "Room Type: Deluxe King Room (non-smoking)"
    assert evidence_line in render_message(_request())
    for m in messages:
        assert evidence_line not in m and '"candidate_ref"' not in m


def _request() -> RecoveryRequestSet:
    from fieldrecovery.eml import parse_eml
    from fieldrecovery.request_builder import build_request

    request = build_request(parse_eml(sample_eml("ambiguous")), profile_version="p")
    assert request is not None
    return request
