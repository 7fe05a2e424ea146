"""pending_round: a parent's assistant tool-call round that waits for its children (docs/tables.md)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, ForeignKey, Index, Integer, Text, text, update
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, BigId, UTCDateTime, utcnow


class PendingRound(Base):
    """Written in the transaction that creates the round's children; closed by delivery.

    ``tool_calls`` is the OpenAI list as the model returned it (ids, names, argument strings);
    ``inline_results`` maps tool_call_id -> TOOL content for the non-delegate calls.
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
    #: Usage of the model call that produced this round (for the parent's counters).
    prompt_tokens: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    closed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


def close_open_round(s: Session, session_id: int) -> None:
    """Close the session's open round, if it has one (its parent is stopped: the round is never
    delivered)."""
    s.execute(
        update(PendingRound)
        .where(PendingRound.session_id == session_id, PendingRound.closed_at.is_(None))
        .values(closed_at=utcnow())
        .execution_options(synchronize_session=False)
    )
