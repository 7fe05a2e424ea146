"""The model client against odd provider answers (docs/providers.md): an error object in a
200 classified by its ``error.code`` as the HTTP status would be; a read timeout retried a
bounded number of times, then a failure with its reason, not an outage; ``retry-after-ms``,
``Retry-After`` as an HTTP date, ``Retry-After: 0`` (not "no pause") and a long Retry-After
carried to the outage back-off. Real HTTP on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from harness.errors import ModelUnavailable
from harness.model import ModelClient
from tests.unit.test_model_provider import OK, Sequenced, error_body

MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[Any] = []

    def make(*answers: tuple[int, dict[str, str], str]) -> Sequenced:
        server = Sequenced(*answers)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


def client(url: str, retries: int = 3, *, read_timeout: float = 5.0, base: float = 0.01) -> ModelClient:
    return ModelClient(
        url, "", "m", 2.0, read_timeout, max_retries=retries, retry_max_seconds=30, retry_base_seconds=base
    )


# --- an error object in a 200 ---


@pytest.mark.parametrize("code", [400, "400", "context_length_exceeded"])
def test_an_error_object_in_a_200_with_an_upstream_4xx_fails_at_once_as_the_4xx_would(
    serve: Any, code: int | str
) -> None:
    server = serve((200, {}, error_body("This model's maximum context length is 8192 tokens", code)), (200, {}, OK))
    with pytest.raises(ModelUnavailable) as info:
        client(server.url).complete(MESSAGES)
    assert len(server.bodies) == 1  # not retried
    assert info.value.code == "http_4xx" and not info.value.transient
    assert info.value.reason == "context_too_long"


@pytest.mark.parametrize(("code", "reason"), [(401, "auth"), (404, "model_not_found"), (403, "auth")])
def test_an_error_object_in_a_200_says_why_by_its_code(serve: Any, code: int, reason: str) -> None:
    server = serve((200, {}, error_body("no", code)))
    with pytest.raises(ModelUnavailable) as info:
        client(server.url).complete(MESSAGES)
    assert len(server.bodies) == 1 and info.value.reason == reason and not info.value.transient


def test_an_error_object_in_a_200_with_an_upstream_429_is_retried(serve: Any) -> None:
    server = serve((200, {}, error_body("rate limited upstream", 429)), (200, {}, OK))
    assert client(server.url).complete(MESSAGES).content == "fine"
    assert len(server.bodies) == 2


# --- statuses say why ---


@pytest.mark.parametrize(
    ("status", "body", "reason"),
    [
        (401, error_body("Incorrect API key", "invalid_api_key"), "auth"),
        (404, error_body("The model `gpt-9` does not exist", "model_not_found"), "model_not_found"),
        (413, "Request Entity Too Large", "context_too_long"),
        (400, error_body("maximum context length exceeded", "context_length_exceeded"), "context_too_long"),
        (400, error_body("Invalid value for temperature", "invalid_value"), "provider_rejected"),
    ],
)
def test_a_refusal_of_the_request_names_its_reason(serve: Any, status: int, body: str, reason: str) -> None:
    server = serve((status, {}, body))
    with pytest.raises(ModelUnavailable) as info:
        client(server.url).complete(MESSAGES)
    assert info.value.reason == reason and not info.value.transient


# --- read timeouts ---


class Slow:
    """A loopback server that answers OK after ``delays[n]`` seconds for its n-th request (the
    last delay for ever after)."""

    def __init__(self, *delays: float) -> None:
        self.delays = list(delays)
        self.count = 0
        self.stopping = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                n = min(owner.count, len(owner.delays) - 1)
                owner.count += 1
                if owner.stopping.wait(owner.delays[n]):
                    return
                data = OK.encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def slow() -> Iterator[Any]:
    servers: list[Slow] = []

    def make(*delays: float) -> Slow:
        server = Slow(*delays)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


def test_a_read_timeout_is_retried_then_answers(slow: Any) -> None:
    server = slow(2.0, 0.0)
    c = client(server.url, read_timeout=0.3)
    c.read_timeout_retries = 1
    assert c.complete(MESSAGES).content == "fine"
    assert server.count == 2


def test_a_read_timeout_every_time_is_retried_a_bounded_number_of_times_then_fails_with_its_reason(slow: Any) -> None:
    server = slow(2.0)
    c = client(server.url, retries=4, read_timeout=0.2)
    c.read_timeout_retries = 2
    started = time.monotonic()
    with pytest.raises(ModelUnavailable) as info:
        c.complete(MESSAGES)
    assert server.count == 3  # the first attempt and 2 retries, not MODEL_MAX_RETRIES
    assert time.monotonic() - started < 2.0
    assert info.value.code == "timeout" and info.value.reason == "read_timeout"
    assert not info.value.transient  # not an outage: it fails instead of waiting for an hour


def test_settings_bound_the_read_timeout_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    from settings import get_settings

    monkeypatch.setenv("MODEL_READ_TIMEOUT_RETRIES", "1")
    get_settings.cache_clear()
    try:
        assert ModelClient.from_settings().read_timeout_retries == 1
    finally:
        get_settings.cache_clear()


# --- Retry-After ---


def test_retry_after_ms_is_honoured(serve: Any) -> None:
    server = serve((429, {"retry-after-ms": "400"}, error_body("slow down")), (200, {}, OK))
    started = time.monotonic()
    assert client(server.url).complete(MESSAGES).content == "fine"
    assert 0.4 <= time.monotonic() - started < 2.0


def test_retry_after_as_an_http_date_is_honoured(serve: Any) -> None:
    server = serve((503, {"Retry-After": formatdate(time.time() + 2, usegmt=True)}, error_body("down")), (200, {}, OK))
    started = time.monotonic()
    assert client(server.url).complete(MESSAGES).content == "fine"
    assert 0.9 <= time.monotonic() - started < 4.0


def test_retry_after_zero_is_not_no_pause(serve: Any) -> None:
    server = serve(*[(429, {"Retry-After": "0"}, error_body("slow down"))] * 3, (200, {}, OK))
    started = time.monotonic()
    assert client(server.url, base=0.2).complete(MESSAGES).content == "fine"
    # three backoffs of 0.2, 0.4 and 0.8 s with equal jitter: at least half of each
    assert time.monotonic() - started >= 0.7


def test_a_retry_after_longer_than_the_retry_window_is_carried_to_the_outage_back_off(serve: Any) -> None:
    server = serve((429, {"Retry-After": "600"}, error_body("come back in ten minutes")))
    started = time.monotonic()
    with pytest.raises(ModelUnavailable) as info:
        client(server.url).complete(MESSAGES)
    assert time.monotonic() - started < 1.0 and len(server.bodies) == 1
    assert info.value.transient and info.value.retry_after_seconds == pytest.approx(600)
