"""Configuration gate (docs/field-recovery.md): default off, own key required, wait cap."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cli.main import main
from fieldrecovery.client import client_for
from settings import FIELD_RECOVERY_MAX_WAIT_CAP_SECONDS, SettingsError, get_settings, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import os

    for name in list(os.environ):
        if name.upper().startswith("BOOKING_FIELD_RECOVERY__"):
            monkeypatch.delenv(name)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_default_is_off_without_trace_and_with_documented_values() -> None:
    fr = load_settings().booking_field_recovery
    assert fr.enabled is False
    assert fr.open_api.include_trace is False
    assert fr.open_api.api_key.get_secret_value() == ""
    assert (fr.max_wait, fr.poll_interval, fr.open_api.connect_timeout) == (120.0, 0.1, 15.0)
    assert fr.open_api.sse_recovery_max_attempts == 5
    assert (fr.max_message_chars, fr.max_response_chars) == (200_000, 200_000)
    assert fr.db_schema == "th_hotel_booking"
    assert fr.stale_takeover is False


def test_nested_environment_names_and_durations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__ENABLED", "true")
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__OPEN_API__API_KEY", "df_open_own")
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__OPEN_API__BASE_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__MAX_WAIT", "90s")
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__POLL_INTERVAL", "250ms")
    fr = load_settings().booking_field_recovery
    assert fr.enabled and fr.open_api.api_key.get_secret_value() == "df_open_own"
    assert (fr.max_wait, fr.poll_interval) == (90.0, 0.25)


def test_enabled_without_its_own_key_fails_naming_the_variable_and_never_borrows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__ENABLED", "true")
    monkeypatch.setenv("MODEL_API_KEY", "sk-another-agents-key")  # must not be borrowed
    with pytest.raises(SettingsError) as exc:
        load_settings()
    assert "BOOKING_FIELD_RECOVERY__OPEN_API__API_KEY" in str(exc.value)
    assert "sk-another-agents-key" not in str(exc.value)


@pytest.mark.parametrize("value", ["0", "-1", str(FIELD_RECOVERY_MAX_WAIT_CAP_SECONDS + 1), "11m"])
def test_max_wait_must_be_positive_and_capped(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__MAX_WAIT", value)
    with pytest.raises(SettingsError) as exc:
        load_settings()
    assert "BOOKING_FIELD_RECOVERY__MAX_WAIT" in str(exc.value)


def test_max_wait_at_the_cap_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__MAX_WAIT", "10m")
    assert load_settings().booking_field_recovery.max_wait == FIELD_RECOVERY_MAX_WAIT_CAP_SECONDS


def test_cli_stops_at_start_on_incomplete_configuration(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__ENABLED", "true")
    assert main(["field", "recover", "tests/data/field_booking_ambiguous.eml", "--json"]) == 2
    err = capsys.readouterr()
    assert "BOOKING_FIELD_RECOVERY__OPEN_API__API_KEY" in err.err
    assert err.out == ""


def test_client_is_built_from_the_parsing_agents_settings_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODEL_API_KEY", "sk-another-agents-key")
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__ENABLED", "true")
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__OPEN_API__API_KEY", "df_open_parsing_agent")
    client = client_for(load_settings().booking_field_recovery)
    assert client._key == "df_open_parsing_agent"
    assert "df_open_parsing_agent" not in repr(client)


def test_worker_configuration_stops_at_start_on_incomplete_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    import celeryconfig

    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__ENABLED", "true")
    with pytest.raises(SettingsError) as exc:
        celeryconfig.build()
    assert "BOOKING_FIELD_RECOVERY__OPEN_API__API_KEY" in str(exc.value)


# --- the key is a secret, the URL is https (or loopback), timings are > 0 ---


def test_api_key_is_in_no_repr_and_no_model_dump(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__ENABLED", "true")
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__OPEN_API__API_KEY", "df_open_SECRET_canary")
    settings = load_settings()
    fr = settings.booking_field_recovery
    for text in (repr(settings), str(fr), repr(fr.open_api), str(fr.model_dump()), fr.model_dump_json()):
        assert "df_open_SECRET_canary" not in text
    assert "df_open_SECRET_canary" not in str(settings.model_dump(mode="json"))
    assert client_for(fr)._key == "df_open_SECRET_canary"  # the header still gets the real key


@pytest.mark.parametrize(
    "url",
    ["http://superagent.nianxx.cn", "http://10.0.0.7:8080", "http://127.0.0.1.nip.io", "ftp://127.0.0.1", "nonsense"],
)
def test_a_cleartext_or_odd_base_url_is_refused(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__OPEN_API__BASE_URL", url)
    with pytest.raises(SettingsError) as exc:
        load_settings()
    assert "BOOKING_FIELD_RECOVERY__OPEN_API__BASE_URL" in str(exc.value)


@pytest.mark.parametrize(
    "url", ["https://superagent.nianxx.cn", "http://127.0.0.1:8799", "http://localhost:1", "http://[::1]:8799"]
)
def test_https_and_loopback_http_base_urls_are_accepted(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__OPEN_API__BASE_URL", url)
    assert load_settings().booking_field_recovery.open_api.base_url == url


@pytest.mark.parametrize(
    "name", ["OPEN_API__CONNECT_TIMEOUT", "POLL_INTERVAL", "LEASE_SECONDS"], ids=["connect", "poll", "lease"]
)
@pytest.mark.parametrize("value", ["0", "0ms", "-1"])
def test_timings_must_be_positive(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(f"BOOKING_FIELD_RECOVERY__{name}", value)
    with pytest.raises(SettingsError) as exc:
        load_settings()
    assert f"BOOKING_FIELD_RECOVERY__{name}" in str(exc.value)
