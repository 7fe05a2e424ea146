"""Row factories and bounded waits shared by the tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from models import (
    AgentSession,
    DeliveryStatus,
    ExecutionStatus,
    InvocationType,
    Phase,
    Role,
    SessionType,
    SubagentExecution,
    transaction,
)
from models.base import utcnow


def make_session(
    *,
    session_type: SessionType = SessionType.NORMAL,
    phase: Phase | None = Phase.RUNNING,
    agent_type: str = "main",
    parent_session_id: int | None = None,
    user_id: str = "u1",
    **extra: Any,
) -> int:
    with transaction() as s:
        row = AgentSession(
            user_id=user_id,
            session_type=session_type,
            parent_session_id=parent_session_id,
            agent_type=agent_type,
            phase=phase,
            started_at=utcnow(),
            updated_at=utcnow(),
            **extra,
        )
        s.add(row)
        s.flush()
        return row.id


def make_execution(
    parent_id: int,
    child_id: int | None = None,
    *,
    status: ExecutionStatus = ExecutionStatus.RUNNING,
    delivery: DeliveryStatus = DeliveryStatus.PENDING,
    tool_call_id: str | None = None,
    invocation: InvocationType | None = InvocationType.DELEGATE,
    agent_type: str = "reviewer",
    task: str = "review the change",
    started_ago_seconds: float = 0.0,
    **extra: Any,
) -> int:
    if child_id is None:
        child_id = make_session(
            session_type=SessionType.SUBAGENT, phase=None, agent_type=agent_type, parent_session_id=parent_id
        )
    with transaction() as s:
        row = SubagentExecution(
            parent_session_id=parent_id,
            child_session_id=child_id,
            agent_type=agent_type,
            task_description=task,
            status=status,
            delivery_status=delivery,
            invocation_type=invocation,
            parent_tool_call_id=tool_call_id,
            started_at=utcnow() - timedelta(seconds=started_ago_seconds),
            **extra,
        )
        s.add(row)
        s.flush()
        return row.id


def add_message(session_id: int, role: Role, content: str | None = "", **kw: Any) -> int:
    from harness.history import append_message

    with transaction() as s:
        return append_message(s, session_id, role, content, **kw).id


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05, what: str = "") -> Any:
    """Poll ``predicate`` until truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)
