"""Recording a model call's usage: one row per call whose reply is stored, in the transaction
that stores it (models.usage; docs/providers.md, "Usage"). Its callers hand only a reply fresh
from the provider: a round continued from the journal, or a child's end found committed
already, made no call and records nothing."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from sqlalchemy.orm import Session

from harness.model import ModelReply
from models.budget import settle_and_record, usd
from models.prices import price_of
from models.usage import record_usage


def record_call(s: Session, session_id: int, reply: ModelReply, *, execution_id: int | None = None) -> None:
    """Insert ``reply``'s usage in the caller's transaction; a call of a budgeted tree also
    settles its reservation there, in the same statement (models.budget)."""
    usage: dict[str, Any] = {
        "session_id": session_id,
        "execution_id": execution_id,
        "model": reply.model[:128] if reply.model else None,
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "cached_tokens": reply.cached_tokens,
        "reasoning_tokens": reply.reasoning_tokens,
    }
    held = reply.reservation
    if held is None:
        record_usage(s, **usage)
        return
    price = price_of(reply.model) or price_of(held.model)
    spent = Decimal(0)
    if price is not None:
        spent = usd(
            price.usd(
                prompt_tokens=reply.prompt_tokens,
                cached_tokens=reply.cached_tokens,
                completion_tokens=reply.completion_tokens,
            )
        )
    settle_and_record(s, held=held, spent_usd=spent, usage=usage)
