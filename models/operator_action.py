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
    #: ``approve``, ``deny``, ``cancel``, ``redeliver``, ``sign_in``, ``sign_out``, ``budget_raise``.
    action: Mapped[str] = mapped_column(String(32))
    session_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    execution_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    call_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    #: The approval request's id, when there is one.
    request_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    #: The outcome's value (a decision's ``decided``, ``repeated``, ``conflict``, ``not_found``,
    #: ``refused``; an action's outcome as the console answers it, ``forbidden`` when the
    #: operator's role does not allow it; a sign-in's ``signed_in``, ``wrong_token``,
    #: ``throttled``, ``csrf``).
    outcome: Mapped[str] = mapped_column(String(32))
    #: The amount an action asked for (``budget_raise``: the tokens the tree's budget was
    #: raised by); NULL for the others.
    amount: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


def record(
    s: Session,
    *,
    actor: str,
    action: str,
    outcome: str,
    session_id: int | None = None,
    execution_id: int | None = None,
    call_id: str | None = None,
    request_id: int | None = None,
    amount: int | None = None,
) -> None:
    """One attempt, as one INSERT in the caller's transaction (the actor cut to the column). An
    execution's action is on its parent session too (``session_id`` read in the INSERT); an
    approval request's, on its session and call."""
    from models.approval import ApprovalRequest as R
    from models.execution import SubagentExecution as E

    on_session: Any = session_id
    on_call: Any = call_id
    if session_id is None and execution_id is not None:
        on_session = select(E.parent_session_id).where(E.id == execution_id).scalar_subquery()
    if session_id is None and call_id is None and request_id is not None:
        on_session = select(R.session_id).where(R.id == request_id).scalar_subquery()
        on_call = select(R.call_id).where(R.id == request_id).scalar_subquery()
    s.execute(
        insert(OperatorAction).values(
            actor=actor[:128],
            action=action,
            outcome=outcome[:32],
            session_id=on_session,
            execution_id=execution_id,
            call_id=on_call,
            request_id=request_id,
            amount=amount,
        )
    )


def record_now(**fields: Any) -> None:
    """``record`` in a transaction of its own (after the action's own)."""
    from models.db import transaction

    with transaction() as s:
        record(s, **fields)


def record_decision(
    actor: str, action: str, session_id: int, call_id: str, outcome: str, *, request_id: int | None = None
) -> None:
    """A decision's attempt in its own transaction, after the decision's (its outcome known)."""
    record_now(
        actor=actor, action=action, outcome=outcome, session_id=session_id, call_id=call_id, request_id=request_id
    )


def _row(r: OperatorAction) -> dict[str, Any]:
    return {
        "id": r.id,
        "at": r.at.isoformat(),
        "actor": r.actor,
        "action": r.action,
        "session_id": r.session_id,
        "execution_id": r.execution_id,
        "call_id": r.call_id,
        "request_id": r.request_id,
        "outcome": r.outcome,
        "amount": r.amount,
    }


def latest(s: Session, *, limit: int = 100, session_id: int | None = None) -> list[dict[str, Any]]:
    """The latest actions, newest first (those on one session with ``session_id``)."""
    A = OperatorAction
    stmt = select(A).order_by(A.id.desc()).limit(limit)
    if session_id is not None:
        stmt = stmt.where(A.session_id == session_id)
    return [_row(r) for r in s.execute(stmt).scalars()]


def attempts_on_call(s: Session, session_id: int, call_id: str) -> list[dict[str, Any]]:
    """Every recorded attempt on one call, oldest first."""
    A = OperatorAction
    rows = s.execute(select(A).where(A.session_id == session_id, A.call_id == call_id).order_by(A.at, A.id)).scalars()
    return [{"at": r.at.isoformat(), "actor": r.actor, "action": r.action, "outcome": r.outcome} for r in rows]
