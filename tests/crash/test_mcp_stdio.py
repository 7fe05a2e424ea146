"""An agent runs PyPI's official MCP server ``mcp-server-time`` over stdio in a REAL worker,
and the worker is SIGKILLed in the middle of the call (after the server answered, before its
result was journaled): a new worker's scan recovers the child, which runs the read-only call
again only when the agent trusts the server's annotations, and otherwise reports it
interrupted; either way the parent gets exactly one result. And a stdio server whose worker is
SIGKILLed while its call hangs dies with the worker (no orphan)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from devstack.processes import ROOT
from tests.helpers import executions_of, messages_of, wait_until
from tests.types import StackFactory

ODD_SERVER = Path(__file__).resolve().parent.parent / "data" / "mcp_stdio_server.py"

pytestmark = [pytest.mark.crash, pytest.mark.timeout(180)]

MAIN = "main agent"
SCRIPT = [
    {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {"tool_calls": [{"name": "delegate", "arguments": {"agent_type": "clock", "task": "what time"}}]},
    },
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "parent got: {tool_results}"}},
    {
        "when": {"system_contains": "clock subagent", "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "time__get_current_time", "arguments": {"timezone": "Europe/Oslo"}, "id": "call_time"}
            ]
        },
    },
    {"when": {"system_contains": "clock subagent", "turn": 1}, "reply": {"content": "clock saw: {tool_results}"}},
]


def agents_file(tmp_path: Path, trust: bool) -> Path:
    path = tmp_path / "agents.toml"
    path.write_text(
        '[agents.main]\nsystem_prompt = "You are the main agent."\ntools = ["delegate"]\n'
        '[agents.clock]\nsystem_prompt = "You are the clock subagent."\ntools = ["time__*"]\n'
        f'mcp_servers = [{{name = "time", command = "{sys.executable}", '
        'args = ["-m", "mcp_server_time", "--local-timezone", "UTC"], timeout_seconds = 30, '
        f"trust_annotations = {'true' if trust else 'false'}}}]\n",
        encoding="utf-8",
    )
    return path


@pytest.mark.parametrize("trust", [True, False], ids=["trusted_read_only", "untrusted"])
def test_a_worker_killed_mid_call_of_a_stdio_mcp_server_is_recovered_with_one_result(
    stack_factory: StackFactory, tmp_path: Path, trust: bool
) -> None:
    stack = stack_factory(SCRIPT)
    env = {"AGENTS_FILE": str(agents_file(tmp_path, trust)), "PYTHONPATH": str(ROOT)}
    w1 = stack.worker("w1", CRASH_POINT="mcp.after_call", **env)
    sid = stack.submit("tell me the time")
    wait_until(lambda: "crash_point=mcp.after_call" in w1.log() or w1.exited, timeout=90, what="the crash mid-call")
    w1.kill()
    stack.worker("w2", beat=True, **env)
    snap = stack.wait_phase(sid, timeout=120)

    (execution,) = executions_of(sid)
    assert (execution.status, execution.delivery_status) == ("COMPLETED", "DELIVERED")
    (tool_row,) = [m for m in messages_of(execution.child_session_id) if m.role == "TOOL"]
    if trust:
        # Read-only by the server's own annotation, trusted: run again for the same call.
        assert '"timezone": "Europe/Oslo"' in (tool_row.content or "")
    else:
        assert "may or may not have taken effect" in (tool_row.content or "")
    assert sum(1 for j in stack.model.journal() if j["rule"] == 2) == 1  # the child's reply: asked once
    assert snap["messages"][-1]["content"].startswith("parent got: ")
    assert stack.invariants() == []


HANG_SCRIPT = [
    {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {"tool_calls": [{"name": "odd__block", "arguments": {"seconds": 600}, "id": "call_block"}]},
    },
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "after: {tool_results}"}},
]


def server_pid(record: Path) -> int | None:
    lines = record.read_text(encoding="utf-8").splitlines() if record.exists() else []
    if "call block" not in lines:
        return None
    before = lines[: lines.index("call block")]
    return int([line for line in before if line.startswith("start ")][-1].split()[1])


def alive(pid: int) -> bool:
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return False


def test_a_stdio_server_dies_with_its_worker_sigkilled_mid_call(stack_factory: StackFactory, tmp_path: Path) -> None:
    record = tmp_path / "record"
    agents = tmp_path / "agents.toml"
    agents.write_text(
        '[agents.main]\nsystem_prompt = "You are the main agent."\ntools = ["odd__*"]\n'
        f'mcp_servers = [{{name = "odd", command = "{sys.executable}", args = ["{ODD_SERVER}"], '
        f'env = {{MCP_RECORD = "{record}"}}, timeout_seconds = 900}}]\n',
        encoding="utf-8",
    )
    stack = stack_factory(HANG_SCRIPT)
    w1 = stack.worker("w1", concurrency=1, AGENTS_FILE=str(agents), PYTHONPATH=str(ROOT))
    stack.submit("hang")
    pid = wait_until(lambda: server_pid(record), timeout=60, what="the hanging call reached the server")
    assert alive(pid)
    w1.kill()  # SIGKILL of the worker's process group; the server has a session of its own
    wait_until(lambda: not alive(pid), timeout=10, what="the server died with its worker")
