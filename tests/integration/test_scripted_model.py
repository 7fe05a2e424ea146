"""The scripted model server over real HTTP on loopback: matching, templating, journal, concurrency,
and the command-line form as a subprocess. No database needed."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from doubles.scripted_model import ScriptedModelServer, ScriptError, load_script
from harness.errors import ModelUnavailable
from harness.model import ModelClient

ROOT = Path(__file__).resolve().parents[2]


def chat(base_url: str, messages: list[dict[str, Any]], **headers: str) -> requests.Response:
    return requests.post(
        f"{base_url}/chat/completions", json={"model": "m", "messages": messages}, headers=headers, timeout=5
    )


def content_of(response: requests.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def sys_user(system: str, user: str, *rest: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}, *rest]


ASSISTANT = {"role": "assistant", "content": None, "tool_calls": []}


def calling(*ids: str) -> dict[str, Any]:
    """An assistant message whose tool_calls carry ``ids``."""
    calls = [{"id": i, "type": "function", "function": {"name": "echo", "arguments": "{}"}} for i in ids]
    return {"role": "assistant", "content": None, "tool_calls": calls}


def answer(call_id: str, content: str = "r") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def test_each_when_key_selects_its_rule() -> None:
    rules = [
        {"when": {"system_contains": "reviewer"}, "reply": {"content": "by system"}},
        {"when": {"user_contains": "banana"}, "reply": {"content": "by user"}},
        {"when": {"turn": 2}, "reply": {"content": "by turn"}},
        {"when": {"last_role": "tool"}, "reply": {"content": "by last role"}},
        {"reply": {"content": "fallback"}},
    ]
    with ScriptedModelServer(rules) as server:
        url = server.base_url
        assert content_of(chat(url, sys_user("You are the reviewer.", "hi"))) == "by system"
        assert content_of(chat(url, sys_user("main", "a banana split"))) == "by user"
        # user_contains tests the FIRST user message only
        later_user = sys_user("main", "hi", ASSISTANT, {"role": "user", "content": "banana"})
        assert content_of(chat(url, later_user)) == "fallback"
        assert content_of(chat(url, sys_user("main", "hi", ASSISTANT, ASSISTANT))) == "by turn"
        assert content_of(chat(url, sys_user("main", "hi", calling("c1"), answer("c1")))) == "by last role"
        assert content_of(chat(url, sys_user("main", "hi"))) == "fallback"
        assert [e["rule"] for e in server.journal()] == [0, 1, 4, 2, 3, 4]


def test_all_conditions_of_a_rule_must_hold_and_the_first_match_wins() -> None:
    rules = [
        {"when": {"system_contains": "main", "turn": 1}, "reply": {"content": "main after one round"}},
        {"when": {"system_contains": "main"}, "reply": {"content": "main"}},
        {"when": {"system_contains": "main"}, "reply": {"content": "never"}},
    ]
    with ScriptedModelServer({"rules": rules}) as server:
        assert content_of(chat(server.base_url, sys_user("main", "x"))) == "main"
        assert content_of(chat(server.base_url, sys_user("main", "x", ASSISTANT))) == "main after one round"
        assert content_of(chat(server.base_url, sys_user("main", "x", ASSISTANT, ASSISTANT))) == "main"
        assert server.journal() == [
            {"rule": 1, "turn": 0, "reply": "content"},
            {"rule": 0, "turn": 1, "reply": "content"},
            {"rule": 1, "turn": 2, "reply": "content"},
        ]


def test_no_match_is_400_naming_the_system_prompt_head() -> None:
    system = "You are the researcher agent; " + "z" * 100
    with ScriptedModelServer([{"when": {"system_contains": "reviewer"}, "reply": {"content": "x"}}]) as server:
        response = chat(server.base_url, sys_user(system, "hi"))
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert system[:60] in message
        assert system[:61] not in message
        assert server.journal() == []


@pytest.mark.parametrize(
    ("history", "index", "fragment"),
    [
        ([calling("a"), {"role": "user", "content": "next"}], 2, "did not have response messages: a"),
        ([calling("a", "b"), answer("a")], 2, "did not have response messages: b"),
        ([calling("a")], 2, "did not have response messages: a"),
        ([answer("a")], 2, "must be a response to a preceding message with 'tool_calls'"),
        ([calling("a"), answer("b")], 3, "tool_call_id 'b' has no such call"),
        ([calling("a"), answer("a"), ASSISTANT, answer("a")], 5, "must be a response to a preceding"),
        ([calling("a"), {"role": "user", "content": "x"}, answer("a")], 2, "did not have response messages: a"),
    ],
    ids=["call-then-user", "one-of-two-answered", "call-last", "tool-first", "wrong-id", "answer-again-later", "gap"],
)
def test_an_illegal_tool_call_sequence_is_400_with_an_openai_error_body(
    history: list[dict[str, Any]], index: int, fragment: str
) -> None:
    with ScriptedModelServer([{"reply": {"content": "fine"}}]) as server:
        response = chat(server.base_url, sys_user("main", "hi", *history))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "invalid_message_sequence"
        assert error["param"] == f"messages.[{index}]"
        assert fragment in error["message"]
        assert server.journal() == []
        assert [r["index"] for r in server.rejected()] == [index]
        # the model client turns it into a ModelUnavailable naming the status, as for a real API
        with pytest.raises(ModelUnavailable) as info:
            ModelClient(server.base_url, "", "m", 2.0, 5.0).complete(sys_user("main", "hi", *history))
        assert "HTTP 400" in str(info.value)


def test_a_legal_sequence_answers_in_any_order_of_tool_messages() -> None:
    history = [
        calling("a", "b"),
        answer("b"),
        answer("a"),
        {"role": "user", "content": "more"},
        calling("c"),
        answer("c"),
    ]
    with ScriptedModelServer([{"reply": {"content": "fine"}}]) as server:
        assert content_of(chat(server.base_url, sys_user("main", "hi", *history))) == "fine"
        assert server.rejected() == []


def test_templates_fill_tool_results_after_the_last_assistant_and_the_first_user_message() -> None:
    rules = [{"reply": {"content": "for {user}: {tool_results}"}}]
    messages = sys_user(
        "main",
        "the task",
        calling("a"),
        answer("a", "old result"),
        calling("b", "c"),
        answer("b", "child one"),
        answer("c", "child two"),
    )
    with ScriptedModelServer(rules) as server:
        assert content_of(chat(server.base_url, messages)) == "for the task: child one\nchild two"


def test_tool_calls_reply_has_fresh_ids_json_arguments_and_usage() -> None:
    rules = [
        {
            "reply": {
                "tool_calls": [
                    {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "t"}},
                    {"name": "echo"},
                ]
            }
        }
    ]
    with ScriptedModelServer(rules) as server:
        bodies = [chat(server.base_url, sys_user("s" * 40, "u" * 40)).json() for _ in range(3)]
    ids = [c["id"] for b in bodies for c in b["choices"][0]["message"]["tool_calls"]]
    assert len(set(ids)) == 6 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    first = bodies[0]["choices"][0]
    assert first["finish_reason"] == "tool_calls"
    calls = first["message"]["tool_calls"]
    assert calls[0]["type"] == "function"
    assert json.loads(calls[0]["function"]["arguments"]) == {"agent_type": "reviewer", "task": "t"}
    assert calls[1]["function"]["arguments"] == "{}"
    arguments_chars = len(calls[0]["function"]["arguments"]) + len(calls[1]["function"]["arguments"])
    assert bodies[0]["usage"]["prompt_tokens"] == 80 // 4
    assert bodies[0]["usage"]["completion_tokens"] == arguments_chars // 4


def test_journal_counts_requests_per_rule_and_reset_clears_it() -> None:
    rules = [
        {"when": {"user_contains": "a"}, "reply": {"content": "A"}},
        {"when": {"user_contains": "b"}, "reply": {"tool_calls": [{"name": "echo", "arguments": {}}]}},
    ]
    with ScriptedModelServer(rules) as server:
        for user in ("a", "b", "a", "b", "b"):
            chat(server.base_url, sys_user("s", user))
        journal = requests.get(f"{server.base_url}/_journal", timeout=5).json()["requests"]
        assert [e["rule"] for e in journal].count(1) == 3
        assert [e["reply"] for e in journal] == ["content", "tool_calls", "content", "tool_calls", "tool_calls"]
        assert journal == server.journal()
        assert requests.post(f"{server.base_url.removesuffix('/v1')}/_reset", timeout=5).status_code == 200
        assert server.journal() == []


def test_twenty_concurrent_requests_are_all_answered_and_journaled() -> None:
    rules = [{"reply": {"content": "{user}"}, "delay_seconds": 0.3}]
    barrier = threading.Barrier(20)
    answers: dict[int, str] = {}

    def worker(n: int, base_url: str) -> None:
        client = ModelClient(base_url, "", "m", 2.0, 5.0)
        barrier.wait(timeout=5)
        answers[n] = client.complete(sys_user("s", f"request {n}")).content or ""

    with ScriptedModelServer(rules) as server:
        threads = [threading.Thread(target=worker, args=(n, server.base_url)) for n in range(20)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        elapsed = time.monotonic() - started
        assert answers == {n: f"request {n}" for n in range(20)}
        assert len(server.journal()) == 20
    assert elapsed < 3.0  # served in parallel: one at a time would take 20 x 0.3 s


def test_the_server_checks_the_api_key_when_started_with_one() -> None:
    with ScriptedModelServer([{"reply": {"content": "ok"}}], api_key="secret-key") as server:
        assert chat(server.base_url, sys_user("s", "u")).status_code == 401
        assert chat(server.base_url, sys_user("s", "u"), Authorization="Bearer wrong").status_code == 401
        assert content_of(chat(server.base_url, sys_user("s", "u"), Authorization="Bearer secret-key")) == "ok"
        assert len(server.journal()) == 1


def test_stop_cuts_a_delayed_reply_short() -> None:
    server = ScriptedModelServer([{"reply": {"content": "late"}, "delay_seconds": 30}])
    server.start()
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["status"] = chat(server.base_url, sys_user("s", "u")).status_code
        except requests.RequestException as exc:
            result["error"] = exc

    t = threading.Thread(target=call)
    t.start()
    threading.Event().wait(0.3)  # the request is in flight on loopback well before this
    started = time.monotonic()
    server.stop()
    t.join(timeout=5)
    assert not t.is_alive()
    assert time.monotonic() - started < 2.0
    assert result == {"status": 503}
    assert server.journal() == []


def _post(conn: http.client.HTTPConnection, body: str) -> http.client.HTTPResponse:
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    return response


def test_a_client_sends_its_requests_on_one_kept_alive_connection_that_stop_ends() -> None:
    """HTTP/1.1 keep-alive, as providers answer: a session's second request reuses the first
    one's connection, and stop() ends it (the client reads the end, not a late answer)."""
    body = json.dumps({"model": "m", "messages": sys_user("s", "u")})
    with ScriptedModelServer([{"reply": {"content": "ok"}}]) as server:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=5)
        first = _post(conn, body)
        kept = conn.sock
        second = _post(conn, body)
        assert (first.status, second.status) == (200, 200)
        assert first.version == 11 and first.getheader("Connection") is None
        assert kept is not None and conn.sock is kept  # no reconnect: the server kept it open
        assert len(server.journal()) == 2
    kept.settimeout(5)
    assert kept.recv(1) == b""  # the stopped server ended the idle connection


