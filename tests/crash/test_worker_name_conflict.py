"""Real worker processes: two live processes under one worker name.

Workers are started as an operator starts them (the bare `celery -A tasks worker -n NAME@%h`, or
the Procfile's command), the second one while the first still runs a child: by a second `-n` with
the same name on one host, or by a `WORKER_ID` shared through an environment file. The older
process says so at ERROR within a lease, status and the metrics show it, it takes no new work,
its children's leases are taken back once, and every result is delivered exactly once.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.helpers import executions_of, wait_until
from tests.types import StackFactory

if TYPE_CHECKING:
    from devstack.processes import Service

pytestmark = [pytest.mark.crash, pytest.mark.timeout(180)]

MAIN = "main agent"
CHILD_WAIT_SECONDS = 6


def script() -> list[dict]:  # type: ignore[type-arg]
    return [
        {
            "when": {"system_contains": MAIN, "turn": 0},
            "reply": {
                "tool_calls": [
                    {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "review A"}},
                    {"name": "delegate", "arguments": {"agent_type": "researcher", "task": "research B"}},
                ]
            },
        },
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "final: {tool_results}"}},
        {
            "when": {"system_contains": "subagent", "last_role": "user"},
            "reply": {"tool_calls": [{"name": "wait", "arguments": {"seconds": CHILD_WAIT_SECONDS}}]},
        },
        {"when": {"system_contains": "subagent", "last_role": "tool"}, "reply": {"content": "child answer"}},
    ]


def operator_worker(env: dict[str, str], log_path: Path, node: str, bare: bool) -> Service:
    """A worker as an operator starts it: the bare command (`celery -A tasks worker -n NODE`),
    or the Procfile's line."""
    from devstack.processes import Service

    cmd = [sys.executable, "-m", "celery", "-A", "tasks", "worker", "-n", node, "-l", "INFO"]
    if not bare:
        cmd += ["-P", "prefork", "-c", "2", "-Q", "celery,recovery", "--without-gossip", "--without-mingle"]
    return Service(cmd, env, log_path, "event=worker_ready")


@pytest.mark.parametrize("shared", ["node_name", "worker_id"])
def test_an_older_worker_sharing_its_name_with_a_newer_one_says_so_stops_taking_work_and_loses_each_lease_once(
    stack_factory: StackFactory, tmp_path: Path, shared: str
) -> None:
    import uuid

    from devstack.processes import Beat
    from recovery.ops import status_report

    stack = stack_factory(script())
    name = f"same{uuid.uuid4().hex[:6]}"
    if shared == "worker_id":
        envs = [{**stack.env, "WORKER_ID": name}, {**stack.env, "WORKER_ID": name}]
        nodes = [f"{name}-a@%h", f"{name}-b@%h"]
        owner = name
    else:
        envs = [stack.env, stack.env]
        nodes = [f"{name}@%h", f"{name}@%h"]
        owner = None  # NAME@<this host>
    bare = shared == "node_name"  # two bare `celery -A tasks worker -n NAME@%h`; else the Procfile's line
    older = operator_worker(envs[0], tmp_path / "older.log", nodes[0], bare).start()
    stack.workers.append(older)
    stack.workers.append(Beat(stack.env, tmp_path).start())

    sid = stack.submit("go")
    wait_until(
        lambda: len([e for e in executions_of(sid) if e.status == "RUNNING" and e.epoch >= 1]) == 2,
        timeout=30,
        what="both children running on the older process",
    )
    first = {e.id: e for e in executions_of(sid)}
    owner = owner or next(iter(first.values())).lease_owner
    assert owner is not None and owner.startswith(name)
    assert {e.lease_owner for e in first.values()} == {owner}

    newer = operator_worker(envs[1], tmp_path / "newer.log", nodes[1], bare).start()
    stack.workers.append(newer)
    booted = time.monotonic()

    # The older process notices within a lease (LEASE_SECONDS=3 in the stack) and says so.
    wait_until(lambda: "event=worker_name_conflict" in older.log(), timeout=6, what="the conflict logged")
    assert time.monotonic() - booted < 3 + 1
    line = next(ln for ln in older.log().splitlines() if "event=worker_name_conflict" in ln)
    assert " ERROR " in line and f"worker={owner} " in line
    wait_until(lambda: "event=worker_stopped_consuming" in older.log(), timeout=5, what="consumers cancelled")
    (conflict,) = [c for c in status_report()["worker_name_conflicts"] if c["worker"] == owner]
    assert conflict["live"] is True and conflict["older_generation"] < conflict["generation"]

    snap = stack.wait_phase(sid, timeout=60)
    execs = executions_of(sid)
    assert {(e.status, e.delivery_status) for e in execs} == {("COMPLETED", "DELIVERED")}
    assert [m["role"] for m in snap["messages"]] == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    for e in execs:
        # Taken back once from the older generation, then finished by the newer one; never
        # taken again (each take bumps the epoch: creation 0 -> run 1 -> the take-back).
        assert e.lease_generation == conflict["generation"] or e.lease_owner is None
        assert e.epoch <= first[e.id].epoch + 2, f"execution {e.id} taken {e.epoch - first[e.id].epoch} times"
    assert sum(1 for j in stack.model.journal() if j["rule"] == 1) == 1  # the parent's answer, once
    assert stack.invariants() == []

    # The older process takes no new work: a second session runs on the newer one alone.
    received_before = len(re.findall(r"Task \S+ received", older.log()))
    second = stack.submit("again")
    stack.wait_phase(second, timeout=60)
    assert len(re.findall(r"Task \S+ received", older.log())) == received_before
    assert not older.exited  # it lives on (a restarting supervisor must not bring it back as newest)
    assert stack.invariants() == []
