"""message: the history of a session; ``id`` order is history order."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, CheckConstraint, ForeignKey, Index, String, Text, false, text
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base, BigId, StrEnumType, UTCDateTime, check_in, utcnow
from models.enums import Role


class Message(Base):
    __tablename__ = "message"
    __table_args__ = (
        CheckConstraint(check_in("role", Role), name="role"),
        Index("ix_message_session_id_id", "session_id", "id"),
        # The console's timeline: a session's newest messages other than TOOL results, and a
        # count of the older ones, without reading the results (migration 0033).
        Index(
            "ix_message_session_heads",
            "session_id",
            "id",
            postgresql_where=text("role <> 'TOOL' AND deleted IS false"),
            sqlite_where=text("role <> 'TOOL' AND deleted IS false"),
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    session_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("agent_session.id"))
    role: Mapped[Role] = mapped_column(StrEnumType(Role))
    content: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: OpenAI tool_calls as JSON text, exactly as stored; old rows may hold malformed JSON.
    tool_calls: Mapped[str | None] = mapped_column(Text, nullable=True)
    tool_call_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    #: An ASSISTANT's fields of the provider's message that the client does not read itself
    #: (reasoning, thinking blocks, content parts), as sent: sent back with the message.
    provider_fields: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    #: An ASSISTANT answer the model did not finish: ``refusal``, ``content_filter``,
    #: ``truncated``, ``no_tool_calls`` (a ``FailureCode``); NULL for a whole answer.
    incomplete: Mapped[str | None] = mapped_column(String(32), nullable=True)
    #: For a delivered TOOL result: the child session that produced it.
    source_session_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    #: Logical delete (tail cleanup); deleted rows are never shown to a model.
    deleted: Mapped[bool] = mapped_column(Boolean, server_default=false(), default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
