"""operator_action: what an operator asked for, and what it ended in (an audit trail).

One row per attempt, written after the attempt's own transaction: who (``actor``: the name an
operator decided under, ``console:<name>`` from the console), what (``action``), on what
(``session_id``, ``call_id``, ``request_id``), the outcome's value, and when (database time).
A decision that repeated the one that stands, or lost to it, changes nothing else, so this row
is the only trace of it (docs/console.md). Rows are never updated; no row is read on a round's
path. The detail holds no content: an outcome's words, never a tool's arguments or a reason.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Index, String, func, insert, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, BigId, UTCDateTime


class OperatorAction(Base):
    __tablename__ = "operator_action"
    __table_args__ = (
        # The attempts on one call or one session, in order (approvals show, the session's page).
        Index("ix_operator_action_target", "session_id", "call_id", "at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=func.now())
    #: Who asked: the decider's name as given (``--by``, ``console:<operator>``).
    actor: Mapped[str] = mapped_column(String(128))
    #: ``approve``, ``deny``.
    action: Mapped[str] = mapped_column(String(32))
    session_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    call_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    #: The approval request's id, when there is one.
    request_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    #: The outcome's value (``decided``, ``repeated``, ``conflict``, ``not_found``, ``refused``).
    outcome: Mapped[str] = mapped_column(String(32))


def record(
    s: Session,
    *,
    actor: str,
    action: str,
    outcome: str,
    session_id: int | None = None,
    call_id: str | None = None,
    request_id: int | None = None,
) -> None:
    """One attempt, as one INSERT in the caller's transaction (the actor cut to the column)."""
    s.execute(
        insert(OperatorAction).values(
            actor=actor[:128],
            action=action,
            outcome=outcome,
            session_id=session_id,
            call_id=call_id,
            request_id=request_id,
        )
    )


def record_decision(
    actor: str, action: str, session_id: int, call_id: str, outcome: str, *, request_id: int | None = None
) -> None:
    """A decision's attempt in its own transaction, after the decision's (its outcome known)."""
    from models.db import transaction

    with transaction() as s:
        record(
            s,
            actor=actor,
            action=action,
            outcome=outcome,
            session_id=session_id,
            call_id=call_id,
            request_id=request_id,
        )


def attempts_on_call(s: Session, session_id: int, call_id: str) -> list[dict[str, Any]]:
    """Every recorded attempt on one call, oldest first."""
    A = OperatorAction
    rows = s.execute(select(A).where(A.session_id == session_id, A.call_id == call_id).order_by(A.at, A.id)).scalars()
    return [{"at": r.at.isoformat(), "actor": r.actor, "action": r.action, "outcome": r.outcome} for r in rows]
