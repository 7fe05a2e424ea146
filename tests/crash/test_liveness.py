"""Liveness through real workers started exactly as Celery's docs, our README and the Procfile
start them: a bare ``celery -A tasks worker`` serves every queue; with the Procfile's topology
(a worker for ``celery``, a dedicated 2-slot worker for ``recovery``) recovered hour-long
children never hold up another parent's delivery; a scanner frozen (SIGSTOP) while it holds the
right to scan stops no recovery; a child whose compaction boundary is invalid ends FAILED and
is delivered once; a queued parent run keeps its epoch through the scans while it waits."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from devstack.processes import ROOT, procfile_commands
from models import AgentSession, Phase, Role, SessionType, transaction
from models.base import utcnow
from tests.helpers import add_message, executions_of, make_execution, make_session, wait_until

pytestmark = [pytest.mark.crash, pytest.mark.timeout(180)]

MAIN = "main agent"
LONG_SECONDS = 30


def script() -> list[dict[str, Any]]:
    """ "slow" parents delegate two children that hold LONG_SECONDS (idempotent: a recovered
    child holds again); "fast" ones two that wait 1 s."""
    return [
        *[
            {
                "when": {"system_contains": MAIN, "turn": 0, "user_contains": kind},
                "reply": {
                    "tool_calls": [
                        {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": f"{kind} review"}},
                        {"name": "delegate", "arguments": {"agent_type": "researcher", "task": f"{kind} research"}},
                    ]
                },
            }
            for kind in ("slow", "fast", "plain")
        ],
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "final: {tool_results}"}},
        {
            "when": {"system_contains": "subagent", "last_role": "user", "user_contains": "slow"},
            "reply": {"tool_calls": [{"name": "hold", "arguments": {"seconds": LONG_SECONDS}}]},
        },
        {
            "when": {"system_contains": "subagent", "last_role": "user", "user_contains": "fast"},
            "reply": {"tool_calls": [{"name": "wait", "arguments": {"seconds": 1}}]},
        },
        {"when": {"system_contains": "subagent"}, "reply": {"content": "child answer"}},
    ]


DATA = Path(__file__).resolve().parent.parent / "data"
#: Children that may ``hold``: an idempotent long tool, run again by a recovered child (``wait``
#: would be reported interrupted after the crash and the child would end at once).
HOLD_ENV = {
    "PYTHONPATH": f"{ROOT}{os.pathsep}{DATA / 'usertools'}",
    "TOOL_MODULES": "hold_tools",
    "AGENTS_FILE": str(DATA / "agents_hold.toml"),
}


def test_a_bare_celery_worker_delivers_a_delegating_round(stack_factory: Any) -> None:
    """`celery -A tasks worker`, nothing else: it consumes both queues (children, scans and deliveries)."""
    stack = stack_factory(script())
    stack.worker("bare", argv=["-A", "tasks", "worker"])
    sid = stack.submit("plain")
    snap = stack.wait_phase(sid, timeout=60)
    assert [m["role"] for m in snap["messages"]] == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    assert {(e.status, e.delivery_status) for e in executions_of(sid)} == {("COMPLETED", "DELIVERED")}
    assert stack.invariants() == []


def _readme_command(prefix: str) -> list[str]:
    """A worker command of the supervision examples (docs/operations.md), as an operator copies it."""
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith(prefix))
    argv = shlex.split(line.split("bin/celery", 1)[1])
    # systemd and supervisord expand these before Celery sees the line
    return [a.replace("%%h", "%h").replace("%i", "1").replace("%(process_num)d", "1") for a in argv]


@pytest.mark.parametrize("example", ["ExecStart=", "command=/srv"], ids=["systemd", "supervisord"])
def test_the_readme_supervision_commands_start_workers_that_deliver_a_round(stack_factory: Any, example: str) -> None:
    argv = _readme_command(example)
    assert argv[:3] == ["-A", "tasks", "worker"] and "-Q" not in argv
    stack = stack_factory(script())
    stack.worker("readme", argv=argv)
    sid = stack.submit("plain")
    stack.wait_phase(sid, timeout=60)
    assert {(e.status, e.delivery_status) for e in executions_of(sid)} == {("COMPLETED", "DELIVERED")}
    assert stack.invariants() == []


def test_with_the_procfile_topology_recovered_long_children_never_delay_a_new_parents_delivery(
    stack_factory: Any,
) -> None:
    lines = procfile_commands()
    assert "-Q" in lines["recovery"] and "recovery" in lines["recovery"]
    stack = stack_factory(script())
    worker = stack.worker("worker", argv=lines["worker"], **HOLD_ENV)
    stack.worker("recovery", argv=lines["recovery"], **HOLD_ENV)
    slow = stack.submit("slow")

    def running(sid: int, min_epoch: int) -> bool:
        execs = executions_of(sid)
        return len(execs) == 2 and all(e.lease_owner and e.epoch >= min_epoch for e in execs)

    wait_until(lambda: running(slow, 1), timeout=30, what="both long children running")
    first = {e.id: e.epoch for e in executions_of(slow)}
    worker.kill()
    stack.worker("worker", argv=lines["worker"], **HOLD_ENV)  # the supervisor restarts it under its name
    wait_until(
        lambda: all(e.epoch >= first[e.id] + 2 and e.lease_owner for e in executions_of(slow)),
        # Not what this test measures (the fast parent's wait is): generous for a loaded machine.
        timeout=40,
        what="both long children recovered and running again",
    )
    fast = stack.submit("fast")
    started = time.monotonic()
    stack.wait_phase(fast, timeout=25)
    took = time.monotonic() - started
    still = executions_of(slow)
    assert {e.status for e in still} == {"RECOVERING"}, "the long children are still running"
    assert took < 20, f"the new parent waited {took:.1f}s behind the recovered children"
    stack.wait_phase(slow, timeout=LONG_SECONDS + 30)
    assert stack.invariants() == []


def _dead_child() -> tuple[int, int]:
    """A parent whose one child's worker died (lease lapsed) with nothing else to recover it."""
    parent = make_session(phase=Phase.RUNNING)
    add_message(parent, Role.USER, "plain")
    child = make_session(
        session_type=SessionType.SUBAGENT, phase=Phase.RUNNING, parent_session_id=parent, agent_type="reviewer"
    )
    start = add_message(child, Role.USER, "plain review", source_session_id=parent)
    eid = make_execution(
        parent,
        child,
        tool_call_id="call_dead",
        execution_start_message_id=start,
        lease_owner="gone@host",
        lease_expires_at=utcnow() - timedelta(seconds=5),
    )
    return parent, eid


