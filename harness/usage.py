"""Recording a model call's usage: one row per call whose reply is stored, in the transaction
that stores it (models.usage; docs/providers.md, "Usage"). Its callers hand only a reply fresh
from the provider: a round continued from the journal, or a child's end found committed
already, made no call and records nothing."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from sqlalchemy.orm import Session

from harness.history import append_message, message_row
from harness.model import ModelReply
from models import Role
from models.base import utcnow
from models.budget import Reservation, settle_and_record, settlement_params, usd
from models.prices import price_of
from models.reply import insert_reply
from models.usage import record_usage


def record_call(s: Session, session_id: int, reply: ModelReply, *, execution_id: int | None = None) -> None:
    """Insert ``reply``'s usage in the caller's transaction; a call of a budgeted tree also
    settles its reservation there, in the same statement (models.budget)."""
    usage = _usage(session_id, reply, execution_id)
    held = reply.reservation
    if held is None:
        record_usage(s, **usage)
        return
    settle_and_record(s, held=held, spent_usd=_spent_usd(reply, held), usage=usage)


def append_reply(
    s: Session,
    session_id: int,
    reply: ModelReply,
    content: str,
    *,
    provider_fields: dict[str, Any] | None,
    execution_id: int | None = None,
    incomplete: str | None = None,
) -> int:
    """Store a fresh ``reply`` as the session's ASSISTANT message (``content``, the provider's
    own fields, the incomplete mark) and record its usage as ``record_call`` does, in the
    caller's transaction: on PostgreSQL in ONE statement (models.reply), elsewhere in two.
    Returns the message's id."""
    if s.get_bind().dialect.name != "postgresql":
        message_id = append_message(
            s, session_id, Role.ASSISTANT, content, provider_fields=provider_fields, incomplete=incomplete
        )
        record_call(s, session_id, reply, execution_id=execution_id)
        return message_id
    usage = _usage(session_id, reply, execution_id)
    usage["created_at"] = utcnow()
    held = reply.reservation
    message = message_row(session_id, Role.ASSISTANT, content, provider_fields=provider_fields, incomplete=incomplete)
    settlement = None if held is None else settlement_params(held, _spent_usd(reply, held), usage)
    return insert_reply(s, message=message, usage=usage, settlement=settlement)


def _usage(session_id: int, reply: ModelReply, execution_id: int | None) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "execution_id": execution_id,
        "model": reply.model[:128] if reply.model else None,
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "cached_tokens": reply.cached_tokens,
        "reasoning_tokens": reply.reasoning_tokens,
    }


def _spent_usd(reply: ModelReply, held: Reservation) -> Decimal:
    """The reply's price: the model it names, else the one the call asked for (0 unpriced)."""
    price = price_of(reply.model) or price_of(held.model)
    if price is None:
        return Decimal(0)
    return usd(
        price.usd(
            prompt_tokens=reply.prompt_tokens,
            cached_tokens=reply.cached_tokens,
            completion_tokens=reply.completion_tokens,
        )
    )
