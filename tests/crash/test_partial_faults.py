"""Partial faults with real worker processes: one of several workers dies while the others run.

The dead execution is recovered on its own, at once, while its sibling still runs elsewhere
(the barrier is delivery's, I3), and a worker that restarts under its stable name takes back
its previous process's work at boot, without waiting for the lease (models.worker).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers import executions_of, wait_until
from tests.types import StackFactory

pytestmark = [pytest.mark.crash, pytest.mark.timeout(150)]

MAIN = "main agent"
CHILD_WAIT_SECONDS = 15


def script(wait: float = CHILD_WAIT_SECONDS) -> list[dict]:  # type: ignore[type-arg]
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
            "reply": {"tool_calls": [{"name": "wait", "arguments": {"seconds": wait}}]},
        },
        {"when": {"system_contains": "subagent", "last_role": "tool"}, "reply": {"content": "child answer"}},
    ]


def _owners(sid: int) -> dict[int, str | None]:
    return {e.id: e.lease_owner for e in executions_of(sid) if e.status == "RUNNING" and e.epoch >= 1}


@pytest.mark.parametrize("same_name", [True, False], ids=["restarted_same_name", "other_worker"])
def test_a_dead_child_is_recovered_while_its_sibling_still_runs(stack_factory: StackFactory, same_name: bool) -> None:
    stack = stack_factory(script())
    workers = {"wa": stack.worker("wa", concurrency=1), "wb": stack.worker("wb", concurrency=1, beat=True)}
    sid = stack.submit("go")
    wait_until(
        lambda: len(o := _owners(sid)) == 2 and all(o.values()) and len(set(o.values())) == 2,
        timeout=30,
        what="one child on each single-slot worker",
    )
    owners = _owners(sid)
    dead_eid = next(eid for eid, o in owners.items() if o and o.startswith("wa@"))
    live_eid = next(eid for eid in owners if eid != dead_eid)
    first_epoch = next(e.epoch for e in executions_of(sid) if e.id == dead_eid)
    live_epoch = next(e.epoch for e in executions_of(sid) if e.id == live_eid)
    workers["wa"].kill()
    killed = time.monotonic()
    stack.worker("wa" if same_name else "wc", concurrency=1)
    # The replacement's own boot (1-2 s on a quiet machine, 5-10 s beside other suites) is not
    # what is measured: the bounds below start when it is ready, as if it had booted at once.
    boot = time.monotonic() - killed

    def resumed() -> bool:
        # The scan's reservation is epoch + 1, the recovery's take epoch + 2. The recovered child
        # may end at once (its round journal says its `wait` was interrupted, and a tool that is
        # neither read-only nor idempotent is not run again), so its lease can be gone already.
        e = next(e for e in executions_of(sid) if e.id == dead_eid)
        return e.epoch >= first_epoch + 2 and (e.lease_owner is not None or e.status == "COMPLETED")

    wait_until(resumed, timeout=CHILD_WAIT_SECONDS - 3, interval=0.1, what="the dead child resumed")
    took = time.monotonic() - killed - boot
    live = next(e for e in executions_of(sid) if e.id == live_eid)
    assert live.status == "RUNNING" and live.lease_owner is not None  # the sibling is still working
    # LEASE_SECONDS=3, SCAN_INTERVAL_SECONDS=2 in the stack: a restart under the same name does
    # not wait for the lease; another worker's scan waits for it (and one scan interval) only.
    assert took < (3.0 if same_name else 3 + 2 * 2 + 2), f"resumed {took:.1f}s after the kill (+ {boot:.1f}s boot)"
    snap = stack.wait_phase(sid, timeout=90)
    execs = executions_of(sid)
    assert {(e.status, e.delivery_status) for e in execs} == {("COMPLETED", "DELIVERED")}
    assert [m["role"] for m in snap["messages"]] == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    assert sum(1 for j in stack.model.journal() if j["rule"] == 0) == 1
    assert stack.invariants() == []
    final = {e.id: e for e in execs}
    # Only the dead child was taken over; its sibling ran to its end under its first owner.
    assert final[live_eid].epoch == live_epoch, "the live sibling was never taken over"
    assert final[dead_eid].epoch >= first_epoch + 2, "the dead child was taken over"


def test_children_whose_messages_were_lost_are_taken_back_when_their_creator_restarts(
    stack_factory: StackFactory,
) -> None:
    """The worker dies right after committing the round (its children were never sent, as when the
    broker lost it); restarted under its name with production leases (30 s), its boot takes
    the children's creation reservations back at once: no lease wait."""
    stack = stack_factory(script(wait=1))
    slow = {"LEASE_SECONDS": "30", "SCAN_INTERVAL_SECONDS": "30"}
    w1 = stack.worker("wz", concurrency=1, CRASH_POINT="delegate.after_create", **slow)
    sid = stack.submit("go")
    wait_until(lambda: w1.exited or "crash_point=delegate.after_create" in w1.log(), timeout=30, what="the crash")
    w1.kill()
    restarted = time.monotonic()
    stack.worker("wz", concurrency=2, **slow)
    snap = stack.wait_phase(sid, timeout=25)
    assert time.monotonic() - restarted < 20  # far below one 30 s lease
    assert {(e.status, e.delivery_status) for e in executions_of(sid)} == {("COMPLETED", "DELIVERED")}
    assert snap["messages"][-1]["role"] == "ASSISTANT"
    assert stack.invariants() == []


def test_a_worker_under_a_restarting_supervisor_comes_back_and_takes_its_work_back_at_boot(
    stack_factory: StackFactory, tmp_path: Path
) -> None:
    """docs/operations.md "Worker supervision": the runner restarts a worker that exits (here a shell loop,
    as `Restart=always` would); under its -n name the new process's boot takes the dead one's
    work back at once, with production leases (30 s)."""
    import os
    import signal
    import subprocess

    from devstack.processes import Service, Worker

    stack = stack_factory(script(wait=6))
    env = {**stack.env, "LEASE_SECONDS": "30", "SCAN_INTERVAL_SECONDS": "30"}
    worker_cmd = " ".join(Worker(env, tmp_path, name="ws", concurrency=2, pool="prefork").cmd)
    supervisor = Service(
        ["bash", "-c", f"while true; do {worker_cmd}; sleep 0.2; done"], env, tmp_path / "supervisor.log", None
    ).start()
    stack.workers.append(supervisor)
    try:
        wait_until(lambda: "event=worker_ready" in supervisor.log(), timeout=30, what="the supervised worker")
        sid = stack.submit("go")
        wait_until(lambda: len(_owners(sid)) == 2, timeout=30, what="both children running")
        assert supervisor.proc is not None
        (celery_pid,) = (
            int(p)
            for p in subprocess.run(
                ["pgrep", "-P", str(supervisor.proc.pid)], capture_output=True, text=True
            ).stdout.split()
        )
        subprocess.run(["pkill", "-9", "-P", str(celery_pid)], check=False)  # its pool processes
        os.kill(celery_pid, signal.SIGKILL)  # the worker dies; the supervisor lives on
        killed = time.monotonic()
        wait_until(lambda: supervisor.log().count("event=worker_ready") >= 2, timeout=30, what="restarted")
        snap = stack.wait_phase(sid, timeout=40)
        assert time.monotonic() - killed < 25  # below one 30 s lease: taken back at boot
        assert {(e.status, e.delivery_status) for e in executions_of(sid)} == {("COMPLETED", "DELIVERED")}
        assert snap["messages"][-1]["role"] == "ASSISTANT" and stack.invariants() == []
    finally:
        supervisor.kill()
