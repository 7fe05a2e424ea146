"""An agent runs PyPI's official MCP server ``mcp-server-time`` over stdio in a REAL worker,
and the worker is SIGKILLed in the middle of the call (after the server answered, before its
result was journaled): a new worker's scan recovers the child, which runs the read-only call
again only when the agent trusts the server's annotations, and otherwise reports it
interrupted; either way the parent gets exactly one result."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from devstack.processes import ROOT
from tests.helpers import executions_of, messages_of, wait_until
from tests.types import StackFactory

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
