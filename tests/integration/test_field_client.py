"""SuperAgent Open API client against the stand-in over real loopback HTTP (docs/field-recovery.md).

No database here: these tests exercise transport, SSE, deadline and cancel. The stand-in is a
real threaded HTTP server; nothing is mocked.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import requests

from doubles.superagent import Behaviour, SuperAgentStub
from fieldrecovery.answer import parse_patch_set
from fieldrecovery.client import CallProgress, OpenApiClient, ProviderAnswer
from fieldrecovery.deadline import Deadline, Watchdog
from fieldrecovery.errors import (
    DeadlineExceeded,
    FieldRecoveryError,
    ProviderOutputInvalid,
    ProviderRejected,
    ProviderUnavailable,
)
from settings import OpenApiSettings
from tests.field_helpers import SampleCall, call_provider, open_api_client

KEY = "df_open_client_test"
SAMPLE = SampleCall()
FACTS, REQUEST, MESSAGE, SUBJECT = SAMPLE.facts, SAMPLE.request, SAMPLE.message, SAMPLE.subject


@pytest.fixture
def stub() -> Iterator[SuperAgentStub]:
    with SuperAgentStub(api_key=KEY) as server:
        yield server


def _client(stub: SuperAgentStub, max_response_chars: int = 200_000, **open_api: object) -> OpenApiClient:
    return open_api_client(stub.base_url, KEY, max_response_chars, **open_api)  # type: ignore[no-any-return]


def _call(
    client: OpenApiClient, seconds: float = 5.0, progress: CallProgress | None = None
) -> tuple[ProviderAnswer, CallProgress]:
    return call_provider(client, SAMPLE, seconds, progress)


def _fails(client: OpenApiClient, seconds: float = 5.0) -> tuple[FieldRecoveryError, CallProgress]:
    progress = CallProgress()
    with pytest.raises(FieldRecoveryError) as exc:
        _call(client, seconds, progress)
    return exc.value, progress


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "close-delimited"])
def test_success_returns_the_complete_final_answer_and_run_metadata(stub: SuperAgentStub, chunked: bool) -> None:
    stub.configure(chunked=chunked)
    answer, progress = _call(_client(stub))
    patch_set = parse_patch_set(answer.content, max_chars=200_000)
    assert patch_set.idempotency_key == REQUEST.idempotency_key
    assert {p.field: p.value for p in patch_set.patches}["room_type"] == "Deluxe King"
    assert (answer.resolved_profile_id, answer.resolved_profile_version) == ("prof_fixed_channel_recovery", "7")
    assert answer.model == "superagent-stub-1"
    assert (answer.prompt_tokens, answer.completion_tokens, answer.total_tokens) == (812, 164, 976)
    assert progress.run_id == answer.run_id and progress.session_id == answer.session_id
    stats = stub.stats()
    assert (stats["sessions"], stats["streams"], stats["run_status"], stats["events_replays"]) == (1, 1, 1, 0)


def test_every_request_carries_the_bearer_key_and_a_fresh_double_submit_token(stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.CUT_REPLAYABLE)  # four requests: session, stream, events, run
    _call(_client(stub))
    stats = stub.stats()
    assert stats["sessions"] + stats["streams"] + stats["events_replays"] + stats["run_status"] == 4
    assert stats["rejected_auth"] == stats["rejected_csrf"] == 0
    assert stats["csrf_reused"] == 0  # a new random token for every request
    assert stub.bearer_tokens_seen == {KEY}


def test_stand_in_refuses_a_csrf_mismatch_a_missing_cookie_and_a_wrong_key(stub: SuperAgentStub) -> None:
    url = stub.base_url + "/open/v1/sessions"
    body = {"external_subject_id": SUBJECT}
    auth = {"Authorization": f"Bearer {KEY}"}
    mismatch = requests.post(
        url, json=body, headers=auth | {"X-CSRF-Token": "a" * 32}, cookies={"csrf_token": "b" * 32}, timeout=5
    )
    no_cookie = requests.post(url, json=body, headers=auth | {"X-CSRF-Token": "a" * 32}, timeout=5)
    wrong_key = requests.post(
        url,
        json=body,
        headers={"Authorization": "Bearer df_open_other", "X-CSRF-Token": "c" * 32},
        cookies={"csrf_token": "c" * 32},
        timeout=5,
    )
    good = requests.post(
        url, json=body, headers=auth | {"X-CSRF-Token": "d" * 32}, cookies={"csrf_token": "d" * 32}, timeout=5
    )
    assert (mismatch.status_code, no_cookie.status_code, wrong_key.status_code) == (403, 403, 401)
    assert good.status_code == 200 and good.json()["session_id"]
    assert stub.stats()["rejected_csrf"] == 2 and stub.stats()["rejected_auth"] == 1


def test_include_trace_is_never_sent_unless_configured(stub: SuperAgentStub) -> None:
    _call(_client(stub))
    assert stub.stats()["include_trace_requests"] == 0
    error, _ = _fails(_client(stub, include_trace=True))
    assert isinstance(error, ProviderRejected) and error.code == "open_agent_trace_disabled"
    assert stub.stats()["include_trace_requests"] == 1


@pytest.mark.parametrize(
    ("behaviour", "kind", "code"),
    [
        (Behaviour.UNAUTHORIZED, ProviderRejected, "http_401"),
        (Behaviour.SERVER_ERROR, ProviderUnavailable, "http_500"),
        (Behaviour.TRACE_REFUSED, ProviderRejected, "open_agent_trace_disabled"),
        (Behaviour.RUN_FAILED, ProviderUnavailable, "run_failed"),
        (Behaviour.STATUS_FAILED, ProviderUnavailable, "run_status_failed"),
    ],
)
def test_provider_failures_fail_with_a_safe_code(
    stub: SuperAgentStub, behaviour: Behaviour, kind: type[FieldRecoveryError], code: str
) -> None:
    stub.configure(behaviour=behaviour)
    error, _ = _fails(_client(stub))
    assert isinstance(error, kind)
    assert error.code == code


def test_run_status_is_the_authority_even_after_a_clean_stream(stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.STATUS_FAILED)
    error, progress = _fails(_client(stub))
    assert error.code == "run_status_failed"
    assert stub.stats()["run_status"] == 1 and progress.run_id is not None


def test_unreachable_provider_is_a_connect_failure() -> None:
    client = OpenApiClient(OpenApiSettings(base_url="http://127.0.0.1:9", api_key=KEY), max_response_chars=1000)
    progress = CallProgress()
    with pytest.raises(ProviderUnavailable) as exc:
        client.recover(MESSAGE, idempotency_key="k", subject_id=SUBJECT, deadline=Deadline(2), progress=progress)
    assert exc.value.code == "connect"


@pytest.mark.parametrize(
    ("chunked", "mid_event"),
    [(True, False), (True, True), (False, True)],
    ids=["chunked-between-events", "chunked-mid-event", "close-delimited-mid-event"],
)
def test_broken_stream_is_recovered_from_the_events_endpoint(
    stub: SuperAgentStub, chunked: bool, mid_event: bool
) -> None:
    stub.configure(behaviour=Behaviour.CUT_REPLAYABLE, chunked=chunked, cut_mid_event=mid_event, cut_after=3)
    answer, progress = _call(_client(stub))
    # The replayed final answer is the whole one, not the half event written before the cut.
    patch_set = parse_patch_set(answer.content, max_chars=200_000)
    assert len(patch_set.patches) == 3
    assert progress.sse_recoveries == 1
    assert stub.stats()["events_replays"] == 1 and stub.stats()["streams"] == 1


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "close-delimited"])
def test_unrecoverable_stream_fails_after_the_configured_attempts_and_uses_no_partial_answer(
    stub: SuperAgentStub, chunked: bool
) -> None:
    # The cut falls inside message.final: a partial final event must never become the answer.
    stub.configure(behaviour=Behaviour.CUT_UNRECOVERABLE, chunked=chunked, cut_after=3, cut_mid_event=True)
    error, progress = _fails(_client(stub, sse_recovery_max_attempts=2))
    assert isinstance(error, ProviderUnavailable) and error.code == "sse_recovery_exhausted"
    assert progress.sse_recoveries == 2 and stub.stats()["events_replays"] == 2


def test_zero_recovery_attempts_fails_at_the_first_cut(stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.CUT_REPLAYABLE)
    error, _ = _fails(_client(stub, sse_recovery_max_attempts=0))
    assert error.code == "sse_recovery_exhausted"
    assert stub.stats()["events_replays"] == 0


@pytest.mark.parametrize(
    ("drip", "chunked"), [(False, True), (True, True), (True, False)], ids=["silent", "drip", "drip-close"]
)
def test_deadline_cuts_a_stalled_stream_then_cancels_the_run(stub: SuperAgentStub, drip: bool, chunked: bool) -> None:
    stub.configure(behaviour=Behaviour.SLOW, stall_seconds=20, drip=drip, chunked=chunked)
    started = time.monotonic()
    error, progress = _fails(_client(stub), seconds=1.0)
    elapsed = time.monotonic() - started
    assert isinstance(error, DeadlineExceeded) and error.code == "deadline_exceeded"
    assert 0.9 <= elapsed < 2.5  # the deadline, plus the bounded cancel
    assert progress.run_id is not None and progress.cancel_sent
    assert stub.cancelled_runs == [progress.run_id]
    assert stub.run_status(progress.run_id) == "cancelled"
    assert stub.stats()["run_status"] == 0  # a partial answer is never confirmed or used


def test_watchdog_wakes_a_read_blocked_beyond_the_deadline(stub: SuperAgentStub) -> None:
    # A read with a 30 s socket timeout blocked on a silent stream: only the watchdog ends it.
    stub.configure(behaviour=Behaviour.SLOW, stall_seconds=20)
    token = "t" * 32
    headers = {"Authorization": f"Bearer {KEY}", "X-CSRF-Token": token}
    session = requests.post(
        stub.base_url + "/open/v1/sessions",
        json={"external_subject_id": SUBJECT},
        headers=headers,
        cookies={"csrf_token": token},
        timeout=5,
    ).json()["session_id"]
    token2 = "u" * 32
    response = requests.post(
        f"{stub.base_url}/open/v1/sessions/{session}/messages/stream",
        json={"content": MESSAGE, "idempotency_key": "k"},
        headers=headers | {"X-CSRF-Token": token2},
        cookies={"csrf_token": token2},
        stream=True,
        timeout=(5, 30),
    )
    first = response.raw.read1(8192)
    assert b"run.started" in first
    started = time.monotonic()
    with Watchdog(Deadline(0.5)) as watchdog:
        watchdog.watch(response)
        try:
            while response.raw.read1(8192):
                pass
        except Exception:
            pass
    assert watchdog.fired.is_set()
    assert time.monotonic() - started < 2.0


def test_deadline_already_spent_makes_no_request(stub: SuperAgentStub) -> None:
    error, _ = _fails(_client(stub), seconds=0.0)
    assert isinstance(error, DeadlineExceeded)
    assert stub.stats()["sessions"] == 0


def test_stream_beyond_the_response_budget_is_refused(stub: SuperAgentStub) -> None:
    stub.configure(behaviour=Behaviour.OVERSIZE, oversize_chars=200_000)
    error, _ = _fails(_client(stub, max_response_chars=1000))
    assert isinstance(error, ProviderOutputInvalid) and error.code == "response_too_large"


def test_stats_endpoint_is_json_counts(stub: SuperAgentStub) -> None:
    _call(_client(stub))
    stats = requests.get(stub.base_url + "/_stats", timeout=5).json()
    for name in ("sessions", "streams", "run_status", "cancels", "events_replays"):
        assert isinstance(stats[name], int), name
    assert stats["streams"] == 1 and stats["cancels"] == 0
    assert json.loads(json.dumps(stats)) == stub.stats()
