"""The model client retries like a real provider's client, against the scripted
model server on loopback answering 429 with Retry-After, 503 and dropped connections."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

from doubles.scripted_model import ScriptedModelServer
from harness.errors import ModelUnavailable
from harness.model import ModelClient, ModelOptions

PROMPT_CANARY = "CANARY-PROMPT-r3t4y5u6"
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful agent."},
    {"role": "user", "content": f"Summarize {PROMPT_CANARY}."},
]


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[ScriptedModelServer] = []

    def make(*failures: dict[str, Any], reply: dict[str, Any] | None = None) -> ScriptedModelServer:
        rule: dict[str, Any] = {"reply": reply or {"content": "fine"}}
        if failures:
            rule["fail_first"] = list(failures)
        server = ScriptedModelServer([rule])
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


def client(url: str, *, retries: int = 4, budget: float = 30.0) -> ModelClient:
    return ModelClient(
        url, "", "scripted", 2.0, 5.0, max_retries=retries, retry_max_seconds=budget, retry_base_seconds=0.05
    )


def test_429_with_retry_after_then_503_then_an_answer_is_one_reply_after_honouring_retry_after(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = serve({"status": 429, "retry_after": 1}, {"status": 503}, {"status": 503})
    caplog.set_level(logging.INFO, logger="harness.model")
    started = time.monotonic()
    reply = client(server.base_url).complete(MESSAGES)
    took = time.monotonic() - started
    assert reply.content == "fine"
    assert [e["reply"] for e in server.journal()] == ["error", "error", "error", "content"]
    assert 1.0 <= took < 5.0  # the Retry-After second was waited; backoffs are short
    retries = [r.getMessage() for r in caplog.records if "event=model_retry" in r.getMessage()]
    assert len(retries) == 3
    assert retries[0] == "event=model_retry attempt=1 status=429 error_code=http_4xx wait_ms=1000"
    assert retries[1].startswith("event=model_retry attempt=2 status=503 error_code=http_5xx wait_ms=")
    assert all(PROMPT_CANARY not in line and "fine" not in line for line in retries)


def test_a_dropped_connection_is_retried(serve: Any) -> None:
    server = serve({"drop_connection": True}, {"drop_connection": True})
    assert client(server.base_url).complete(MESSAGES).content == "fine"
    assert [e["reply"] for e in server.journal()] == ["error", "error", "content"]


def test_an_endpoint_nobody_listens_on_is_retried_then_fails_as_connect() -> None:
    from tests.services import free_port

    started = time.monotonic()
    with pytest.raises(ModelUnavailable) as info:
        client(f"http://127.0.0.1:{free_port()}/v1", retries=2).complete(MESSAGES)
    assert info.value.code == "connect" and time.monotonic() - started < 3


@pytest.mark.parametrize("status", [400, 401, 404, 422])
def test_other_4xx_fail_at_once_without_a_retry(serve: Any, status: int) -> None:
    server = serve({"status": status}, {"status": status})
    with pytest.raises(ModelUnavailable) as info:
        client(server.base_url).complete(MESSAGES)
    assert info.value.code == "http_4xx" and f"HTTP {status}" in str(info.value)
    assert len(server.journal()) == 1


def test_retries_stop_at_max_retries_with_the_last_error(serve: Any) -> None:
    server = serve(*[{"status": 503}] * 5)
    with pytest.raises(ModelUnavailable) as info:
        client(server.base_url, retries=2).complete(MESSAGES)
    assert info.value.code == "http_5xx" and len(server.journal()) == 3


def test_no_retry_waits_past_the_deadline_given(serve: Any) -> None:
    server = serve({"status": 429, "retry_after": 3})
    started = time.monotonic()
    with pytest.raises(ModelUnavailable) as info:
        client(server.base_url).complete(MESSAGES, timeout=1.0)
    assert time.monotonic() - started < 1.0  # gave up at once: the wait would end after the deadline
    assert info.value.code == "http_4xx" and len(server.journal()) == 1


def test_no_retry_waits_past_model_retry_max_seconds(serve: Any) -> None:
    server = serve({"status": 429, "retry_after": 2}, {"status": 429, "retry_after": 2})
    started = time.monotonic()
    with pytest.raises(ModelUnavailable):
        client(server.base_url, budget=3.0).complete(MESSAGES)
    assert 2.0 <= time.monotonic() - started < 3.0 and len(server.journal()) == 2


def test_a_client_without_retries_fails_at_the_first_503(serve: Any) -> None:
    server = serve({"status": 503})
    with pytest.raises(ModelUnavailable):
        client(server.base_url, retries=0).complete(MESSAGES)
    assert len(server.journal()) == 1


def test_settings_configure_the_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    from settings import get_settings

    monkeypatch.setenv("MODEL_MAX_RETRIES", "7")
    monkeypatch.setenv("MODEL_RETRY_MAX_SECONDS", "12.5")
    get_settings.cache_clear()
    try:
        made = ModelClient.from_settings()
    finally:
        get_settings.cache_clear()
    assert (made.max_retries, made.retry_max_seconds) == (7, 12.5)


def test_model_options_are_sent_as_the_chat_completions_api_names_them(serve: Any) -> None:
    server = serve()
    c = client(server.base_url)
    c.complete(MESSAGES, options=ModelOptions(model="acme-large", temperature=0.3, max_tokens=64))
    c.complete(MESSAGES)
    assert server.received() == [
        {"model": "acme-large", "temperature": 0.3, "max_tokens": 64, "tools": []},
        {"model": "scripted", "temperature": None, "max_tokens": None, "tools": []},
    ]
