"""`agent-recovery field recover` end to end against `agent-recovery superagent-stub serve`.

The stand-in runs as its own process (the operator's demo); the first recovery runs as a
subprocess, the second through main(argv); /_stats shows that the second one replayed.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from cli.main import main
from settings import get_settings
from tests.field_helpers import DATA_DIR, clean_field_tables, wait_until

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = DATA_DIR / "field_booking_ambiguous.eml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def field_db(db: str) -> Iterator[str]:
    clean_field_tables(db)
    yield db


@pytest.fixture
def stub_process() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "superagent-stub", "serve", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return requests.get(base + "/_stats", timeout=0.5).ok
        except requests.ConnectionError:
            return False

    try:
        assert wait_until(up, timeout=30), "the stand-in did not start"  # 1 s quiet; more beside other suites
        yield base
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0  # SIGTERM is a clean stop
        assert proc.stdout is not None
        assert "superagent-stub listening on" in proc.stdout.read()


@pytest.fixture
def field_env(field_db: str, stub_process: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    env = {
        "DATABASE_URL": field_db,
        "BOOKING_FIELD_RECOVERY__ENABLED": "true",
        "BOOKING_FIELD_RECOVERY__OPEN_API__BASE_URL": stub_process,
        "BOOKING_FIELD_RECOVERY__OPEN_API__API_KEY": "df_open_test",
        "BOOKING_FIELD_RECOVERY__MAX_WAIT": "10s",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    yield env
    get_settings.cache_clear()


def _stats(base: str) -> dict[str, int]:
    return dict(requests.get(base + "/_stats", timeout=5).json())


def test_cli_recovers_against_the_stand_in_and_the_second_run_replays(
    field_env: dict[str, str], stub_process: str, capsys: pytest.CaptureFixture[str]
) -> None:
    first = subprocess.run(
        [sys.executable, "-m", "cli.main", "field", "recover", str(SAMPLE), "--json"],
        cwd=ROOT,
        env={**os.environ, **field_env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert first.returncode == 0, first.stderr
    result = json.loads(first.stdout)
    assert set(result) >= {"status", "replayed", "provider_calls", "effective_view", "rejected"}
    assert (result["status"], result["replayed"], result["provider_calls"]) == ("SUCCEEDED", False, 1)
    facts = {f["path"]: f for f in result["effective_view"]["facts"]}
    assert set(facts["booking.arrival_date"]) == {"path", "value", "status", "provenance"}
    assert facts["booking.arrival_date"] == {
        "path": "booking.arrival_date",
        "value": "2026-03-05",
        "status": "RESOLVED",
        "provenance": "RECOVERY",
    }
    assert facts["booking.guest_name"]["provenance"] == "PARSER"
    assert result["rejected"] == []
    after_first = _stats(stub_process)
    assert (after_first["sessions"], after_first["streams"], after_first["run_status"]) == (1, 1, 1)

    assert main(["field", "recover", str(SAMPLE), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert (again["status"], again["replayed"], again["provider_calls"]) == ("SUCCEEDED", True, 0)
    assert again["effective_view"] == result["effective_view"]
    assert _stats(stub_process) == after_first  # no provider call at all


def test_cli_prints_a_readable_table_with_provenance(
    field_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["field", "recover", str(SAMPLE)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("status: SUCCEEDED")
    assert out[1].split() == ["PATH", "VALUE", "STATUS", "PROVENANCE"]
    rows = {line.split()[0]: line.split() for line in out[2:]}
    assert rows["booking.room_type"] == ["booking.room_type", "Deluxe", "King", "RESOLVED", "RECOVERY"]
    assert rows["booking.currency"] == ["booking.currency", "EUR", "RESOLVED", "PARSER"]


def test_cli_reports_failure_with_exit_status_one(
    field_env: dict[str, str], stub_process: str, capsys: pytest.CaptureFixture[str]
) -> None:
    requests.post(stub_process + "/_config", json={"behaviour": "fenced"}, timeout=5).raise_for_status()
    assert main(["field", "recover", str(SAMPLE), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert (result["status"], result["error_code"]) == ("FAILED", "output_fenced")
    assert {f["provenance"] for f in result["effective_view"]["facts"]} == {"PARSER"}


def test_celery_task_runs_the_same_pipeline(field_env: dict[str, str], stub_process: str) -> None:
    from tasks.field import recover_eml_task

    assert recover_eml_task.name == "field.recover_eml"
    max_wait = get_settings().booking_field_recovery.max_wait
    assert recover_eml_task.time_limit is not None and recover_eml_task.time_limit > max_wait
    result = recover_eml_task.apply(args=[SAMPLE.read_text()]).get(timeout=30)
    assert (result["status"], result["needs_review"], result["error_code"]) == ("SUCCEEDED", False, None)
    agentbus = recover_eml_task.apply(args=[SAMPLE.read_text()], kwargs={"source": "AGENTBUS"}).get(timeout=30)
    assert agentbus["status"] == "SKIPPED"
    assert _stats(stub_process)["streams"] == 1


def test_celery_task_returns_no_booking_data_so_none_reaches_the_worker_log(
    field_env: dict[str, str], stub_process: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Celery logs "Task ... succeeded in ...: <return value>" at INFO and keeps
    # the value in the result backend: it must hold status, error code and key, nothing else.
    from tasks.field import recover_eml_task

    caplog.set_level(logging.INFO)
    result = recover_eml_task.apply(args=[SAMPLE.read_text()]).get(timeout=30)
    assert set(result) == {"status", "needs_review", "error_code", "idempotency_key"}
    assert result["status"] == "SUCCEEDED" and len(result["idempotency_key"]) == 64
    booking = ("Jane Doe", "FC-20260305-0042", "Deluxe King", "2026-03-05", "180.00")
    succeeded = [r for r in caplog.records if "succeeded in" in r.getMessage()]
    assert succeeded, "celery's success line was not captured"
    for record in caplog.records:
        assert not any(value in record.getMessage() for value in booking), record.getMessage()
    assert not any(value in json.dumps(result) for value in booking)


def test_cli_exits_three_when_every_patch_is_rejected_and_review_is_needed(
    field_env: dict[str, str], stub_process: str, capsys: pytest.CaptureFixture[str]
) -> None:
    requests.post(stub_process + "/_config", json={"behaviour": "reject_all"}, timeout=5).raise_for_status()
    assert main(["field", "recover", str(SAMPLE), "--json"]) == 3
    result = json.loads(capsys.readouterr().out)
    assert (result["status"], result["needs_review"], len(result["rejected"])) == ("SUCCEEDED", True, 3)
    assert main(["field", "recover", str(SAMPLE)]) == 3  # the replay too; the table says so
    assert "NEEDS REVIEW" in capsys.readouterr().out.splitlines()[0]


def test_cli_recover_against_dripped_headers_ends_at_max_wait(field_env: dict[str, str], stub_process: str) -> None:
    # As an operator tried it: headers one byte every half second.
    config = {"behaviour": "slow_headers", "slow_headers_on": "session", "header_drip_seconds": 0.5}
    requests.post(stub_process + "/_config", json=config, timeout=5).raise_for_status()
    # The same interpreter's start-up, now (0.5 s quiet, several seconds on a busy machine).
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "cli.main", "field", "recover", "--help"], cwd=ROOT, capture_output=True)
    startup = time.monotonic() - started
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "field", "recover", str(SAMPLE), "--json"],
        cwd=ROOT,
        env={**os.environ, **field_env, "BOOKING_FIELD_RECOVERY__MAX_WAIT": "1s"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["error_code"] == "deadline_exceeded"
    # max_wait plus the interpreter's start-up (twice: the one measured above varies with the
    # machine's load) and 3 s of slack, not the ~60 s of the drip
    assert elapsed < 1 + 2 * startup + 3, f"{elapsed:.1f}s (start-up {startup:.1f}s)"