def test_a_client_reset_between_two_requests_is_not_reported_as_a_server_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A SIGKILLed worker's kept-alive connection ends with a reset (SO_LINGER 0 does the same).
    body = json.dumps({"model": "m", "messages": sys_user("s", "u")})
    with ScriptedModelServer([{"reply": {"content": "ok"}}]) as server:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=5)
        assert _post(conn, body).status == 200
        assert conn.sock is not None
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
        time.sleep(0.3)  # the handler reads the reset
        assert content_of(chat(server.base_url, sys_user("s", "u"))) == "ok"  # still serving
    assert "ConnectionResetError" not in capsys.readouterr().err


def test_a_request_whose_body_is_not_read_closes_its_connection() -> None:
    # An unread body must never be parsed as the next request on a kept-alive connection.
    with ScriptedModelServer([{"reply": {"content": "ok"}}]) as server:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=5)
        conn.request("POST", "/v1/chat/completions", b"", {"Content-Length": "0"})
        response = conn.getresponse()
        response.read()
        assert response.status == 400 and response.getheader("Connection") == "close"
        assert server.journal() == []


def test_a_model_client_whose_kept_connection_the_server_ended_connects_again() -> None:
    """A provider may close an idle kept-alive connection (here: the server stopped and started
    again on its port). The client's next call opens a new one: no error and no retry."""
    script = [{"reply": {"content": "ok"}}]
    server = ScriptedModelServer(script)
    server.start()
    client = ModelClient(server.base_url, "", "m", 2.0, 5.0)  # no retries: a failure would raise
    try:
        assert client.complete(sys_user("s", "u")).content == "ok"
    finally:
        server.stop()
    again = ScriptedModelServer(script, port=server.port)
    again.start()
    try:
        assert client.complete(sys_user("s", "u")).content == "ok"
        assert len(again.journal()) == 1
    finally:
        again.stop()


