"""`agent-recovery field recover` on hostile input: exit 1 or 2, no traceback,
nothing left IN_PROGRESS, even with recovery disabled (the parsed facts are written first)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from fieldrecovery.errors import FieldRecoveryError
from fieldrecovery.orchestrator import FieldRecoveryOrchestrator
from settings import FieldRecoverySettings
from tests.field_helpers import clean_field_tables, sample_eml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def field_db(db: str) -> Iterator[str]:
    clean_field_tables(db)
    yield db


def _recover(db: str, eml: Path, *extra: str, enabled: bool = False) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DATABASE_URL": db,
        "BOOKING_FIELD_RECOVERY__ENABLED": "true" if enabled else "false",
        "BOOKING_FIELD_RECOVERY__OPEN_API__BASE_URL": "http://127.0.0.1:9",
        "BOOKING_FIELD_RECOVERY__OPEN_API__API_KEY": "df_open_cli_hostile",
    }
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "field", "recover", str(eml), "--json", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _count(db: str, table: str) -> int:
    engine = create_engine(db)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(f"SELECT count(*) FROM th_hotel_booking.{table}")).scalar_one())
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b"Message-ID: <fc-20260305-0042@", b"Message-ID: <fc\x00-20260305-0042@"),
        (b"Message-ID: <fc-20260305-0042@", b"Message-ID: <" + b"m" * 600 + b"@"),
        (b"X-Booking-Revision: 1", b"X-Booking-Revision: 4294967296"),
        (b"X-Booking-Revision: 1", "X-Booking-Revision: ²".encode()),
        (b"charset=utf-8", b"charset=x-nonexistent"),
    ],
    ids=["nul_message_id", "message_id_over_512", "revision_above_int32", "superscript_revision", "unknown_charset"],
)
def test_a_hostile_eml_exits_1_with_eml_invalid_and_writes_nothing(
    field_db: str, tmp_path: Path, old: bytes, new: bytes
) -> None:
    raw = sample_eml("ambiguous")
    assert old in raw
    eml = tmp_path / "hostile.eml"
    eml.write_bytes(raw.replace(old, new))
    done = _recover(field_db, eml)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "[eml_invalid]" in done.stderr
    assert _count(field_db, "field_recovery_artifact") == 0
    assert _count(field_db, "field_recovery_invocation") == 0


@pytest.mark.parametrize("attempt", ["0", "-1", "2147483648", "x"])
def test_an_attempt_outside_1_to_int32_is_a_usage_error_with_exit_2(field_db: str, attempt: str) -> None:
    done = _recover(field_db, ROOT / "tests" / "data" / "field_booking_ambiguous.eml", "--attempt", attempt)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "--attempt" in done.stderr


def test_the_pipeline_refuses_attempt_0_before_writing_anything(field_db: str) -> None:
    settings = FieldRecoverySettings.model_validate({"enabled": False})
    with pytest.raises(FieldRecoveryError) as info:
        FieldRecoveryOrchestrator(settings, url=field_db).process(sample_eml("ambiguous"), attempt=0)
    assert info.value.code == "attempt_invalid"
    assert _count(field_db, "field_recovery_artifact") == 0


@pytest.mark.parametrize(
    ("eml", "source", "attempt", "code"),
    [
        ("not an email at all", "MANUAL_EML", 1, "eml_invalid"),
        ("Message-ID: <a@b>\n\nhello", "MANUAL_EML", 0, "attempt_invalid"),
        ("Message-ID: <a@b>\n\nhello", "NO_SUCH_SOURCE", 1, "input_invalid"),
    ],
)
def test_the_celery_task_answers_bad_input_with_a_failed_summary_not_a_traceback(
    db: str, eml: str, source: str, attempt: int, code: str
) -> None:
    from tasks.field import recover_eml_task

    summary = recover_eml_task(eml, source, attempt)  # run in this process, as a worker would
    # The same status spelling as a failed run's summary (RecoveryRun.summary()).
    assert summary == {"status": "FAILED", "needs_review": False, "error_code": code, "idempotency_key": None}


def _nested_multipart(levels: int) -> bytes:
    head = b"Message-ID: <m1@x>\nMIME-Version: 1.0\n"
    body = b"".join(b"Content-Type: multipart/mixed; boundary=b%d\n\n--b%d\n" % (i, i) for i in range(levels))
    return head + body + b"Content-Type: text/plain\n\nAdults: 2\n"


#: Inputs that made the old parser recurse until RecursionError, and the code each gets now.
RECURSING = {
    "multipart_nested_1000_levels": (_nested_multipart(1000), "eml_too_large"),
    "message_id_after_1000_open_parentheses": (
        sample_eml("ambiguous").replace(b"Message-ID: <", b"Message-ID: " + b"(" * 1000 + b"<", 1),
        "eml_invalid",
    ),
}


@pytest.mark.parametrize("case", list(RECURSING))
def test_input_that_recursed_exits_1_with_one_line_and_no_traceback(field_db: str, tmp_path: Path, case: str) -> None:
    raw, code = RECURSING[case]
    eml = tmp_path / "recursing.eml"
    eml.write_bytes(raw)
    done = _recover(field_db, eml)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"[{code}]" in done.stderr
    assert _count(field_db, "field_recovery_invocation") == 0


@pytest.mark.parametrize("case", list(RECURSING))
def test_the_celery_task_answers_input_that_recursed_with_its_failed_summary(db: str, case: str) -> None:
    from tasks.field import recover_eml_task

    raw, code = RECURSING[case]
    summary = recover_eml_task(raw.decode("utf-8", "surrogateescape"), "MANUAL_EML", 1)
    assert summary == {"status": "FAILED", "needs_review": False, "error_code": code, "idempotency_key": None}


def test_the_cli_reads_no_more_than_the_input_limit_and_exits_1_with_eml_too_large(
    field_db: str, tmp_path: Path
) -> None:
    eml = tmp_path / "large.eml"
    eml.write_bytes(sample_eml("ambiguous") + b"x" * (11 * 1024 * 1024))
    done = _recover(field_db, eml)
    assert done.returncode == 1, done.stderr
    assert "[eml_too_large]" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
