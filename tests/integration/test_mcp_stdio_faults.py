"""Tools of a stdio MCP server that misbehaves on purpose (tests/data/mcp_stdio_server.py): it
dies mid-call, hangs, never answers ``initialize``, answers with a JSON-RPC error, quotes its
token, returns a resource or an image. In-process calls through ``run_inline``; the server is a
real subprocess."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness.tools import ToolContext, run_inline
from harness.tools import mcp as mcp_tools
from harness.tools.mcp import McpServer, McpUnavailable
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(120)

SERVER = str(Path(__file__).resolve().parent.parent / "data" / "mcp_stdio_server.py")


@pytest.fixture(autouse=True)
def _forget() -> Iterator[None]:
    mcp_tools.forget()
    yield
    mcp_tools.forget()


def ctx(call_id: str = "call_1") -> ToolContext:
    return ToolContext(5, call_id, None)


def misbehaving(tmp_path: Path, *extra: str, **kw: float) -> McpServer:
    env = (("MCP_RECORD", str(tmp_path / "record")), ("MCP_TOKEN", "${MCP_TEST_TOKEN}"))
    return McpServer("odd", command=sys.executable, args=(SERVER, *extra), env=env, **kw)  # type: ignore[arg-type]


def recorded(tmp_path: Path) -> list[str]:
    path = tmp_path / "record"
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


@pytest.fixture(autouse=True)
def _token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MCP_TEST_TOKEN", "tok-SECRET-9f2c1d")


def test_a_stdio_server_that_dies_mid_call_leaves_the_call_in_doubt_not_failed(tmp_path: Path) -> None:
    server = misbehaving(tmp_path)
    allowed = mcp_tools.server_tool_names(server)
    result = run_inline("odd__die", "{}", ctx(), allowed)
    assert "call die" in recorded(tmp_path)  # it reached the server
    assert result == (
        "error: the call to 'die' on MCP server 'odd' was interrupted (connection closed) and may or may not "
        "have taken effect"
    )


def test_a_json_rpc_error_the_server_sent_is_a_plain_failure(tmp_path: Path) -> None:
    server = misbehaving(tmp_path)
    allowed = mcp_tools.server_tool_names(server)
    result = run_inline("odd__refuse", "{}", ctx(), allowed)
    assert result == "error: MCP server 'odd' failed the call: amount is required"


def test_a_call_to_a_server_that_never_answers_initialize_was_never_sent_and_is_a_plain_failure(
    tmp_path: Path,
) -> None:
    mute = misbehaving(tmp_path, "--no-init", timeout_seconds=5, connect_timeout_seconds=1)
    with pytest.raises(McpUnavailable) as info:
        mcp_tools.call_tool(mute, "charge", {"amount_cents": 5}, ctx())
    assert recorded(tmp_path)[0].startswith("start ") and "call charge" not in recorded(tmp_path)
    assert str(info.value) == "MCP server 'odd' failed the call: no answer to initialize within 1 seconds"


def starts(tmp_path: Path) -> list[str]:
    return [line for line in recorded(tmp_path) if line.startswith("start ")]


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1]
    except FileNotFoundError:
        return False
    return not state.startswith("Z")


def test_one_server_process_serves_every_listing_and_call_of_a_process_and_is_closed_at_shutdown(
    tmp_path: Path,
) -> None:
    server = misbehaving(tmp_path)
    allowed = mcp_tools.server_tool_names(server)
    pids = {run_inline("odd__pid", "{}", ctx(f"call_{n}"), allowed) for n in range(3)}
    assert len(pids) == 1 and len(starts(tmp_path)) == 1
    (pid,) = pids
    assert pid_alive(int(pid))
    mcp_tools.close_sessions()
    wait_until(lambda: not pid_alive(int(pid)), timeout=10, what="the server closed")


def test_a_server_that_died_is_started_again_at_the_next_call(tmp_path: Path) -> None:
    server = misbehaving(tmp_path)
    allowed = mcp_tools.server_tool_names(server)
    first = run_inline("odd__pid", "{}", ctx("call_1"), allowed)
    assert "may or may not have taken effect" in run_inline("odd__die", "{}", ctx("call_2"), allowed)
    second = run_inline("odd__pid", "{}", ctx("call_3"), allowed)
    assert second.isdigit() and second != first
    assert len(starts(tmp_path)) == 2


def test_calls_from_many_threads_share_the_one_session(tmp_path: Path) -> None:
    server = misbehaving(tmp_path)
    allowed = mcp_tools.server_tool_names(server)
    barrier = threading.Barrier(8)

    def charge(n: int) -> str:
        barrier.wait(timeout=10)
        return run_inline("odd__charge", f'{{"amount_cents": {n}}}', ctx(f"call_{n}"), allowed)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(charge, range(8)))
    assert results == [f"charged {n}" for n in range(8)]
    assert len(starts(tmp_path)) == 1


def test_a_call_that_times_out_is_cancelled_on_the_server_and_the_session_goes_on(tmp_path: Path) -> None:
    server = misbehaving(tmp_path, timeout_seconds=1)
    allowed = mcp_tools.server_tool_names(server)
    result = run_inline("odd__hang", '{"seconds": 30}', ctx(), allowed)
    assert result == (
        "error: the call to 'hang' on MCP server 'odd' was interrupted (TimeoutError) and may or may not "
        "have taken effect"
    )
    wait_until(lambda: any(line.startswith("cancelled ") for line in recorded(tmp_path)), timeout=5, what="cancel")
    assert run_inline("odd__charge", '{"amount_cents": 1}', ctx("call_2"), allowed) == "charged 1"
    assert len(starts(tmp_path)) == 1


def test_a_tools_list_changed_notification_refreshes_the_listing(tmp_path: Path) -> None:
    server = misbehaving(tmp_path)
    assert "odd__grown" not in mcp_tools.server_tool_names(server)
    assert run_inline("odd__grow", "{}", ctx(), mcp_tools.server_tool_names(server)) == "grown"
    wait_until(lambda: "odd__grown" in mcp_tools.server_tool_names(server), timeout=5, what="the new listing")


def test_a_failed_listing_is_stamped_when_it_ended_so_a_hung_server_is_not_listed_at_every_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mcp_tools, "FAILED_LISTING_TTL_SECONDS", 1.0)
    mute = misbehaving(tmp_path, "--no-init", timeout_seconds=1.5, connect_timeout_seconds=1.5)
    assert mcp_tools.server_tool_names(mute) == ()  # took 1.5 s: longer than the failed listing is kept
    assert mcp_tools.server_tool_names(mute) == ()
    assert "is unreachable" in mcp_tools.unavailable_reason("odd__charge")
    assert len(starts(tmp_path)) == 1  # the second lookup used the failure, it did not list again


def test_a_servers_token_is_redacted_from_its_results_errors_and_stderr(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="harness.tools.mcp_session")
    token = "tok-SECRET-9f2c1d"
    server = misbehaving(tmp_path)
    mcp_tools.configure([server])
    allowed = mcp_tools.server_tool_names(server)
    assert run_inline("odd__whoami", "{}", ctx(), allowed) == "my token is [redacted]"
    assert run_inline("odd__leak", "{}", ctx("call_2"), allowed) == "error: upstream said 401 for [redacted]"
    wait_until(lambda: "event=mcp_server_stderr" in caplog.text, timeout=5, what="the server's stderr in our log")
    assert "serving whoami with token [redacted]" in caplog.text
    assert token not in caplog.text


def test_a_resource_keeps_its_text_and_binary_parts_are_described(tmp_path: Path) -> None:
    server = misbehaving(tmp_path)
    allowed = mcp_tools.server_tool_names(server)
    assert run_inline("odd__resource", "{}", ctx(), allowed) == (
        "the report:\nall green\n[application/pdf, 3 B, not shown]"
    )
    assert run_inline("odd__image", "{}", ctx("call_2"), allowed) == "the chart:\n[image/png, 48 kB, not shown]"