@pytest.mark.parametrize(
    ("script", "fragment"),
    [
        ([{"reply": {"content": "x"}, "delay": 1}], "rule 0: unknown key(s) delay"),
        (
            [{"reply": {"content": "x"}}, {"when": {"role": "user"}, "reply": {"content": "y"}}],
            "rule 1 when: unknown key(s) role",
        ),
        ([{"reply": {"text": "x"}}], "rule 0 reply: unknown key(s) text"),
        ([{"reply": {"content": "x", "tool_calls": []}}], "exactly one of"),
        ([{"reply": {"tool_calls": [{"name": "echo", "args": {}}]}}], "rule 0 tool_calls[0]: unknown key(s) args"),
        ([{"when": {"turn": "1"}, "reply": {"content": "x"}}], "turn must be an integer"),
        ([{"when": {"last_role": "bot"}, "reply": {"content": "x"}}], "last_role must be one of"),
        ([{"when": {}}], "rule 0: a rule needs a reply"),
        ({"rule": []}, '"rules"'),
        ([{"reply": {"content": "x"}, "fail_first": {"status": 429}}], "fail_first must be a list"),
        ([{"reply": {"content": "x"}, "fail_first": [{"status": 200}]}], "fail_first[0]: status must be"),
        ([{"reply": {"content": "x"}, "fail_first": [{"status": 429, "retry_after": -1}]}], "retry_after must be"),
        ([{"reply": {"content": "x"}, "fail_first": [{"drop_connection": True, "status": 503}]}], "takes no other"),
    ],
)
def test_an_invalid_script_is_a_load_error_naming_the_rule(script: Any, fragment: str) -> None:
    with pytest.raises(ScriptError) as info:
        load_script(script)
    assert fragment in str(info.value)


