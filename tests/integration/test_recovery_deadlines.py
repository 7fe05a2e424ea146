"""Deadlines with R6 and R22 (docs/fault-model.md): a recovered child keeps its absolute deadline
across restarts and local waiting, and is cancelled and delivered as timed out past it.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import update

from harness import presence
from models import (
    AgentSession,
    ExecutionMode,
    SubagentExecution,
    transaction,
)
from models.base import utcnow
from tests.helpers import (
    drive,
    executions_of,
    invariants,
    one_child_script,
    parent_yielded,
    rule_calls,
)
from tests.types import ModelFactory


@pytest.fixture(autouse=True)
def _db(db: str) -> None:
    pass


def test_r6_a_recovered_child_past_its_deadline_is_cancelled_and_delivered_as_timed_out(
    model_factory: ModelFactory, short_timeout: None
) -> None:
    model = model_factory(one_child_script({"tool_calls": [{"name": "wait", "arguments": {"seconds": 30}}]}))
    sid, _ = parent_yielded(model.base_url)
    started = time.monotonic()
    drive(model.base_url)
    elapsed = time.monotonic() - started
    (e,) = executions_of(sid)
    assert (e.status, e.delivery_status) == ("FAILED", "DELIVERED")
    assert "timed out" in e.result["error"]  # type: ignore[index]
    assert elapsed < 25  # the 30 s wait was cut at the deadline, not waited out
    assert invariants() == []


def test_r22_deadline_is_not_reset_by_restart_and_local_waiting_consumes_it(
    model_factory: ModelFactory,
    local_presence: None,
    short_timeout: None,
) -> None:
    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    with transaction() as s:  # it had run almost its whole budget before the crash
        from datetime import timedelta

        s.execute(
            update(SubagentExecution)
            .where(SubagentExecution.id == e.id)
            .values(started_at=e.started_at - timedelta(seconds=1.5))
        )
        s.execute(
            update(AgentSession).where(AgentSession.id == e.child_session_id).values(execution_mode=ExecutionMode.LOCAL)
        )
    presence.disconnect("cli")
    late = threading.Timer(1.5, presence.connect, args=("cli",))  # connects after the deadline
    late.start()
    try:
        drive(model.base_url)
    finally:
        # Never let the timer fire into the next test of this process (it would connect "cli"
        # there: a LOCAL child that should wait would run at once).
        late.join()
        presence.disconnect("cli")
    (done,) = executions_of(sid)
    assert (done.status, done.delivery_status) == ("FAILED", "DELIVERED")
    assert rule_calls(model, 2) == 0
    assert done.started_at == e.started_at - __import__("datetime").timedelta(seconds=1.5)  # never reset
    assert invariants() == []


def test_r6_recovery_long_after_the_crash_keeps_the_absolute_deadline(
    model_factory: ModelFactory, short_timeout: None
) -> None:
    """The crash was long ago: a deadline reset at recovery would let the (instant) child
    complete; the absolute deadline fails it without calling the model."""

    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    with transaction() as s:
        s.execute(
            update(SubagentExecution)
            .where(SubagentExecution.id == e.id)
            .values(started_at=e.started_at - timedelta(seconds=600))
        )
    drive(model.base_url)
    (done,) = executions_of(sid)
    assert (done.status, done.delivery_status) == ("FAILED", "DELIVERED")
    assert "timed out" in done.result["error"]  # type: ignore[index]
    assert rule_calls(model, 2) == 0  # the child's model was never called again
    assert invariants() == []


def test_r6_past_deadline_and_grace_a_live_lease_does_not_hold_the_execution(
    model_factory: ModelFactory, short_timeout: None
) -> None:
    """A stuck worker keeps renewing its lease: past deadline + cancel grace the scan takes it."""

    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    with transaction() as s:
        s.execute(
            update(SubagentExecution)
            .where(SubagentExecution.id == e.id)
            .values(
                started_at=e.started_at - timedelta(seconds=60),
                lease_owner="stuck-worker",
                lease_expires_at=utcnow() + timedelta(hours=1),
            )
        )
    drive(model.base_url, after_crash=False)  # nobody expires the lease: only the deadline path can
    (done,) = executions_of(sid)
    assert (done.status, done.delivery_status) == ("FAILED", "DELIVERED")
    assert "timed out" in done.result["error"]  # type: ignore[index]
    assert done.epoch > e.epoch  # the stuck worker is fenced
