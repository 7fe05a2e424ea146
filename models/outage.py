"""Sessions waiting for the model through a provider outage.

A model call that fails as an outage (unreachable, overloaded, a server error) after the
client's own retries ends the run WITHOUT a result: the session (a parent's) or the execution
(a child's) keeps its owner and epoch, and its lease is set to lapse after a back-off, so the
scan's ordinary step for dead work (a lapsed lease) resumes it then. The scan needs no rule of
its own. ``agent_session.model_outage_since`` says since when the session waits; the first
model answer clears it. Every helper is one statement; a compare-and-set says in its docstring
what "nothing done" means.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from models.base import utcnow
from models.db import cas
from models.enums import ACTIVE_EXECUTION, ACTIVE_PHASES
from models.execution import SubagentExecution
from models.session import AgentSession

S = AgentSession
E = SubagentExecution


def outage_since(s: Session, session_id: int) -> datetime | None:
    """When the session began waiting for the model; None when it is not waiting."""
    return s.execute(select(S.model_outage_since).where(S.id == session_id)).scalar_one_or_none()


def wait_session(s: Session, session_id: int, *, epoch: int, backoff_seconds: float) -> bool:
    """Mark the session waiting for the model (since now, unless it already was) and let its
    lease lapse ``backoff_seconds`` from now. False, nothing done: another epoch holds it."""
    now = utcnow()
    rows = cas(
        s,
        update(S)
        .where(S.id == session_id, S.epoch == epoch, S.lease_owner.is_not(None))
        .values(
            model_outage_since=func.coalesce(S.model_outage_since, now),
            lease_expires_at=now + timedelta(seconds=backoff_seconds),
        ),
    )
    return rows == 1


def wait_execution(s: Session, session_id: int, execution_id: int, *, epoch: int, backoff_seconds: float) -> bool:
    """Mark the child session waiting for the model and let its execution's lease lapse
    ``backoff_seconds`` from now. False, nothing done: the execution is not active at
    ``epoch`` any more (a newer owner, or it ended)."""
    now = utcnow()
    rows = cas(
        s,
        update(E)
        .where(E.id == execution_id, E.epoch == epoch, E.status.in_(ACTIVE_EXECUTION), E.lease_owner.is_not(None))
        .values(lease_expires_at=now + timedelta(seconds=backoff_seconds)),
    )
    if rows != 1:
        return False
    cas(
        s,
        update(S).where(S.id == session_id).values(model_outage_since=func.coalesce(S.model_outage_since, now)),
    )
    return True


def model_answered(s: Session, session_id: int) -> bool:
    """The model answered the session again: it no longer waits. False, nothing done: it was
    not waiting."""
    rows = cas(
        s,
        update(S).where(S.id == session_id, S.model_outage_since.is_not(None)).values(model_outage_since=None),
    )
    return rows == 1


def waiting_for_model(s: Session) -> int:
    """Active sessions waiting for the model (the partial index ix_agent_session_model_outage)."""
    return int(
        s.execute(
            select(func.count()).where(S.model_outage_since.is_not(None), S.phase.in_(ACTIVE_PHASES))
        ).scalar_one()
    )
