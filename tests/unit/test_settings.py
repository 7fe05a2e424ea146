"""Settings: public env names, defaults, and errors that name the variable."""

from __future__ import annotations

import pytest

from settings import SettingsError, load_settings


def test_defaults_match_the_design(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SUBAGENT_TIMEOUT_SECONDS", "SUBAGENT_CANCEL_GRACE_SECONDS", "BOOKING_FIELD_RECOVERY__ENABLED"):
        monkeypatch.delenv(name, raising=False)
    s = load_settings()
    assert s.SUBAGENT_TIMEOUT_SECONDS == 3600
    assert s.SUBAGENT_CANCEL_GRACE_SECONDS == 30
    fr = s.booking_field_recovery
    assert fr.enabled is False
    assert fr.max_wait == 120 and fr.poll_interval == pytest.approx(0.1)
    assert fr.open_api.connect_timeout == 15 and fr.open_api.sse_recovery_max_attempts == 5
    assert fr.open_api.include_trace is False
    assert fr.max_message_chars == fr.max_response_chars == 200_000


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SUBAGENT_TIMEOUT_SECONDS", "soon"),
        ("SUBAGENT_TIMEOUT_SECONDS", "-1"),
        ("LEASE_SECONDS", "1"),
        ("DATABASE_URL", "not a url"),
        ("SCAN_INTERVAL_SECONDS", "0"),
    ],
)
def test_invalid_value_fails_naming_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=name):
        load_settings()


def test_env_values_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBAGENT_TIMEOUT_SECONDS", "5")
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__MAX_WAIT", "1500ms")
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__OPEN_API__CONNECT_TIMEOUT", "2s")
    s = load_settings()
    assert s.SUBAGENT_TIMEOUT_SECONDS == 5
    assert s.booking_field_recovery.max_wait == 1.5
    assert s.booking_field_recovery.open_api.connect_timeout == 2


def test_secrets_are_not_in_the_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODEL_API_KEY", "sk-canary-123")
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__OPEN_API__API_KEY", "df_open_canary")
    s = load_settings()
    assert "sk-canary-123" not in repr(s)
    assert "df_open_canary" not in repr(s)