def test_a_script_file_that_is_not_json_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("[{", encoding="utf-8")
    with pytest.raises(ScriptError, match=r"broken\.json: not valid JSON"):
        load_script(str(path))


def _serve_subprocess(argv: list[str], script: Path, env_key: str = "") -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "MODEL_API_KEY": env_key}
    proc = subprocess.Popen(
        [sys.executable, *argv, "--script", str(script), "--port", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded by the test timeout; the server prints it at once
    match = re.fullmatch(r"scripted model listening on (http://127\.0\.0\.1:\d+/v1)\n", line)
    if match is None:
        proc.kill()
        pytest.fail(f"unexpected first line {line!r}; stderr: {proc.communicate(timeout=5)[1]}")
    return proc, match.group(1)


CLI_SNIPPET = (
    "import argparse, sys; from cli.model import register; "
    "p = argparse.ArgumentParser(); register(p.add_subparsers(dest='command', required=True)); "
    "a = p.parse_args(sys.argv[1:]); sys.exit(a.handler(a))"
)


@pytest.mark.parametrize(
    "argv",
    [["-m", "doubles.scripted_model"], ["-c", CLI_SNIPPET, "scripted-model", "serve"]],
    ids=["python-m", "cli"],
)
def test_serve_command_answers_over_http_and_exits_cleanly_on_sigterm(argv: list[str], tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"when": {"user_contains": "ping"}, "reply": {"content": "pong"}}]), encoding="utf-8")
    proc, url = _serve_subprocess(argv, script, env_key="cli-key")
    try:
        reply = ModelClient(url, "cli-key", "m", 2.0, 5.0).complete(sys_user("s", "ping"))
        assert reply.content == "pong"
        with pytest.raises(ModelUnavailable) as info:
            ModelClient(url, "", "m", 2.0, 5.0).complete(sys_user("s", "ping"))
        assert "HTTP 401" in str(info.value)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 0, stderr


