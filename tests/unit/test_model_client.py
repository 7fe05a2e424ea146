"""ModelClient against real HTTP on loopback: the scripted model server and tiny canned servers."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from doubles.scripted_model import ScriptedModelServer
from harness.errors import ModelUnavailable
from harness.model import ERROR_SUMMARY_CHARS, ModelClient, ModelReply, ToolCall

PROMPT_CANARY = "CANARY-PROMPT-q7w8e9r0t1y2"
USER_CANARY = "CANARY-USER-z5x6c7v8b9n0"
KEY_CANARY = "sk-CANARY-KEY-a1b2c3d4e5f6"

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": f"You are a careful agent. {PROMPT_CANARY} Follow the rules."},
    {"role": "user", "content": f"Please summarize {USER_CANARY} for me."},
]


def client(base_url: str, *, api_key: str = "", read_timeout: float = 5.0) -> ModelClient:
    return ModelClient(base_url, api_key, "scripted", connect_timeout=2.0, read_timeout=read_timeout)


def assert_nothing_leaked(exc: BaseException) -> None:
    text = f"{exc} {exc!r}"
    assert PROMPT_CANARY not in text
    assert USER_CANARY not in text
    assert KEY_CANARY not in text


class Canned:
    """A loopback server answering every POST with one fixed status and body, recording requests."""

    def __init__(self, status: int, body: str) -> None:
        self.status, self.body = status, body
        self.requests: list[tuple[dict[str, str], Any]] = []
        canned = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                canned.requests.append((dict(self.headers.items()), json.loads(raw)))
                data = canned.body.encode()
                self.send_response(canned.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> Canned:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted() -> Iterator[ScriptedModelServer]:
    rules = [
        {"when": {"user_contains": "slow"}, "reply": {"content": "late"}, "delay_seconds": 3},
        {
            "when": {"user_contains": "explode"},
            "reply": {"error": {"status": 500, "message": "upstream broke on {user}"}},
        },
        {"when": {"user_contains": "tools"}, "reply": {"tool_calls": [{"name": "echo", "arguments": {"text": "hi"}}]}},
        {"when": {"system_contains": "plain"}, "reply": {"content": "hello"}},
    ]
    with ScriptedModelServer(rules) as server:
        yield server


def test_content_reply_carries_text_and_token_usage(scripted: ScriptedModelServer) -> None:
    reply = client(scripted.base_url).complete(
        [{"role": "system", "content": "plain " * 10}, {"role": "user", "content": "hi"}]
    )
    assert reply == ModelReply(
        content="hello",
        tool_calls=(),
        prompt_tokens=62 // 4,
        completion_tokens=1,
        finish_reason="stop",
        model="scripted",  # the answer's own "model"
    )


def test_request_body_is_openai_shaped_and_omits_tools_and_key_when_absent() -> None:
    ok = json.dumps({"choices": [{"message": {"role": "assistant", "content": "x"}}]})
    tool = {"type": "function", "function": {"name": "echo", "description": "d", "parameters": {"type": "object"}}}
    with Canned(200, ok) as canned:
        client(canned.url).complete(MESSAGES)
        client(canned.url, api_key=KEY_CANARY).complete(MESSAGES, [tool])
        client(canned.url).complete(MESSAGES, [])
    (h1, b1), (h2, b2), (_h3, b3) = canned.requests
    assert b1 == {"model": "scripted", "messages": MESSAGES}
    assert "Authorization" not in h1
    assert b2["tools"] == [tool]
    assert h2["Authorization"] == f"Bearer {KEY_CANARY}"
    assert "tools" not in b3


def test_tool_calls_come_back_with_unique_ids_and_json_text_arguments(scripted: ScriptedModelServer) -> None:
    c = client(scripted.base_url)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "use tools"}]
    first, second = c.complete(messages), c.complete(messages)
    assert first.content is None
    (call_a,), (call_b,) = first.tool_calls, second.tool_calls
    assert call_a.name == "echo"
    assert json.loads(call_a.arguments) == {"text": "hi"}
    assert isinstance(call_a.arguments, str)
    assert call_a.id.startswith("call_") and len(call_a.id) == len("call_") + 24
    assert call_a.id != call_b.id
    assert first.completion_tokens >= 1


def test_tool_call_to_openai_has_the_assistant_message_shape() -> None:
    call = ToolCall(id="call_1", name="echo", arguments='{"a": 1}')
    assert call.to_openai() == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "echo", "arguments": '{"a": 1}'},
    }


def test_connection_refused_is_unavailable_with_code_connect() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # NOTE: nothing listens on the port once the socket is closed; connect is refused.
    with pytest.raises(ModelUnavailable) as info:
        client(f"http://127.0.0.1:{port}/v1", api_key=KEY_CANARY).complete(MESSAGES)
    assert info.value.code == "connect"
    assert "refused" in str(info.value).lower()
    assert_nothing_leaked(info.value)


def test_a_reply_slower_than_the_deadline_is_code_timeout(scripted: ScriptedModelServer) -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "be slow"}]
    with pytest.raises(ModelUnavailable) as info:
        client(scripted.base_url, read_timeout=30).complete(messages, timeout=0.3)
    assert info.value.code == "timeout"


def test_a_deadline_already_passed_fails_without_a_request(scripted: ScriptedModelServer) -> None:
    with pytest.raises(ModelUnavailable) as info:
        client(scripted.base_url).complete([{"role": "system", "content": "plain"}], timeout=0)
    assert info.value.code == "timeout"
    assert scripted.journal() == []


def test_http_500_is_summarized_without_echoing_the_prompt(scripted: ScriptedModelServer) -> None:
    messages = [MESSAGES[0], {"role": "user", "content": f"explode {USER_CANARY} now"}]
    with pytest.raises(ModelUnavailable) as info:
        client(scripted.base_url, api_key=KEY_CANARY).complete(messages)
    assert info.value.code == "http_5xx"
    assert "HTTP 500" in str(info.value)
    assert "upstream broke on" in str(info.value)  # the error's own words survive
    assert_nothing_leaked(info.value)


def test_no_match_400_is_summarized_without_echoing_the_system_prompt(scripted: ScriptedModelServer) -> None:
    with pytest.raises(ModelUnavailable) as info:
        client(scripted.base_url).complete(MESSAGES)
    assert info.value.code == "http_4xx"
    assert "HTTP 400" in str(info.value)
    assert "no script rule matched" in str(info.value)
    assert_nothing_leaked(info.value)


def test_an_error_body_echoing_the_api_key_is_redacted_and_cut_short() -> None:
    body = json.dumps({"error": {"message": f"Incorrect API key provided: {KEY_CANARY}. " + "x" * 1000}})
    with Canned(401, body) as canned, pytest.raises(ModelUnavailable) as info:
        client(canned.url, api_key=KEY_CANARY).complete(MESSAGES)
    assert info.value.code == "http_4xx"
    assert "Incorrect API key provided" in str(info.value)
    assert_nothing_leaked(info.value)
    assert len(str(info.value)) < ERROR_SUMMARY_CHARS + 100


def test_a_plain_text_error_body_echoing_short_user_text_is_redacted() -> None:
    messages = [{"role": "user", "content": "tiny secret"}]
    with Canned(502, "<html>bad gateway for tiny secret</html>") as canned, pytest.raises(ModelUnavailable) as info:
        client(canned.url).complete(messages)
    assert info.value.code == "http_5xx"
    assert "bad gateway" in str(info.value)
    assert "tiny secret" not in str(info.value)


def test_wrong_api_key_is_a_4xx_that_never_shows_the_key() -> None:
    with ScriptedModelServer([{"reply": {"content": "ok"}}], api_key="expected-key") as server:
        with pytest.raises(ModelUnavailable) as info:
            client(server.base_url, api_key=KEY_CANARY).complete(MESSAGES)
        assert info.value.code == "http_4xx" and "HTTP 401" in str(info.value)
        assert_nothing_leaked(info.value)
        assert client(server.base_url, api_key="expected-key").complete(MESSAGES).content == "ok"


@pytest.mark.parametrize(
    ("body", "what"),
    [
        ("not json at all", "not JSON"),
        (json.dumps({"choices": []}), "no choices"),
        (json.dumps({"object": "chat.completion"}), "no choices"),
        (json.dumps({"choices": [{"message": {"tool_calls": [{"id": "c", "function": {}}]}}]}), "malformed tool call"),
    ],
)
def test_a_200_that_is_not_a_chat_completion_is_bad_response(body: str, what: str) -> None:
    with Canned(200, body) as canned, pytest.raises(ModelUnavailable) as info:
        client(canned.url).complete(MESSAGES)
    assert info.value.code == "bad_response"
    assert what in str(info.value)


def test_missing_usage_reads_as_zero_tokens() -> None:
    body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "x"}}]})
    with Canned(200, body) as canned:
        reply = client(canned.url).complete(MESSAGES)
    assert (reply.prompt_tokens, reply.completion_tokens) == (0, 0)


def test_from_settings_reads_the_model_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from settings import get_settings

    monkeypatch.setenv("MODEL_BASE_URL", "http://127.0.0.1:9/v1/")
    monkeypatch.setenv("MODEL_API_KEY", KEY_CANARY)
    monkeypatch.setenv("MODEL_NAME", "gpt-test")
    monkeypatch.setenv("MODEL_CONNECT_TIMEOUT_SECONDS", "1.5")
    monkeypatch.setenv("MODEL_READ_TIMEOUT_SECONDS", "7")
    get_settings.cache_clear()
    try:
        c = ModelClient.from_settings()
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
    assert (c.base_url, c.model, c.connect_timeout, c.read_timeout) == ("http://127.0.0.1:9/v1", "gpt-test", 1.5, 7.0)
    assert KEY_CANARY not in repr(c)


def test_a_proxy_from_the_environment_is_read_once_when_the_client_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP_PROXY at start still routes the model calls (a provider behind a proxy), but the
    environment is not scanned at every request: a later change does not matter."""
    ok = json.dumps({"choices": [{"message": {"role": "assistant", "content": "via proxy"}}]})
    with Canned(200, ok) as proxy:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.httpd.server_address[1]}")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        model = client("http://model.example.invalid/v1")
        monkeypatch.delenv("HTTP_PROXY")
        assert model.complete(MESSAGES).content == "via proxy"
        headers, body = proxy.requests[0]
        assert headers["Host"] == "model.example.invalid" and body["model"] == "scripted"


def test_one_client_keeps_a_connection_per_loop_of_a_threads_pool() -> None:
    # One ModelClient serves every loop of a process (tasks.agent). On a threads pool, 16 loops
    # call at once: each must find its kept-alive connection again on the next call, instead
    # of urllib3 discarding all but its default 10 and connecting anew.
    import time

    from models.db import size_for_loops

    body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})
    peers: set[int] = set()
    lock = threading.Lock()

    class KeepAlive(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with lock:
                peers.add(self.client_address[1])
            time.sleep(0.3)  # every loop's call is in flight at once
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), KeepAlive)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    loops = 16
    try:
        size_for_loops(loops)
        shared = client(f"http://127.0.0.1:{httpd.server_address[1]}/v1")
        for _ in range(2):
            wave = [threading.Thread(target=shared.complete, args=(MESSAGES,)) for _ in range(loops)]
            for t in wave:
                t.start()
            for t in wave:
                t.join(timeout=30)
        assert len(peers) == loops, f"{len(peers)} connections for {loops} loops calling twice"
    finally:
        size_for_loops(1)
        httpd.shutdown()
        httpd.server_close()
