"""A REAL worker told to stop (SIGTERM, as ``systemd stop`` or ``celery control revoke
--terminate`` send it) while one of its tools runs: the exit raised on the loop's thread is the
process stopping, not the tool's result. Nothing is journaled for the call; the open journal
entry makes the recovering worker report it interrupted (it is not repeatable), and the model is
asked once after it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from devstack.processes import ROOT
from tests.helpers import results_by_model_id, wait_until
from tests.types import StackFactory

pytestmark = [pytest.mark.crash, pytest.mark.timeout(180)]

MAIN = "main agent"
SCRIPT = [
    {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {"tool_calls": [{"name": "charge_slowly", "arguments": {"seconds": 30}, "id": "call_charge"}]},
    },
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "after: {tool_results}"}},
]


USERTOOLS = Path(__file__).resolve().parent.parent / "data" / "usertools"


def user_env(tmp_path: Path) -> dict[str, str]:
    agents = tmp_path / "agents.toml"
    agents.write_text('[agents.main]\nsystem_prompt = "You are the main agent."\ntools = ["charge_slowly"]\n')
    return {
        "PYTHONPATH": f"{ROOT}{os.pathsep}{USERTOOLS}",
        "TOOL_MODULES": "signal_tools",
        "AGENTS_FILE": str(agents),
        "TOOL_STARTED_FILE": str(tmp_path / "started"),
    }


def pool_children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def test_a_worker_stopped_by_sigterm_mid_tool_leaves_the_call_interrupted_not_its_exit_as_result(
    stack_factory: StackFactory, tmp_path: Path
) -> None:
    stack = stack_factory(SCRIPT)
    env = user_env(tmp_path)
    w1 = stack.worker("w1", concurrency=1, **env)
    sid = stack.submit("charge it")
    wait_until((tmp_path / "started").exists, timeout=60, what="the tool started")
    assert w1.proc is not None
    (child,) = pool_children(w1.proc.pid)
    os.kill(child, signal.SIGTERM)  # what `revoke --terminate` sends the pool process
    wait_until(
        lambda: gone(child) or stack.snapshot(sid)["phase"] == "WAITING_USER",
        timeout=30,
        what="the pool process exited (or, wrongly, went on)",
    )
    w1.kill()
    stack.worker("w2", beat=True, **env)
    snap = stack.wait_phase(sid, timeout=120)

    result = results_by_model_id(snap["messages"])["call_charge"]
    assert "SystemExit" not in result
    assert "may or may not have taken effect" in result
    assert sum(1 for j in stack.model.journal() if j["rule"] == 1) == 1  # asked once after the call
    assert snap["messages"][-1]["content"].startswith("after: ")
    assert "error=SystemExit" not in w1.log()
    assert stack.invariants() == []


STUCK_SCRIPT = [
    {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "never_ends", "arguments": {}, "id": "call_a"},
                {"name": "never_ends", "arguments": {}, "id": "call_b"},
            ]
        },
    },
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "after: {tool_results}"}},
]


def test_a_worker_past_its_stuck_tool_threads_finishes_its_task_and_stops(
    stack_factory: StackFactory, tmp_path: Path
) -> None:
    stack = stack_factory(STUCK_SCRIPT)
    env = user_env(tmp_path)
    agents = tmp_path / "agents.toml"
    agents.write_text('[agents.main]\nsystem_prompt = "You are the main agent."\ntools = ["never_ends"]\n')
    w1 = stack.worker("w1", concurrency=1, TOOL_MAX_STUCK_THREADS="1", **env)
    sid = stack.submit("never ends")
    snap = stack.wait_phase(sid, timeout=60)  # the task finished first
    assert "timed out" in results_by_model_id(snap["messages"])["call_b"]
    wait_until(lambda: w1.exited, timeout=30, what="the worker stopped")
    log = w1.log()
    assert "event=tool_threads_over_limit stuck=2 limit=1" in log
    assert "event=worker_stopping_for_stuck_tool_threads" in log
    # The pool process published its count for the metrics (kept until its key's time to live).
    import redis

    from harness.tools.stuck import read_all

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    try:
        assert read_all(client).total == 2
    finally:
        client.close()
