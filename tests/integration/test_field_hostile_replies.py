"""A hostile platform, second pass: the key echoed back, informational replies, event ids with a
NUL, ids that are path segments, replies that are not HTTP we read. Real PostgreSQL, the
stand-in (or a raw socket peer) over loopback; every outcome is a clean FAILED or SUCCEEDED.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from doubles.superagent import Behaviour, SuperAgentStub
from fieldrecovery.errors import FieldRecoveryError
from fieldrecovery.orchestrator import FieldRecoveryOrchestrator, RecoveryRun, RecoveryStatus
from settings import FieldRecoverySettings
from tests.field_helpers import SampleCall, call_provider, clean_field_tables, open_api_client, sample_eml

KEY = "df_open_hostile_replies_Zq81xWm4"
AMBIGUOUS = sample_eml("ambiguous")


@pytest.fixture
def field_db(db: str) -> Iterator[str]:
    clean_field_tables(db)
    yield db


@pytest.fixture
def stub() -> Iterator[SuperAgentStub]:
    with SuperAgentStub(api_key=KEY) as server:
        yield server


def _settings(base_url: str, **changes: Any) -> FieldRecoverySettings:
    return FieldRecoverySettings.model_validate(
        {"enabled": True, "open_api": {"base_url": base_url, "api_key": KEY}, "max_wait": 5, **changes}
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


def _key_runs(texts: list[str]) -> list[str]:
    """Every 8-character run of the key found in ``texts``."""
    runs = {KEY[i : i + 8] for i in range(len(KEY) - 7)}
    return sorted({run for t in texts for run in runs if run in t})


# --- the key never comes back from the peer ------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"behaviour": Behaviour.RUN_FAILED, "error_code": f"invalid_token:{KEY}"}, "provider_error"),
        ({"behaviour": Behaviour.RUN_FAILED, "error_code": f"bad:{KEY[9:17]}:x"}, "provider_error"),
        ({"reported_status": KEY}, "run_status_unknown"),
    ],
    ids=["error_code_with_the_key", "error_code_with_8_characters_of_it", "run_status_equal_to_the_key"],
)
def test_a_peer_that_echoes_the_key_never_gets_it_stored_logged_or_returned(
    field_db: str,
    stub: SuperAgentStub,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    changes: dict[str, Any],
    code: str,
) -> None:
    from settings import get_settings
    from tasks.field import recover_eml_task

    stub.configure(**changes)
    caplog.set_level(logging.DEBUG)
    run = _process(field_db, _settings(stub.base_url))
    assert run.status == RecoveryStatus.FAILED
    assert run.error_code == code
    [row] = _invocations(field_db)
    assert row["error_code"] == code
    texts = [json.dumps(run.to_json()), json.dumps(run.summary()), json.dumps(row, default=str)]
    texts += [r.getMessage() for r in caplog.records]
    assert _key_runs(texts) == []
    # The Celery task's result (a replay of the FAILED row) carries no part of it either.
    for name, value in [("ENABLED", "true"), ("OPEN_API__BASE_URL", stub.base_url), ("OPEN_API__API_KEY", KEY)]:
        monkeypatch.setenv(f"BOOKING_FIELD_RECOVERY__{name}", value)
    get_settings.cache_clear()
    try:
        summary = recover_eml_task(AMBIGUOUS.decode(), "MANUAL_EML", 1)
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
    assert summary["error_code"] == code
    assert _key_runs([json.dumps(summary)]) == []


def test_the_key_guard_finds_the_key_and_every_8_character_run_of_it_and_nothing_shorter() -> None:
    from fieldrecovery.client import KeyGuard

    guard = KeyGuard(KEY)
    assert guard.carries(f"text {KEY[5:13]} text") and guard.carries(KEY)
    assert not guard.carries(KEY[5:12]) and not guard.carries("ses_000001")


# --- informational replies --------------------------------------------------------------------


@pytest.mark.parametrize(("informational", "on"), [((103,), "stream"), ((102, 103), "stream"), ((103,), "session")])
def test_informational_replies_before_the_response_are_skipped(
    field_db: str, stub: SuperAgentStub, informational: tuple[int, ...], on: str
) -> None:
    stub.configure(informational=informational, informational_on=on)
    started = time.process_time()
    run = _process(field_db, _settings(stub.base_url))
    assert run.status == RecoveryStatus.SUCCEEDED, run.error_code
    assert time.process_time() - started < 2.0
    assert stub.stats()["streams"] == 1


def test_a_stream_that_fails_after_the_message_was_sent_cancels_its_run(stub: SuperAgentStub) -> None:
    """A 5xx or an unreadable reply to the message stream may come after the platform started a
    run (a proxy in between): the session's run is cancelled. Only a 4xx refusal is not."""
    stub.configure(informational=tuple([103] * 40), informational_on="stream")
    client = open_api_client(stub.base_url, KEY)
    with pytest.raises(FieldRecoveryError) as info:
        call_provider(client, SampleCall())
    assert info.value.code == "bad_response"
    assert stub.stats()["session_cancels"] == 1


