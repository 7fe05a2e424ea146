"""Field recovery killed right after it claimed the invocation (crash point field.after_claim):
without takeover the key fails closed (no second provider call while the dead owner "holds"
it); with takeover the expired owner is fenced and exactly one provider call happens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import requests

from tests.integration.test_field_cli import ROOT, SAMPLE, field_db, field_env, stub_process  # noqa: F401

pytestmark = [pytest.mark.crash, pytest.mark.timeout(120)]


def _recover(env: dict[str, str], **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "field", "recover", str(SAMPLE), "--json"],
        cwd=ROOT,
        env={**os.environ, **env, **extra},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _streams(base: str) -> int:
    return int(requests.get(base + "/_stats", timeout=5).json()["streams"])


def test_owner_killed_after_claim_fails_closed_without_takeover_and_recovers_once_with_it(
    field_env: dict[str, str],  # noqa: F811
    stub_process: str,  # noqa: F811
) -> None:
    crashed = _recover(field_env, CRASH_POINT="field.after_claim", BOOKING_FIELD_RECOVERY__LEASE_SECONDS="1")
    assert crashed.returncode == 137, crashed.stderr
    assert "crash_point=field.after_claim" in crashed.stderr
    assert _streams(stub_process) == 0

    off = _recover(field_env, BOOKING_FIELD_RECOVERY__MAX_WAIT="2s", BOOKING_FIELD_RECOVERY__STALE_TAKEOVER="false")
    result = json.loads(off.stdout)
    assert off.returncode == 1 and result["status"] == "FAILED" and result["provider_calls"] == 0
    assert _streams(stub_process) == 0

    on = _recover(field_env, BOOKING_FIELD_RECOVERY__STALE_TAKEOVER="true")
    result = json.loads(on.stdout)
    assert on.returncode == 0, on.stderr
    assert (result["status"], result["replayed"], result["provider_calls"]) == ("SUCCEEDED", False, 1)
    assert _streams(stub_process) == 1

    again = _recover(field_env)
    assert json.loads(again.stdout)["replayed"] is True
    assert _streams(stub_process) == 1


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "field", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_sigkilled_owners_key_is_listed_as_stale_and_released_by_an_operator(
    field_env: dict[str, str],  # noqa: F811
    stub_process: str,  # noqa: F811
) -> None:
    # Takeover off, the owner dies after its claim; its key would block every
    # redelivery for the whole wait. `field stale` shows it, `field release` ends it.
    crashed = _recover(field_env, CRASH_POINT="field.after_claim", BOOKING_FIELD_RECOVERY__LEASE_SECONDS="0.5")
    assert crashed.returncode == 137, crashed.stderr
    time.sleep(0.6)  # the lease runs out: nobody renews it
    listed = _cli(field_env, "stale", "--json")
    assert listed.returncode == 0, listed.stderr
    [stale] = json.loads(listed.stdout)["stale"]
    assert stale["epoch"] == 1 and stale["age_seconds"] >= stale["overdue_seconds"] > 0
    table = _cli(field_env, "stale")
    assert stale["idempotency_key"] in table.stdout and "OVERDUE" in table.stdout

    released = _cli(field_env, "release", stale["idempotency_key"], "--reason", "worker SIGKILLed", "--epoch", "1")
    assert released.returncode == 0 and "RELEASED" in released.stdout
    assert _cli(field_env, "release", stale["idempotency_key"]).returncode == 1  # FINISHED now
    assert json.loads(_cli(field_env, "stale", "--json").stdout) == {"stale": []}

    redelivered = _recover(field_env)  # fails closed at once instead of waiting out max_wait
    result = json.loads(redelivered.stdout)
    assert (result["status"], result["error_code"], result["replayed"]) == ("FAILED", "released_stale", True)
    again = subprocess.run(
        [sys.executable, "-m", "cli.main", "field", "recover", str(SAMPLE), "--json", "--attempt", "2"],
        cwd=ROOT,
        env={**os.environ, **field_env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0 and json.loads(again.stdout)["provider_calls"] == 1  # a new attempt runs
    assert _streams(stub_process) == 1


def test_an_owner_killed_mid_stream_after_its_run_was_recorded_has_that_run_cancelled_by_the_takeover(
    field_env: dict[str, str],  # noqa: F811
    stub_process: str,  # noqa: F811
) -> None:
    # The owner dies while the platform runs its call (the run id is committed): the run would
    # go on paying for an answer nobody reads. The takeover cancels it before calling again.
    crashed = _recover(field_env, CRASH_POINT="field.after_run_recorded", BOOKING_FIELD_RECOVERY__LEASE_SECONDS="0.5")
    assert crashed.returncode == 137, crashed.stderr
    assert "crash_point=field.after_run_recorded" in crashed.stderr
    stats = requests.get(stub_process + "/_stats", timeout=5).json()
    assert (stats["streams"], stats["cancels"]) == (1, 0)
    time.sleep(0.6)  # the dead owner's lease runs out

    on = _recover(field_env, BOOKING_FIELD_RECOVERY__STALE_TAKEOVER="true")
    result = json.loads(on.stdout)
    assert on.returncode == 0, on.stderr
    assert (result["status"], result["replayed"], result["provider_calls"]) == ("SUCCEEDED", False, 1)
    stats = requests.get(stub_process + "/_stats", timeout=5).json()
    assert (stats["streams"], stats["cancels"]) == (2, 1)  # the dead run cancelled once, one new call
    assert json.loads(_recover(field_env).stdout)["replayed"] is True
