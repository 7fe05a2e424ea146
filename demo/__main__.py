"""`make demo`: a parent delegates to two children, the worker is SIGKILLed while they run, a
new worker recovers them, and the history is printed and checked.

Runs on an embedded default that needs no server: SQLite for the state database and Celery's
filesystem transport with a SQLite result backend (a threads worker, as the Procfile starts
the `celery` queue's; messages in flight at the SIGKILL are lost, and the scan rebuilds the work
from the state database — invariant I7, which is what this demo shows). With DATABASE_URL
and CELERY_BROKER_URL set (PostgreSQL + Redis), the same demo runs against them.
Exit code 0 when every check passed, 1 with the reason otherwise.

`python -m demo approval` shows approvals instead (demo/approval.py): a request, a kill, a
decision from the CLI and the result.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from demo.common import DATA, DemoFailed, configure, say, wait_for

CHILD_WAIT_SECONDS = 8

SCRIPT = [
    {
        "when": {"system_contains": "main agent", "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "Review the payment module."}},
                {"name": "delegate", "arguments": {"agent_type": "researcher", "task": "Research retry strategies."}},
            ]
        },
    },
    {
        "when": {"system_contains": "main agent", "turn": 1},
        "reply": {"content": "Summary of my subagents' work:\n{tool_results}"},
    },
    {
        "when": {"system_contains": "subagent", "last_role": "user"},
        "reply": {"tool_calls": [{"name": "wait", "arguments": {"seconds": CHILD_WAIT_SECONDS}}]},
    },
    {
        "when": {"system_contains": "reviewer subagent", "last_role": "tool"},
        "reply": {"content": "Reviewed: the payment module retries without idempotency keys."},
    },
    {
        "when": {"system_contains": "researcher subagent", "last_role": "tool"},
        "reply": {"content": "Researched: capped exponential backoff with jitter is the usual answer."},
    },
]


def run() -> None:
    backend = configure()
    say(f"agent-recovery demo — backend: {backend}")
    from settings import get_settings

    get_settings.cache_clear()
    from migrations import upgrade

    upgrade()
    from sqlalchemy import select

    from devstack.processes import Beat, Worker
    from doubles.scripted_model import ScriptedModelServer
    from harness.views import create_session, snapshot
    from models import SubagentExecution, transaction
    from recovery.invariants import check_all

    model = ScriptedModelServer(SCRIPT)
    os.environ["MODEL_BASE_URL"] = model.start()
    get_settings.cache_clear()
    env = dict(os.environ)
    import tasks

    processes: list[Any] = []
    try:
        say("1. starting the scripted model, worker w1 (a threads pool, as the Procfile) and the beat")
        w1 = Worker(env, DATA, name="w1").start()
        processes.append(w1)
        processes.append(Beat(env, DATA).start())

        sid = create_session("main", "Review the payment module and research retry strategies.")
        tasks.app.signature("agent.run", args=(sid, 0)).apply_async()
        say(f"2. submitted parent session {sid}; it delegates to a reviewer and a researcher")

        def executions() -> list[SubagentExecution]:
            with transaction() as s:
                return list(
                    s.execute(
                        select(SubagentExecution)
                        .where(SubagentExecution.parent_session_id == sid)
                        .order_by(SubagentExecution.id)
                    ).scalars()
                )

        wait_for(
            "both children to be running",
            lambda: len(ex := executions()) == 2 and all(e.lease_owner and e.status == "RUNNING" for e in ex),
            timeout=60,
        )
        before = [(e.id, e.child_session_id) for e in executions()]
        say(f"3. children running: executions {[b[0] for b in before]} in child sessions {[b[1] for b in before]}")
        say("4. SIGKILL worker w1 (its process and every loop in it) while the children are mid-flight")
        w1.kill()

        say("5. starting worker w2: its boot scan and the beat's scans find the work in the database")
        processes.append(Worker(env, DATA, name="w2").start())

        def parent_done() -> dict[str, Any] | None:
            with transaction() as s:
                snap = snapshot(s, sid)
            return snap if snap and snap["phase"] == "WAITING_USER" else None

        snap = wait_for("the recovered children and the parent's final answer", parent_done, timeout=120)
        after = [(e.id, e.child_session_id) for e in executions()]
        report(snap, before, after)
        with transaction() as s:
            problems = check_all(s)
        if after != before:
            problems.append(f"recovery changed executions/child sessions: {before} -> {after}")
        rounds = [m for m in snap["messages"] if m["tool_calls"]]
        if len(rounds) != 1:
            problems.append(f"expected one delivered round, found {len(rounds)}")
        if problems:
            raise DemoFailed("invariant check failed:\n  " + "\n  ".join(problems))
        say("8. invariant check I1–I5 over the whole database: all hold")
        say("demo passed")
    finally:
        for p in reversed(processes):
            p.stop()
        model.stop()


def report(snap: dict[str, Any], before: list[tuple[int, int]], after: list[tuple[int, int]]) -> None:
    same = "the SAME" if before == after else "DIFFERENT"
    say(f"6. recovery reused {same} executions and child sessions: {after}")
    say(f"7. parent session {snap['id']} history (phase {snap['phase']}):")
    for m in snap["messages"]:
        if m["tool_calls"]:
            calls = ", ".join(
                f"{c['function']['name']}({json.loads(c['function']['arguments']).get('agent_type')})"
                for c in m["tool_calls"]
            )
            say(f"   [{m['id']}] ASSISTANT calls {calls}")
        elif m["role"] == "TOOL":
            result = json.loads(m["content"])
            say(
                f"   [{m['id']}] TOOL from child session {m['source_session_id']}: "
                f"success={result['success']} result={result['result']!r}"
            )
        else:
            say(f"   [{m['id']}] {m['role']}: {m['content']}")
    for e in snap["executions"]:
        say(f"   execution {e['id']}: {e['status']}/{e['delivery_status']} child={e['child_session_id']}")


def main() -> int:
    try:
        if sys.argv[1:] == ["approval"]:
            from demo.approval import run as run_approval

            run_approval()
        else:
            run()
    except DemoFailed as exc:
        print(f"demo FAILED: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
