"""The Open API client against what real deployments send: the stand-in's behaviours
for dripped headers, compression, platform cookies, heartbeats, unterminated events, runs still
in progress, 201 Created, and the run cancel on every failure. Real loopback HTTP, no mocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from doubles.superagent import Behaviour, SuperAgentStub
from fieldrecovery.answer import parse_patch_set
from fieldrecovery.client import CallProgress, OpenApiClient, ProviderAnswer
from fieldrecovery.deadline import Deadline
from fieldrecovery.errors import (
    DeadlineExceeded,
    FieldRecoveryError,
    InvocationLost,
    ProviderOutputInvalid,
    ProviderUnavailable,
)
from settings import OpenApiSettings
from tests.field_helpers import SampleCall, call_provider, open_api_client, wait_until

KEY = "df_open_real_servers"
SAMPLE = SampleCall()
FACTS, REQUEST, MESSAGE, SUBJECT = SAMPLE.facts, SAMPLE.request, SAMPLE.message, SAMPLE.subject


@pytest.fixture
def stub() -> Iterator[SuperAgentStub]:
    with SuperAgentStub(api_key=KEY) as server:
        yield server


def _client(stub: SuperAgentStub, max_response_chars: int = 200_000, **open_api: object) -> OpenApiClient:
    return open_api_client(stub.base_url, KEY, max_response_chars, **open_api)  # type: ignore[no-any-return]


def _call(
    client: OpenApiClient,
    seconds: float = 5.0,
    progress: CallProgress | None = None,
    stop: threading.Event | None = None,
) -> tuple[ProviderAnswer, CallProgress]:
    return call_provider(client, SAMPLE, seconds, progress, stop)


def _fails(
    client: OpenApiClient, seconds: float = 5.0, stop: threading.Event | None = None
) -> tuple[FieldRecoveryError, CallProgress, float]:
    progress = CallProgress()
    started = time.monotonic()
    with pytest.raises(FieldRecoveryError) as exc:
        _call(client, seconds, progress, stop)
    return exc.value, progress, time.monotonic() - started


def _patches(answer: ProviderAnswer) -> dict[str, str]:
    return {p.field: p.value for p in parse_patch_set(answer.content, max_chars=200_000).patches}


# --- the deadline bounds connect and the wait for the response headers --------------


def test_headers_dripped_at_session_creation_are_cut_at_the_deadline(stub: SuperAgentStub) -> None:
    # One byte every 0.2 s: ~100 header bytes would take 20 s; each byte resets a read timeout.
    stub.configure(behaviour=Behaviour.SLOW_HEADERS, slow_headers_on="session", header_drip_seconds=0.2)
    error, progress, elapsed = _fails(_client(stub), seconds=0.5)
    assert isinstance(error, DeadlineExceeded)
    assert elapsed < 1.1
    assert progress.session_id is None and not progress.cancel_sent  # no session, nothing to cancel
    assert stub.stats()["streams"] == 0


def test_headers_dripped_on_the_stream_are_cut_and_the_sessions_run_is_cancelled(stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.SLOW_HEADERS, slow_headers_on="stream", header_drip_seconds=0.2)
    error, progress, elapsed = _fails(_client(stub), seconds=0.5)
    assert isinstance(error, DeadlineExceeded)
    assert elapsed < 1.1 + 0.2  # the deadline, plus the bounded session cancel
    # The run id never arrived (it is in the body behind the headers): the session cancel
    # stops the run the message started.
    assert progress.run_id is None and progress.session_id is not None
    assert progress.cancel_sent and stub.stats()["session_cancels"] == 1
    [run_id] = stub.runs_of_session(progress.session_id)
    assert stub.run_status(run_id) == "cancelled"


def test_connect_to_a_blackhole_is_bounded_by_the_deadline_not_the_connect_timeout() -> None:
    # 10.255.255.1 is not routed here: SYNs go unanswered (or fail at once, which is fine too).
    settings = OpenApiSettings(base_url="https://10.255.255.1:9", api_key=KEY, connect_timeout=30)
    client = OpenApiClient(settings, max_response_chars=1000)
    started = time.monotonic()
    with pytest.raises(FieldRecoveryError):
        client.recover(
            MESSAGE, idempotency_key="k", subject_id=SUBJECT, deadline=Deadline(0.5), progress=CallProgress()
        )
    assert time.monotonic() - started < 1.5


# --- compressed event streams -----------------------------------------------------


@pytest.mark.parametrize("behaviour", [Behaviour.GZIP, Behaviour.GZIP_ALWAYS], ids=["gzip-if-accepted", "gzip-always"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "close-delimited"])
def test_a_compressed_deployment_answers_the_same_patch_set(
    stub: SuperAgentStub, behaviour: Behaviour, chunked: bool
) -> None:
    stub.configure(behaviour=behaviour, chunked=chunked)
    answer, _ = _call(_client(stub))
    assert _patches(answer)["room_type"] == "Deluxe King"
    if behaviour == Behaviour.GZIP_ALWAYS:
        assert stub.stats()["gzip_responses"] >= 2  # the stream too was compressed, and decoded


def test_every_request_asks_for_an_identity_body(stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.GZIP)
    _call(_client(stub))
    # Every body is read capped in decoded bytes: none is asked compressed.
    assert stub.stats()["gzip_responses"] == 0


# --- exactly one csrf_token cookie -------------------------------------------------


def test_a_platform_csrf_cookie_is_never_sent_back_beside_ours(stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.PLATFORM_CSRF_COOKIE)  # reads the FIRST csrf_token, like Go
    answer, _ = _call(_client(stub))
    assert _patches(answer)["room_type"] == "Deluxe King"
    stats = stub.stats()
    assert stats["duplicate_csrf_cookies"] == 0 and stats["rejected_csrf"] == 0
    assert (stats["sessions"], stats["streams"], stats["run_status"]) == (1, 1, 1)


# --- SSE edge cases ----------------------------------------------------------------


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "close-delimited"])
def test_heartbeat_events_with_non_json_data_are_ignored(stub: SuperAgentStub, chunked: bool) -> None:
    stub.configure(behaviour=Behaviour.HEARTBEAT, chunked=chunked)
    answer, progress = _call(_client(stub))
    assert _patches(answer)["room_type"] == "Deluxe King"
    assert progress.sse_recoveries == 0 and stub.stats()["events_replays"] == 0


def test_an_unterminated_event_at_the_end_of_the_body_is_not_acknowledged(stub: SuperAgentStub) -> None:
    # The body ends cleanly inside message.final (id 4, its data, no blank line). Acknowledging
    # id 4 would make the replay start after it, and the final answer would never come.
    stub.configure(behaviour=Behaviour.UNTERMINATED_AT_EOF)
    answer, progress = _call(_client(stub))
    assert _patches(answer)["room_type"] == "Deluxe King"
    assert progress.sse_recoveries == 1 and stub.stats()["events_replays"] == 1


def test_a_run_still_in_progress_is_followed_until_it_ends_not_until_the_attempts_run_out(
    stub: SuperAgentStub,
) -> None:
    # Cut after run.started; the run makes one event every 0.2 s and the events endpoint returns
    # what exists so far. Two attempts would be spent long before the run ends.
    stub.configure(behaviour=Behaviour.REPLAY_IN_PROGRESS, replay_step_seconds=0.2)
    answer, progress = _call(_client(stub, sse_recovery_max_attempts=2), seconds=5.0)
    assert _patches(answer)["room_type"] == "Deluxe King"
    assert progress.sse_recoveries > 2


def test_following_a_run_in_progress_still_ends_at_the_deadline(stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.REPLAY_IN_PROGRESS, replay_step_seconds=5.0)
    error, progress, elapsed = _fails(_client(stub, sse_recovery_max_attempts=2), seconds=0.5)
    assert isinstance(error, DeadlineExceeded) and elapsed < 1.3
    assert progress.run_id is not None and stub.cancelled_runs == [progress.run_id]


# --- any 2xx creates the session -----------------------------------------------------


def test_session_created_with_201_is_success(stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.CREATED_201)
    answer, _ = _call(_client(stub))
    assert _patches(answer)["room_type"] == "Deluxe King"


# --- a lost lease stops the call; every failure after the start cancels the run ----


def test_a_lost_lease_stops_the_call_at_once_and_cancels_the_run(stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.SLOW, stall_seconds=20)
    lost = threading.Event()
    progress = CallProgress()
    lost_at: list[float] = []

    def lose_once_the_run_started() -> None:
        # Not a fixed delay: on a loaded machine run.started may take longer than any guess.
        wait_until(lambda: progress.run_id is not None, timeout=8)
        lost_at.append(time.monotonic())
        lost.set()

    threading.Thread(target=lose_once_the_run_started, daemon=True).start()
    with pytest.raises(FieldRecoveryError) as info:
        _call(_client(stub), 10.0, progress, lost)
    elapsed = time.monotonic() - lost_at[0]
    error = info.value
    assert isinstance(error, InvocationLost) and error.code == "invocation_lost"
    assert elapsed < 1.0, f"the call went on {elapsed:.2f}s after its lease was lost"
    assert progress.run_id is not None and stub.cancelled_runs == [progress.run_id]
    assert stub.stats()["run_status"] == 0


@pytest.mark.parametrize(
    ("behaviour", "code", "options"),
    [
        (Behaviour.CUT_UNRECOVERABLE, "sse_recovery_exhausted", {"sse_recovery_max_attempts": 1}),
        (Behaviour.OVERSIZE, "response_too_large", {}),
    ],
)
def test_a_failure_after_the_run_started_cancels_the_run(
    stub: SuperAgentStub, behaviour: Behaviour, code: str, options: dict[str, object]
) -> None:
    stub.configure(behaviour=behaviour, oversize_chars=200_000)
    error, progress, _ = _fails(_client(stub, max_response_chars=1000, **options))
    assert isinstance(error, ProviderUnavailable | ProviderOutputInvalid) and error.code == code
    assert progress.run_id is not None and progress.cancel_sent
    assert stub.cancelled_runs == [progress.run_id]


def test_a_run_known_to_be_over_is_not_cancelled(stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.STATUS_FAILED)
    error, progress, _ = _fails(_client(stub))
    assert error.code == "run_status_failed" and progress.run_over
    assert stub.stats()["cancels"] == stub.stats()["session_cancels"] == 0
