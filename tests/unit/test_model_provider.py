"""The model client against what real OpenAI-compatible providers send: the statuses and the
``x-should-retry`` header the official openai client retries on, a 200 whose body is an error
object (OpenRouter), answers cut off, filtered or refused, provider fields on a tool call
(Gemini's thought signature), and ``max_completion_tokens``. Real HTTP on loopback."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from harness.agents import parse_agents
from harness.errors import ModelUnavailable
from harness.model import ModelClient, ModelOptions

MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
OK = json.dumps({"choices": [{"message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}]})


class Sequenced:
    """A loopback server answering POSTs with the given (status, headers, body) in turn, the
    last one for ever after; it records each request body."""

    def __init__(self, *answers: tuple[int, dict[str, str], str]) -> None:
        self.answers = list(answers)
        self.bodies: list[Any] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                owner.bodies.append(json.loads(raw))
                n = min(len(owner.bodies), len(owner.answers)) - 1
                status, headers, body = owner.answers[n]
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[Sequenced] = []

    def make(*answers: tuple[int, dict[str, str], str]) -> Sequenced:
        server = Sequenced(*answers)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


def client(url: str, retries: int = 3) -> ModelClient:
    return ModelClient(url, "", "m", 2.0, 5.0, max_retries=retries, retry_max_seconds=30, retry_base_seconds=0.01)


def error_body(message: str, code: int | str = 502) -> str:
    return json.dumps({"error": {"message": message, "code": code}})


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504, 529])
def test_the_statuses_the_official_client_retries_are_retried(serve: Any, status: int) -> None:
    server = serve((status, {}, error_body("busy")), (200, {}, OK))
    assert client(server.url).complete(MESSAGES).content == "fine"
    assert len(server.bodies) == 2


def test_x_should_retry_true_retries_a_status_that_is_not_retried_otherwise(serve: Any) -> None:
    server = serve((400, {"x-should-retry": "true"}, error_body("try again")), (200, {}, OK))
    assert client(server.url).complete(MESSAGES).content == "fine"
    assert len(server.bodies) == 2


def test_x_should_retry_false_is_never_retried_even_on_a_5xx(serve: Any) -> None:
    server = serve((503, {"x-should-retry": "false"}, error_body("do not retry")), (200, {}, OK))
    with pytest.raises(ModelUnavailable) as info:
        client(server.url).complete(MESSAGES)
    assert info.value.code == "http_5xx" and len(server.bodies) == 1


def test_a_200_whose_body_is_an_error_object_is_retried_and_is_an_outage_when_it_persists(serve: Any) -> None:
    # No status in ``error.code`` (one there is handled as that status: test_model_timeouts_and_errors.py).
    no_status = json.dumps({"error": {"message": "Upstream provider returned 502"}})
    server = serve((200, {}, no_status), (200, {}, OK))
    assert client(server.url).complete(MESSAGES).content == "fine"
    assert len(server.bodies) == 2
    down = serve((200, {}, no_status))
    with pytest.raises(ModelUnavailable) as info:
        client(down.url, retries=2).complete(MESSAGES)
    assert info.value.code == "provider_error" and info.value.transient
    assert "Upstream provider returned 502" in str(info.value) and len(down.bodies) == 3


@pytest.mark.parametrize(("status", "outage"), [(503, True), (502, True), (429, True), (500, False), (401, False)])
def test_an_outage_is_transient_and_an_answer_about_the_request_is_not(serve: Any, status: int, outage: bool) -> None:
    server = serve((status, {}, error_body("no")))
    with pytest.raises(ModelUnavailable) as info:
        client(server.url, retries=1).complete(MESSAGES)
    assert info.value.transient is outage


@pytest.mark.parametrize(
    ("choice", "incomplete"),
    [
        ({"message": {"content": "half an ans"}, "finish_reason": "length"}, "length"),
        ({"message": {"content": ""}, "finish_reason": "content_filter"}, "content_filter"),
        ({"message": {"content": None, "refusal": "I can't help with that."}, "finish_reason": "stop"}, "refusal"),
        ({"message": {"content": "whole"}, "finish_reason": "stop"}, None),
    ],
)
def test_an_answer_cut_off_filtered_or_refused_says_so(serve: Any, choice: dict[str, Any], incomplete: str) -> None:
    server = serve((200, {}, json.dumps({"choices": [choice]})))
    reply = client(server.url).complete(MESSAGES)
    assert reply.incomplete == incomplete


def test_provider_fields_of_a_tool_call_are_kept_and_sent_back_unchanged(serve: Any) -> None:
    signature = {"google": {"thought_signature": "CiQBcsjafAbc/+=="}}
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "echo", "arguments": '{"text": "x"}'},
        "extra_content": signature,
    }
    body = {"choices": [{"message": {"content": None, "tool_calls": [call]}, "finish_reason": "tool_calls"}]}
    server = serve((200, {}, json.dumps(body)))
    reply = client(server.url).complete(MESSAGES)
    (parsed,) = reply.tool_calls
    assert parsed.to_openai() == call
    assert type(parsed).from_openai(json.loads(json.dumps(parsed.to_openai()))) == parsed


def test_max_completion_tokens_of_an_agent_is_sent_by_its_name(serve: Any) -> None:
    agents = parse_agents('[agents.o]\nsystem_prompt = "p"\nmax_completion_tokens = 4096\n')
    options = agents["o"].model_options
    assert options == ModelOptions(max_completion_tokens=4096)
    server = serve((200, {}, OK))
    client(server.url).complete(MESSAGES, options=options)
    assert server.bodies[0]["max_completion_tokens"] == 4096 and "max_tokens" not in server.bodies[0]
