"""model_call_usage: the provider's usage of every model call whose reply was stored, one row
per call, inserted in the transaction that stores the reply (docs/providers.md, "Usage"). A
round continued from the journal asks no model and adds no row; a failed call stores no reply
and adds none."""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, String, Table, insert, text
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, BigId, UTCDateTime, utcnow
from models.db import built_once


class ModelCallUsage(Base):
    __tablename__ = "model_call_usage"
    __table_args__ = (Index("ix_model_call_usage_session", "session_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    #: The session whose loop called the model (a child's session for a subagent).
    session_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("agent_session.id"))
    #: For a child: the execution the call was made for; NULL for a parent.
    execution_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    #: The model that answered, as the provider named it (NULL when it did not say).
    model: Mapped[str | None] = mapped_column(String(128), nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    #: Prompt tokens the provider served from its cache (part of ``prompt_tokens``).
    cached_tokens: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    #: Completion tokens spent on reasoning (part of ``completion_tokens``).
    reasoning_tokens: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


def record_usage(
    s: Session,
    *,
    session_id: int,
    execution_id: int | None,
    model: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    reasoning_tokens: int,
) -> None:
    """Insert one call's usage in the caller's transaction (the one that stores its reply)."""
    params: dict[str, Any] = {
        "session_id": session_id,
        "execution_id": execution_id,
        "model": model[:128] if model else None,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
        "reasoning_tokens": reasoning_tokens,
        "created_at": utcnow(),
    }
    s.execute(_insert_stmt(), params)


@built_once
def _insert_stmt() -> Any:
    return insert(cast(Table, ModelCallUsage.__table__))