def test_serve_command_with_an_invalid_script_exits_2_naming_the_rule(tmp_path: Path) -> None:
    script = tmp_path / "bad.json"
    script.write_text(json.dumps([{"reply": {"content": "x"}, "bogus": 1}]), encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "doubles.scripted_model", "--script", str(script), "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert proc.returncode == 2
    assert "rule 0: unknown key(s) bogus" in proc.stderr


def test_fail_first_answers_the_failures_in_order_then_the_reply_and_reset_starts_over() -> None:
    import requests

    script = [{"reply": {"content": "ok"}, "fail_first": [{"status": 429, "retry_after": 2}, {"status": 503}]}]
    with ScriptedModelServer(script) as server:
        url = f"{server.base_url}/chat/completions"
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5}
        first = requests.post(url, json=body, timeout=5)
        assert (first.status_code, first.headers.get("Retry-After")) == (429, "2")
        second = requests.post(url, json=body, timeout=5)
        assert second.status_code == 503 and "Retry-After" not in second.headers
        assert requests.post(url, json=body, timeout=5).json()["choices"][0]["message"]["content"] == "ok"
        assert [e["reply"] for e in server.journal()] == ["error", "error", "content"]
        received = requests.get(f"{server.base_url}/_received", timeout=5).json()["requests"]
        assert received[0] == {"model": "m", "temperature": 0.5, "max_tokens": None, "tools": []}
        server.reset()
        assert requests.post(url, json=body, timeout=5).status_code == 429


def test_a_lognormal_delay_draws_each_answers_wait() -> None:
    # bench/scale.py --model-latency lognormal:MU,SIGMA: real providers' latencies spread.
    server = ScriptedModelServer([{"reply": {"content": "ok"}, "delay_seconds": {"lognormal": [-2.0, 0.6]}}])
    server.start()
    try:
        waits = []
        for _ in range(6):
            started = time.monotonic()
            assert content_of(chat(server.base_url, sys_user("s", "u"))) == "ok"
            waits.append(time.monotonic() - started)
    finally:
        server.stop()
    assert all(w > 0.01 for w in waits), waits  # exp(-2 - 4 x 0.6) is 0.012 s: every draw waits
    assert len({round(w, 3) for w in waits}) > 1, waits  # drawn, not one fixed wait


@pytest.mark.parametrize("bad", [{"lognormal": [1]}, {"lognormal": [0, -1]}, {"normal": [0, 1]}, {"lognormal": "x"}])
def test_a_delay_that_is_not_a_number_or_a_lognormal_is_refused(bad: Any) -> None:
    with pytest.raises(ScriptError, match="delay_seconds"):
        load_script([{"reply": {"content": "x"}, "delay_seconds": bad}])
