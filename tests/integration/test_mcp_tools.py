"""Tools of MCP servers, against a real MCP server on loopback built with the
official SDK (doubles/mcp_server.py), in-process and through a REAL worker."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from doubles.mcp_server import McpTestServer
from harness.agents import McpServer, parse_agents
from harness.tools import ToolContext, lookup, run_inline, tool_names
from harness.tools import mcp as mcp_tools
from tests.helpers import results_by_model_id
from tests.services import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def travel() -> Iterator[McpTestServer]:
    mcp_tools.forget()
    with McpTestServer() as server:
        yield server
    mcp_tools.forget()


def ctx(call_id: str = "call_1") -> ToolContext:
    return ToolContext(5, call_id, None)


def test_an_agents_mcp_tools_are_offered_beside_its_python_tools_with_their_annotations(
    travel: McpTestServer,
) -> None:
    # The server's annotations are trusted because the agent says so (the next tests: otherwise not).
    toml = (
        '[agents.trip]\nsystem_prompt = "p"\ntools = ["echo"]\n'
        f'mcp_servers = [{{name = "travel", url = "{travel.url}", trust_annotations = true}}]\n'
    )
    (agent,) = parse_agents(toml).values()
    names = agent.tool_names(tool_names(), subagent=True)
    assert names == ("echo", "travel__lookup_city", "travel__book_room", "travel__charge_card", "travel__always_fails")
    flags = {n: (t.read_only, t.idempotent) for n in names[1:] if (t := lookup(n)) is not None}
    assert flags == {
        "travel__lookup_city": (True, False),
        "travel__book_room": (False, True),
        "travel__charge_card": (False, False),
        "travel__always_fails": (False, False),
    }
    book = lookup("travel__book_room")
    assert book is not None and book.spec()["function"]["parameters"]["required"] == ["city", "nights"]
    assert book.description.startswith("Book a room")


def test_an_mcp_tool_call_returns_its_text_and_a_failing_tool_is_a_tool_error(travel: McpTestServer) -> None:
    server = McpServer("travel", travel.url)
    allowed = mcp_tools.server_tool_names(server)
    assert run_inline("travel__lookup_city", '{"name": "Oslo"}', ctx(), allowed) == "Oslo: 3 hotels"
    assert run_inline("travel__book_room", '{"city": "Oslo", "nights": 2}', ctx(), allowed) == "booked 2 nights in Oslo"
    failed = run_inline("travel__always_fails", "{}", ctx(), allowed)
    assert failed.startswith("error: ") and "\n" not in failed
    invalid = run_inline("travel__book_room", '{"city": "Oslo"}', ctx(), allowed)
    assert invalid.startswith("error: ") and "nights" in invalid
    assert [name for name, _ in travel.calls] == ["lookup_city", "book_room", "always_fails"]
    assert travel.keys[0] == ctx().idempotency_key  # handed to the server in _meta


def test_a_server_that_is_down_offers_no_tools_and_a_call_of_one_is_a_tool_error() -> None:
    mcp_tools.forget()
    down = McpServer("down", f"http://127.0.0.1:{free_port()}/mcp", timeout_seconds=3)
    mcp_tools.configure([down])
    try:
        assert mcp_tools.server_tool_names(down) == ()
        assert run_inline("down__lookup", "{}", ctx(), ("down__lookup",)) == (
            "error: tool 'down__lookup' is not available (MCP server 'down' is unreachable: ConnectError)"
        )
    finally:
        mcp_tools.forget()


def test_a_server_that_goes_down_after_its_listing_fails_the_call_as_a_tool_error() -> None:
    mcp_tools.forget()
    with McpTestServer() as travel:
        server = McpServer("travel", travel.url, timeout_seconds=3)
        allowed = mcp_tools.server_tool_names(server)
    try:
        assert run_inline("travel__lookup_city", '{"name": "Oslo"}', ctx(), allowed) == (
            "error: MCP server 'travel' failed the call: ConnectError"
        )
    finally:
        mcp_tools.forget()


SCRIPT = [
    {
        "when": {"system_contains": "trip agent", "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "travel__lookup_city", "arguments": {"name": "Oslo"}, "id": "call_city"},
                {"name": "travel__book_room", "arguments": {"city": "Oslo", "nights": 2}, "id": "call_book"},
                {"name": "down__lookup", "arguments": {}, "id": "call_down"},
                {"name": "echo", "arguments": {"text": "python too"}, "id": "call_echo"},
            ]
        },
    },
    {"when": {"system_contains": "trip agent", "turn": 1}, "reply": {"content": "trip: {tool_results}"}},
]


def test_a_worker_offers_mcp_tools_and_a_down_server_is_a_tool_error_not_a_failed_session(
    stack_factory: Any, travel: McpTestServer, tmp_path: Path
) -> None:
    from devstack.processes import ROOT

    agents = tmp_path / "agents.toml"
    agents.write_text(
        "[agents.main]\n"
        'system_prompt = "You are the trip agent."\n'
        'tools = ["echo"]\n'
        f'mcp_servers = [{{name = "travel", url = "{travel.url}"}}, '
        f'{{name = "down", url = "http://127.0.0.1:{free_port()}/mcp", timeout_seconds = 3}}]\n',
        encoding="utf-8",
    )
    stack = stack_factory(SCRIPT)
    stack.worker(concurrency=1, AGENTS_FILE=str(agents), PYTHONPATH=str(ROOT))
    sid = stack.submit("plan a trip to Oslo")
    snap = stack.wait_phase(sid)

    tools = results_by_model_id(snap["messages"])
    assert tools == {
        "call_city": "Oslo: 3 hotels",
        "call_book": "booked 2 nights in Oslo",
        "call_down": "error: tool 'down__lookup' is not available (MCP server 'down' is unreachable: ConnectError)",
        "call_echo": "python too",
    }
    assert snap["messages"][-1]["content"].startswith("trip: ")
    (offered, *_) = stack.model.received()
    assert offered["tools"] == [
        "echo",
        "travel__lookup_city",
        "travel__book_room",
        "travel__charge_card",
        "travel__always_fails",
    ]
    assert [name for name, _ in travel.calls] == ["lookup_city", "book_room"]
    log = stack.workers[0].log()
    assert "event=mcp_list_failed server=down error=ConnectError" in log and "Oslo" not in log
    assert stack.invariants() == []
    assert os.environ.get("AGENTS_FILE", "") != str(agents)  # the test process kept its own agents


def test_a_servers_annotations_are_not_trusted_unless_the_agent_says_so(travel: McpTestServer) -> None:
    (agent,) = parse_agents(
        f'[agents.trip]\nsystem_prompt = "p"\nmcp_servers = [{{name = "travel", url = "{travel.url}"}}]\n'
    ).values()
    names = agent.tool_names((), subagent=True)
    assert "travel__lookup_city" in names and "travel__book_room" in names
    assert {(t.read_only, t.idempotent) for n in names if (t := lookup(n)) is not None} == {(False, False)}


def test_an_agents_tools_list_allow_lists_mcp_tools_by_name_and_pattern(travel: McpTestServer) -> None:
    agents = parse_agents(
        f'[agents.one]\nsystem_prompt = "p"\ntools = ["echo", "travel__lookup_city"]\n'
        f'mcp_servers = [{{name = "travel", url = "{travel.url}"}}]\n'
        f'[agents.some]\nsystem_prompt = "p"\ntools = ["travel__book_*", "travel__charge_card"]\n'
        f'mcp_servers = [{{name = "travel", url = "{travel.url}"}}]\n'
    )
    assert agents["one"].tool_names(tool_names(), subagent=True) == ("echo", "travel__lookup_city")
    assert agents["some"].tool_names(tool_names(), subagent=True) == ("travel__book_room", "travel__charge_card")


def test_an_mcp_tool_whose_name_no_provider_accepts_is_not_offered_and_the_log_names_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mcp_tools.forget()
    with McpTestServer(extras=True) as travel:
        names = mcp_tools.server_tool_names(McpServer("travel", travel.url))
    mcp_tools.forget()
    assert "travel__whoami" in names and "travel__réserver" not in names
    assert "event=mcp_tool_skipped server=travel tool=travel__réserver reason=name_not_allowed" in caplog.text


def test_an_mcp_call_that_times_out_after_it_was_sent_is_interrupted_not_failed() -> None:
    mcp_tools.forget()
    with McpTestServer(extras=True) as travel:
        server = McpServer("travel", travel.url, timeout_seconds=1)
        allowed = mcp_tools.server_tool_names(server)
        result = run_inline("travel__slow_charge", '{"amount_cents": 500, "seconds": 3}', ctx(), allowed)
        assert travel.calls == [("slow_charge", {"amount_cents": 500})]  # it reached the server
    mcp_tools.forget()
    assert result == (
        "error: the call to 'slow_charge' on MCP server 'travel' was interrupted (TimeoutError) "
        "and may or may not have taken effect"
    )


def test_headers_of_an_http_server_are_read_from_the_environment_and_never_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    token = "tok-CANARY-4b1f9e"
    monkeypatch.setenv("TRAVEL_TOKEN", token)
    mcp_tools.forget()
    with McpTestServer(extras=True) as travel:
        (agent,) = parse_agents(
            '[agents.trip]\nsystem_prompt = "p"\n'
            f'mcp_servers = [{{name = "travel", url = "{travel.url}", '
            'headers = {Authorization = "Bearer ${TRAVEL_TOKEN}"}}]\n'
        ).values()
        (server,) = agent.mcp_servers
        allowed = agent.tool_names((), subagent=True)
        # The server got the token (not the text ``${TRAVEL_TOKEN}``), and the model never sees it.
        assert run_inline("travel__whoami", "{}", ctx(), allowed) == "Bearer [redacted]"
    mcp_tools.forget()
    assert token not in repr(agent) and token not in repr(server) and token not in caplog.text


def test_an_agent_whose_mcp_headers_name_an_unset_variable_stops_the_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from harness.agents import _load, load_at_start
    from harness.errors import AgentConfigError
    from settings import get_settings

    agents = tmp_path / "agents.toml"
    agents.write_text(
        '[agents.trip]\nsystem_prompt = "p"\nmcp_servers = [{name = "travel", url = "http://127.0.0.1:9/mcp", '
        'headers = {Authorization = "Bearer ${NO_SUCH_TOKEN_VAR}"}}]\n',
        encoding="utf-8",
    )
    monkeypatch.setenv("AGENTS_FILE", str(agents))
    monkeypatch.delenv("NO_SUCH_TOKEN_VAR", raising=False)
    get_settings.cache_clear()
    _load.cache_clear()
    try:
        with pytest.raises(AgentConfigError) as info:
            load_at_start()
        assert "NO_SUCH_TOKEN_VAR" in str(info.value)
    finally:
        get_settings.cache_clear()
        _load.cache_clear()


def test_a_stdio_server_the_official_mcp_server_time_is_listed_and_called() -> None:
    import sys

    mcp_tools.forget()
    (agent,) = parse_agents(
        '[agents.clock]\nsystem_prompt = "p"\ntools = ["time__get_current_time"]\n'
        f'mcp_servers = [{{name = "time", command = "{sys.executable}", '
        'args = ["-m", "mcp_server_time", "--local-timezone", "UTC"], timeout_seconds = 30}]\n'
    ).values()
    try:
        allowed = agent.tool_names((), subagent=True)
        assert allowed == ("time__get_current_time",)
        result = run_inline("time__get_current_time", '{"timezone": "Europe/Oslo"}', ctx(), allowed)
    finally:
        mcp_tools.forget()
    assert '"timezone": "Europe/Oslo"' in result and '"datetime"' in result


def test_a_variable_in_an_http_servers_url_is_read_from_the_environment_and_redacted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mcp_tools.forget()
    with McpTestServer(extras=True) as travel:
        port = travel.url.split(":")[2].split("/")[0]
        monkeypatch.setenv("TRAVEL_PORT", port)
        (agent,) = parse_agents(
            '[agents.trip]\nsystem_prompt = "p"\n'
            'mcp_servers = [{name = "travel", url = "http://127.0.0.1:${TRAVEL_PORT}/mcp"}]\n'
        ).values()
        (server,) = agent.mcp_servers
        assert server.references() == {"TRAVEL_PORT"}
        allowed = agent.tool_names((), subagent=True)
        assert run_inline("travel__lookup_city", '{"name": "Oslo"}', ctx(), allowed) == "Oslo: 3 hotels"
    mcp_tools.forget()