# --- event ids --------------------------------------------------------------------------------


def test_an_event_id_with_a_nul_is_ignored_and_never_logged(
    stub: SuperAgentStub, caplog: pytest.LogCaptureFixture
) -> None:
    stub.configure(behaviour=Behaviour.CUT_REPLAYABLE, cut_after=2, event_id_suffix="\x00\x1b[31m")
    caplog.set_level(logging.DEBUG)
    answer, progress = call_provider(open_api_client(stub.base_url, KEY), SampleCall())
    assert answer.content and progress.sse_recoveries >= 1
    lines = [r.getMessage() for r in caplog.records if "sse_" in r.getMessage()]
    assert lines and not any("\x00" in line or "\x1b" in line for line in lines), lines


# --- ids that are path segments ---------------------------------------------------------------


@pytest.mark.parametrize(("which", "value"), [("session_id", ".."), ("session_id", "."), ("run_id", "..")])
def test_a_dot_only_id_is_refused_and_no_request_goes_to_another_path(
    field_db: str, stub: SuperAgentStub, which: str, value: str
) -> None:
    stub.configure(**{which: value})
    run = _process(field_db, _settings(stub.base_url))
    assert run.status == RecoveryStatus.FAILED
    assert run.error_code == "bad_response"
    assert stub.stats()["not_found"] == 0


def test_every_path_segment_is_encoded(field_db: str, stub: SuperAgentStub) -> None:
    stub.configure(session_id="ses:1.a", run_id="run:1.b")
    run = _process(field_db, _settings(stub.base_url))
    assert run.status == RecoveryStatus.SUCCEEDED, run.error_code
    from fieldrecovery.client import segment

    assert segment("..") == ".." and segment("a/b") == "a%2Fb" and segment("ses:1") == "ses%3A1"


# --- replies that are not HTTP we read --------------------------------------------------------


class RawPeer:
    """A loopback socket that answers every connection with ``reply`` and closes."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def __enter__(self) -> RawPeer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.listener.close()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(2)
                    conn.recv(65536)
                    conn.sendall(self.reply)
                    conn.shutdown(socket.SHUT_WR)
                except OSError:
                    pass


MALFORMED = {
    "ten_thousand_headers": b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 10_000 + b"\r\n",
    "a_one_megabyte_header_line": b"HTTP/1.1 200 OK\r\nX-A: " + b"a" * (1 << 20) + b"\r\n\r\n",
    "a_malformed_status_line": b"HTTP/1.1 abc OK\r\n\r\n",
    "a_status_line_that_is_not_http": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_reply_that_is_not_http_we_read_is_bad_response_not_connect(case: str) -> None:
    with RawPeer(MALFORMED[case]) as peer:
        client = open_api_client(peer.url, KEY)
        started = time.monotonic()
        with pytest.raises(FieldRecoveryError) as info:
            call_provider(client, SampleCall())
        elapsed = time.monotonic() - started
    assert info.value.code == "bad_response"
    assert elapsed < 3.0
