"""Cancellation with R15 and R21 (docs/fault-model.md): a cancelled parent is not recovered, its children end
cancelled and nothing is delivered to it, however many restarts follow.
"""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import select, update

from harness.cancel import cancel_session
from harness.delivery import deliver_round
from models import (
    AgentSession,
    Phase,
    SubagentExecution,
    transaction,
)
from recovery.child import recover_child
from recovery.scan import scan
from tests.helpers import (
    TWO,
    RecordingScheduler,
    drive,
    executions_of,
    expire_leases,
    invariants,
    loop_deps,
    messages_of,
    one_child_script,
    parent_yielded,
    phase_of,
    rule_calls,
)
from tests.types import ModelFactory


@pytest.fixture(autouse=True)
def _db(db: str) -> None:
    pass


def test_r15_parent_cancelled_before_recovery_is_not_started_and_children_end_cancelled(
    model_factory: ModelFactory,
) -> None:
    model = model_factory(TWO)
    sid, _ = parent_yielded(model.base_url)
    with transaction() as s:  # cancelled while the worker was down: only the phase changed
        s.execute(update(AgentSession).where(AgentSession.id == sid).values(phase=Phase.CANCELLED))
    drive(model.base_url)
    assert phase_of(sid) == Phase.CANCELLED
    assert {(e.status, e.delivery_status) for e in executions_of(sid)} == {("CANCELLED", "SUPPRESSED")}
    assert all(phase_of(e.child_session_id) == Phase.CANCELLED for e in executions_of(sid))
    assert [m.role for m in messages_of(sid)] == ["USER"]
    assert rule_calls(model, 1) == 0 and rule_calls(model, 2) == 0
    assert invariants() == []


def test_r21_a_cancelled_parent_stays_suppressed_across_two_restarts(model_factory: ModelFactory) -> None:
    model = model_factory(TWO)
    sid, _ = parent_yielded(model.base_url)
    cancel_session(sid)
    drive(model.base_url)
    with transaction() as s:
        first = [
            (e.id, e.epoch, e.status, e.delivery_status)
            for e in s.execute(select(SubagentExecution).order_by(SubagentExecution.id)).scalars()
        ]
    report = scan(RecordingScheduler(), callback_grace_seconds=0)  # second restart
    assert report.suppressed == [] and report.parents == []
    with transaction() as s:
        second = [
            (e.id, e.epoch, e.status, e.delivery_status)
            for e in s.execute(select(SubagentExecution).order_by(SubagentExecution.id)).scalars()
        ]
    assert first == second and {r[3] for r in second} == {"SUPPRESSED"}
    assert phase_of(sid) == Phase.CANCELLED
    assert invariants() == []


def test_a_parent_cancelled_during_recovery_gets_nothing_and_a_second_restart_leaves_it(
    model_factory: ModelFactory,
) -> None:
    model = model_factory(one_child_script({"tool_calls": [{"name": "wait", "arguments": {"seconds": 20}}]}))
    sid, _ = parent_yielded(model.base_url)
    expire_leases()
    sched = RecordingScheduler()
    deps = loop_deps(model.base_url, sched)
    scan(sched, callback_grace_seconds=0)
    ((_, epoch, children),) = sched.recoveries
    outcome: list[str] = []
    runner = threading.Thread(target=lambda: outcome.append(recover_child(*children[0], deps)))
    runner.start()
    from tests.helpers import wait_until

    wait_until(lambda: phase_of(executions_of(sid)[0].child_session_id) == Phase.RESUMING, timeout=10)
    started = time.monotonic()
    assert cancel_session(sid)[0]
    runner.join(15)
    assert not runner.is_alive() and time.monotonic() - started < 10  # the 20 s wait noticed the cancel
    assert outcome == ["lost"]  # fenced: the cancelled child wrote nothing more
    assert deliver_round(sid, epoch).kind == "suppressed"
    (e,) = executions_of(sid)
    assert (e.status, e.delivery_status) == ("CANCELLED", "SUPPRESSED")
    assert [m.role for m in messages_of(sid)] == ["USER"]
    before = (e.epoch, e.completed_at)
    expire_leases()
    second = scan(RecordingScheduler(), callback_grace_seconds=0)
    assert second.parents == [] and second.suppressed == [] and second.resumed_sessions == []
    (e2,) = executions_of(sid)
    assert (e2.epoch, e2.completed_at) == before and phase_of(sid) == Phase.CANCELLED
    assert rule_calls(model, 1) == 0
    assert invariants() == []
