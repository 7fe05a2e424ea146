"""What clients see: session snapshots and lists, with the external phase (RESUMING shown as
RUNNING, docs/state-machines.md). The `session show --json` shape is a public interface."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from harness.events import external_phase, publish_status
from harness.history import append_message, parse_tool_calls
from models import AgentSession, Message, Phase, Role, SessionType, SubagentExecution, lease, transaction
from models.base import utcnow
from models.budget import BudgetLimits, open_budget


def create_session(
    agent_type: str,
    text: str,
    *,
    user_id: str = "cli",
    budget_tokens: int | None = None,
    budget_usd: float | None = None,
    budget_model_calls: int | None = None,
    budget: BudgetLimits | None = None,
) -> int:
    """A NORMAL session with its first USER message, reserved for `agent.run(id, 0)`; with a
    budget (``budget``, or ``budget_tokens``/``budget_usd``/``budget_model_calls``; else the
    agent's ``budget``, if any), the root of a tree with those limits (models.budget), in the
    same transaction. A budget named here replaces the agent's whole."""
    from harness.agents import get_agent

    agent = get_agent(agent_type)
    now = utcnow()
    with transaction() as s:
        row = AgentSession(
            user_id=user_id,
            session_type=SessionType.NORMAL,
            agent_type=agent.name,
            execution_mode=agent.execution_mode,
            phase=Phase.RUNNING,
            started_at=now,
            updated_at=now,
            epoch=0,
            lease_owner=None,
            # A reservation for agent.run(sid, 0), still queued: models.lease's one rule.
            lease_expires_at=now + timedelta(seconds=lease.reservation_seconds()),
        )
        s.add(row)
        s.flush()
        append_message(s, row.id, Role.USER, text)
        limits = budget or BudgetLimits(budget_tokens, budget_usd, budget_model_calls)
        if not limits:
            limits = agent.budget  # the agent's own, for every tree rooted at it
        if limits or agent.child_budget_tokens is not None:
            # A cap per child needs the tree's books even when the tree itself is not limited.
            open_budget(s, row.id, limits)
        sid = row.id
    publish_status(sid, Phase.RUNNING)
    return sid


def _message(m: Message) -> dict[str, Any]:
    calls = parse_tool_calls(m.tool_calls)
    return {
        "id": m.id,
        "role": str(m.role),
        "content": m.content,
        "tool_calls": calls if isinstance(calls, list) else None,
        "tool_call_id": m.tool_call_id,
        "source_session_id": m.source_session_id,
        "incomplete": m.incomplete,
    }


def _execution(e: SubagentExecution) -> dict[str, Any]:
    return {
        "id": e.id,
        "status": str(e.status),
        "delivery_status": str(e.delivery_status),
        "child_session_id": e.child_session_id,
        "parent_tool_call_id": e.parent_tool_call_id,
        "invocation_type": None if e.invocation_type is None else str(e.invocation_type),
    }


def snapshot(s: Session, session_id: int) -> dict[str, Any] | None:
    row = s.execute(select(AgentSession).where(AgentSession.id == session_id)).scalar_one_or_none()
    if row is None:
        return None
    messages = s.execute(
        select(Message).where(Message.session_id == session_id, Message.deleted.is_(False)).order_by(Message.id)
    ).scalars()
    executions = s.execute(
        select(SubagentExecution)
        .where(SubagentExecution.parent_session_id == session_id)
        .order_by(SubagentExecution.id)
    ).scalars()
    return {
        "id": row.id,
        "phase": external_phase(row.phase),
        "session_type": str(row.session_type),
        "agent_type": row.agent_type,
        "parent_session_id": row.parent_session_id,
        "failure_code": row.failure_code,
        "failure_message": row.failure_message,
        "messages": [_message(m) for m in messages],
        "executions": [_execution(e) for e in executions],
        "approvals": _approvals(s, session_id),
        "release": _release(s, row),
    }


def release_list(s: Session) -> list[dict[str, Any]]:
    """Every release, oldest first, with its live sessions and those waiting for a worker of it
    and the workers alive now whose configuration it is (the ``releases --json`` shape, the
    console's releases page)."""
    from models.presence import alive_by_release
    from models.release import release_rows, waiting_for_release

    rows = release_rows(s)
    waiting = dict(waiting_for_release(s))
    workers = alive_by_release(s)
    return [
        {
            "id": int(r.id),
            "content_hash": str(r.content_hash),
            "created_at": r.created_at.isoformat(),
            "agents": sorted((r.definition or {}).get("agents", {})),
            "live_sessions": int(r.live),
            "waiting_for_worker": waiting.get(int(r.id), 0),
            "workers": workers.get(int(r.id), []),
        }
        for r in rows
    ]


def session_release(s: Session, session_id: int) -> dict[str, Any] | None:
    """``_release`` of one session by its id; None when there is no such session."""
    row = s.execute(select(AgentSession).where(AgentSession.id == session_id)).scalar_one_or_none()
    return None if row is None else _release(s, row)


def _release(s: Session, row: AgentSession) -> dict[str, Any]:
    """The session's release (docs/releases.md): its id, the target an operator moved its tree
    to (taken at its next round boundary), since when it waits for a worker of its release, and
    its tree's moves."""
    from models.release import moves_of

    return {
        "id": row.release_id,
        "target_id": row.release_target_id,
        "waiting_for_worker_since": row.release_wait_since.isoformat() if row.release_wait_since else None,
        "moves": moves_of(s, row.id),
    }


def _approvals(s: Session, session_id: int) -> list[dict[str, Any]]:
    """The session's approval requests: who asked for what, and who decided, when and why."""
    from models.approval import ApprovalRequest as A
    from models.approval import parsed

    rows = s.execute(select(A).where(A.session_id == session_id).order_by(A.id)).scalars()
    return [
        {
            "call_id": r.call_id,
            "tool": r.tool,
            "status": str(r.status),
            "requested_at": r.requested_at.isoformat(),
            "expires_at": r.expires_at.isoformat(),
            "decided_by": r.decided_by,
            "decided_at": r.decided_at.isoformat() if r.decided_at else None,
            "reason": r.reason,
            "edited_arguments": r.approved_arguments is not None,
            "arguments": parsed(r.arguments),
            "approved_arguments": parsed(r.approved_arguments),
        }
        for r in rows
    ]


def session_list(s: Session, limit: int = 50) -> list[dict[str, Any]]:
    rows = s.execute(select(AgentSession).order_by(AgentSession.id.desc()).limit(limit)).scalars()
    return [
        {
            "id": r.id,
            "phase": external_phase(r.phase),
            "session_type": str(r.session_type),
            "agent_type": r.agent_type,
            "parent_session_id": r.parent_session_id,
            "failure_code": r.failure_code,
        }
        for r in rows
    ]