def test_a_scanner_frozen_while_it_holds_the_right_to_scan_stops_no_recovery(stack_factory: Any) -> None:
    stack = stack_factory(script())
    # A single-slot scanner that freezes (SIGSTOP) the first time it holds the right to scan.
    frozen = stack.worker(
        "frozen",
        concurrency=1,
        queues="recovery",
        CRASH_POINT="scan.holding_right",
        CRASH_POINT_MODE="stop",
    )
    wait_until(lambda: "crash_point=scan.holding_right" in frozen.log(), timeout=30, what="the scanner froze")
    froze = time.monotonic()
    stack.worker("other", beat=True)
    parent, _ = _dead_child()
    wait_until(
        lambda: executions_of(parent)[0].delivery_status == "DELIVERED",
        timeout=30,
        interval=0.2,
        what="the dead child recovered and delivered by another worker's scans",
    )
    took = time.monotonic() - froze
    # The right lasts max(SCAN_INTERVAL_SECONDS, LEASE_SECONDS) = 3 s in the stack; the beat
    # scans every 2 s; the child's own run and delivery take a few seconds more.
    assert took < 25, f"recovery waited {took:.1f}s behind the frozen scanner"
    stack.wait_phase(parent, timeout=30)
    assert stack.invariants() == []
    os.killpg(frozen.proc.pid, signal.SIGCONT)  # thawed: its pass finds the right gone and stops
    wait_until(
        lambda: "stopped=scan_right_lost" in frozen.log(),
        timeout=20,
        what="the thawed scanner noticed it lost the right",
    )
    assert stack.invariants() == []


def _epoch(sid: int) -> int:
    with transaction() as s:
        return int(s.execute(select(AgentSession.epoch).where(AgentSession.id == sid)).scalar_one())


def test_a_dead_child_whose_boundary_is_invalid_ends_failed_is_delivered_once_and_never_re_sent(
    stack_factory: Any,
) -> None:
    """An invalid compaction boundary, through a bare worker and the beat: the child's history can never be
    made legal, so its recovery ends it FAILED with the reason and the failure is delivered;
    the scans after it send nothing again (it used to be re-sent every two leases, forever)."""
    stack = stack_factory(script())
    parent, _ = _dead_child()
    child = executions_of(parent)[0].child_session_id
    with transaction() as s:
        s.execute(update(AgentSession).where(AgentSession.id == child).values(compaction_boundary_message_id=999999))
    stack.worker("bare", argv=["-A", "tasks", "worker"])
    stack.beat()
    stack.wait_phase(parent, timeout=60)
    (row,) = executions_of(parent)
    assert (row.status, row.delivery_status) == ("FAILED", "DELIVERED")
    assert "compaction boundary" in (row.error or "")
    settled = (row.epoch, _epoch(parent))
    time.sleep(3 * 2 + 1)  # three beat scans (SCAN_INTERVAL_SECONDS=2 in the stack)
    (later,) = executions_of(parent)
    assert (later.epoch, _epoch(parent)) == settled, "nothing is re-sent once the failure is delivered"
    assert stack.invariants() == []


def test_a_queued_parent_run_keeps_its_epoch_through_the_scans_and_runs_from_its_first_message(
    stack_factory: Any,
) -> None:
    """A queued run keeps its epoch, through real workers: nobody consumes ``celery`` yet (only a recovery
    worker and the beat run), so a submitted parent's ``agent.run`` waits while scans pass over
    its lapsed reservation: they re-send it with the SAME epoch, so the first message stays valid.
    When a worker for ``celery`` starts, the parent runs its round once."""
    stack = stack_factory(script())
    stack.worker("rec", queues="recovery")
    stack.beat()
    sid = stack.submit("plain")
    submitted = _epoch(sid)
    time.sleep(4 * 3 + 1)  # past two reservations (2 x LEASE_SECONDS=3) and six beat scans
    assert _epoch(sid) == submitted, "a scan moved a queued parent's epoch: its message went stale"
    stack.worker("runner", queues="celery")
    snap = stack.wait_phase(sid, timeout=60)
    assert [m["role"] for m in snap["messages"]] == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    assert stack.invariants() == []
