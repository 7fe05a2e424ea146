"""`python -m demo approval`: a parent delegates to a child whose tool needs a human yes; the
request waits in the database (no worker holds it); the worker is SIGKILLed; a new worker boots
and leaves it waiting; `agent-recovery approve` decides from the command line; the tool runs
once and the child's result reaches the parent once. Same backends as `make demo`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

AGENTS = """
[agents.main]
system_prompt = "You are the main agent. Delegate refunds to the billing subagent."
[agents.billing]
system_prompt = "You are the billing subagent. Refund what you are asked to."
tools = ["refund"]
"""

SCRIPT = [
    {
        "when": {"system_contains": "main agent", "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "delegate", "arguments": {"agent_type": "billing", "task": "Refund 30 EUR on order A-1."}}
            ]
        },
    },
    {"when": {"system_contains": "main agent", "turn": 1}, "reply": {"content": "Done:\n{tool_results}"}},
    {
        "when": {"system_contains": "billing subagent", "last_role": "user"},
        "reply": {"tool_calls": [{"name": "refund", "arguments": {"order": "A-1", "amount": 30}}]},
    },
    {"when": {"system_contains": "billing subagent", "last_role": "tool"}, "reply": {"content": "{tool_results}"}},
]


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", *argv], capture_output=True, text=True, timeout=60)


def run() -> None:
    from demo.common import DATA, DemoFailed, configure, say, wait_for

    backend = configure()
    say(f"agent-recovery approval demo — backend: {backend}")
    (DATA / "agents.toml").write_text(AGENTS, encoding="utf-8")
    os.environ.update(AGENTS_FILE=str(DATA / "agents.toml"), TOOL_MODULES="demo.tools", DEMO_DIR=str(DATA))
    from settings import get_settings

    get_settings.cache_clear()
    from migrations import upgrade

    upgrade()
    from devstack.processes import Beat, Worker
    from doubles.scripted_model import ScriptedModelServer
    from harness.agents import load_at_start
    from harness.views import create_session, snapshot
    from models import transaction
    from models.approval import pending
    from recovery.invariants import check_all

    load_at_start()
    model = ScriptedModelServer(SCRIPT)
    os.environ["MODEL_BASE_URL"] = model.start()
    get_settings.cache_clear()
    env = dict(os.environ)
    import tasks

    processes: list[Any] = []
    try:
        say("1. starting the scripted model, worker w1 and the beat")
        w1 = Worker(env, DATA, name="w1").start()
        processes.append(w1)
        processes.append(Beat(env, DATA).start())
        sid = create_session("main", "Refund order A-1.")
        tasks.app.signature("agent.run", args=(sid, 0)).apply_async()
        say(f"2. submitted parent session {sid}; it delegates to the billing subagent, whose `refund` needs approval")

        def request() -> Any:
            with transaction() as s:
                rows = pending(s)
                return rows[0] if rows else None

        req = wait_for("the approval request", request, timeout=60)
        say("3. `agent-recovery approvals`:")
        say("   " + cli("approvals").stdout.strip())
        say("4. SIGKILL worker w1: the request is in the database, no process waits for it")
        w1.kill()
        say("5. starting worker w2: its boot scan leaves the request waiting (it needs a human)")
        processes.append(Worker(env, DATA, name="w2").start())
        time.sleep(5)
        with transaction() as s:
            phase = (snapshot(s, req.session_id) or {}).get("phase")
        say(f"   child session {req.session_id} is {phase}; refunds so far: {len(_refunds())}")
        if phase != "WAITING_APPROVAL" or _refunds():
            raise DemoFailed("the request did not wait for its decision")
        argv = ["approve", str(req.session_id), req.call_id, "--by", "demo-operator", "--note", "customer called"]
        say(f"6. agent-recovery {' '.join(argv)}")
        done = cli(*argv)
        say("   " + (done.stdout or done.stderr).strip())
        again = cli("deny", str(req.session_id), req.call_id, "--reason", "changed my mind")
        say(f"   a conflicting `deny` afterwards exits {again.returncode}: {again.stderr.strip()}")

        def parent_done() -> dict[str, Any] | None:
            with transaction() as s:
                snap = snapshot(s, sid)
            return snap if snap and snap["phase"] == "WAITING_USER" else None

        snap = wait_for("the child's result and the parent's answer", parent_done, timeout=90)
        say(f"7. the refund ran {len(_refunds())} time(s); parent session {sid} history:")
        for m in snap["messages"]:
            if m["role"] == "TOOL":
                say(f"   TOOL from child session {m['source_session_id']}: {json.loads(m['content'])['result']!r}")
            elif not m["tool_calls"]:
                say(f"   {m['role']}: {m['content']}")
        with transaction() as s:
            problems = check_all(s)
        if len(_refunds()) != 1 or done.returncode != 0 or again.returncode != 1:
            problems.append(f"refunds={len(_refunds())} approve exit={done.returncode} deny exit={again.returncode}")
        if problems:
            raise DemoFailed("check failed:\n  " + "\n  ".join(problems))
        say("8. invariants (including approvals A1-A3) hold; approval demo passed")
    finally:
        for p in reversed(processes):
            p.stop()
        model.stop()


def _refunds() -> list[str]:
    from demo.common import DATA

    path = DATA / "refunds.log"
    return path.read_text().splitlines() if path.exists() else []
