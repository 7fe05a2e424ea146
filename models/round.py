"""pending_round: a parent's assistant tool-call round that waits for its children (docs/tables.md)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, ForeignKey, Index, Integer, Text, bindparam, text, update
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, BigId, UTCDateTime, utcnow
from models.db import built_once, cas
from models.errors import IllegalTransition


class PendingRound(Base):
    """Written in the transaction that creates the round's children; closed by delivery, in
    the transaction that writes the round into the history (docs/exactly-once.md).

    ``tool_calls`` is the OpenAI list as the model returned it (ids, names, argument strings);
    ``inline_results`` maps tool_call_id -> TOOL content for the non-delegate calls;
    ``inline_started`` lists those whose start was committed under the parent's fence (None: a
    round written before starts were recorded, whose calls without a result are all in doubt).
    Executions point here through ``subagent_execution.pending_round_id``.
    """

    __tablename__ = "pending_round"
    __table_args__ = (
        # At most one open round per session: a parent waits for one round at a time.
        Index(
            "uq_pending_round_open",
            "session_id",
            unique=True,
            postgresql_where=text("closed_at IS NULL"),
            sqlite_where=text("closed_at IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    session_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("agent_session.id"))
    assistant_content: Mapped[str | None] = mapped_column(Text, nullable=True)
    tool_calls: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    inline_results: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    #: The reply's own fields besides content and tool calls (docs/providers.md), as sent.
    provider_fields: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    #: tool_call ids of the inline calls started (a start is committed before the call runs).
    inline_started: Mapped[list[str] | None] = mapped_column(JSON, nullable=True, default=list)
    #: Usage of the model call that produced this round (for the parent's counters).
    prompt_tokens: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    closed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


def start_inline(s: Session, round_id: int, started: list[str]) -> bool:
    """Record the round's started inline calls (``started``: every one so far, the new one
    last), in the caller's fenced transaction: the parent's fence is the only writer of an open
    round's inline calls, so the list it passes is the whole truth. False, nothing done: the
    round is closed (delivered, or its parent stopped)."""
    return cas(s, _start_inline_stmt(), {"b_round": round_id, "b_started": started}) == 1


@built_once
def _start_inline_stmt() -> Any:
    return (
        update(PendingRound)
        .where(PendingRound.id == bindparam("b_round"), PendingRound.closed_at.is_(None))
        .values(inline_started=bindparam("b_started", type_=JSON()))
        .execution_options(synchronize_session=False)
    )


def record_inline(s: Session, round_id: int, results: dict[str, str]) -> bool:
    """Record the round's inline results (``results``: every one so far: the refusals written
    with the round, then each call's result as it ends), in the caller's fenced transaction:
    the parent's fence is the only writer of an open round's inline results, so the map it
    passes is the whole truth (ONE conditional UPDATE, no read). False, nothing done: the round
    is closed (delivered, or its parent stopped)."""
    return cas(s, _record_inline_stmt(), {"b_round": round_id, "b_results": results}) == 1


@built_once
def _record_inline_stmt() -> Any:
    return (
        update(PendingRound)
        .where(PendingRound.id == bindparam("b_round"), PendingRound.closed_at.is_(None))
        .values(inline_results=bindparam("b_results", type_=JSON()))
        .execution_options(synchronize_session=False)
    )


def was_started(rnd: PendingRound, call_id: str) -> bool:
    """True when the inline call may have run: its start was committed, or the round was written
    before starts were recorded (``inline_started`` NULL)."""
    return rnd.inline_started is None or call_id in rnd.inline_started


def close_open_round(s: Session, session_id: int) -> None:
    """Close the session's open round, if it has one (its parent is stopped: the round is never
    delivered)."""
    s.execute(
        update(PendingRound)
        .where(PendingRound.session_id == session_id, PendingRound.closed_at.is_(None))
        .values(closed_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def close_round(s: Session, round_id: int) -> None:
    """Close a delivered round: open -> closed, ONE compare-and-set. The caller holds the
    round's row lock (it read the round FOR UPDATE and wrote it in this transaction), so it
    always lands; IllegalTransition (rolling the delivery back) when it does not: the round
    was closed by another path, and its results must not be written twice."""
    if cas(s, _close_stmt(), {"b_round": round_id, "b_now": utcnow()}) != 1:
        raise IllegalTransition(f"pending round {round_id} is closed already")


@built_once
def _close_stmt() -> Any:
    return (
        update(PendingRound)
        .where(PendingRound.id == bindparam("b_round"), PendingRound.closed_at.is_(None))
        .values(closed_at=bindparam("b_now"))
        .execution_options(synchronize_session=False)
    )


def close_rounds(s: Session, round_ids: list[int]) -> int:
    """Close several delivered rounds: open -> closed, ONE compare-and-set. Returns how many
    it closed: fewer than ``len(round_ids)`` means one was closed already, and the caller
    (which holds the rounds' locks) rolls back."""
    if not round_ids:
        return 0
    params: dict[str, Any] = {"b_now": utcnow(), **{f"r{i}": rid for i, rid in enumerate(round_ids)}}
    return cas(s, _close_many_stmt(len(round_ids)), params)


@built_once
def _close_many_stmt(n: int) -> Any:
    ids = [bindparam(f"r{i}", type_=BigInteger()) for i in range(n)]
    return (
        update(PendingRound)
        .where(PendingRound.id.in_(ids), PendingRound.closed_at.is_(None))
        .values(closed_at=bindparam("b_now"))
        .execution_options(synchronize_session=False)
    )
