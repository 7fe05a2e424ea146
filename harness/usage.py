"""Recording a model call's usage: one row per call whose reply is stored, in the transaction
that stores it (models.usage; docs/providers.md, "Usage"). Its callers hand only a reply fresh
from the provider: a round continued from the journal, or a child's end found committed
already, made no call and records nothing."""

from __future__ import annotations

from sqlalchemy.orm import Session

from harness.model import ModelReply
from models.usage import record_usage


def record_call(s: Session, session_id: int, reply: ModelReply, *, execution_id: int | None = None) -> None:
    """Insert ``reply``'s usage in the caller's transaction."""
    record_usage(
        s,
        session_id=session_id,
        execution_id=execution_id,
        model=reply.model,
        prompt_tokens=reply.prompt_tokens,
        completion_tokens=reply.completion_tokens,
        cached_tokens=reply.cached_tokens,
        reasoning_tokens=reply.reasoning_tokens,
    )
