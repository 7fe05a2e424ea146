"""tree_budget: a token budget per agent tree, drawn on by every model call of the tree
(docs/usage.md, "Budgets").

Before each model call of a budgeted tree, ``reserve`` takes an estimate with ONE conditional
UPDATE that lands only while ``spent + reserved + estimate <= budget``; the reply's transaction
settles it (``settle_and_record``: the reservation returns, the provider's figure is spent) in
the same statement that records the call's usage. A call whose reply is never stored (the worker
died after the provider answered) keeps its reservation charged: the books never undercount.
Parallel calls overshoot the budget by at most the reservations in flight."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import BigInteger, ForeignKey, text, update
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, UTCDateTime, utcnow
from models.session import AgentSession

#: The completion a model call reserves when its agent sets no ``max_tokens`` /
#: ``max_completion_tokens`` (its prompt's estimate is added: harness.loop.reservation_tokens).
DEFAULT_RESERVATION_TOKENS = 4096
#: The prompt's estimate: characters of its messages' text per token (a rough English average;
#: the reply settles to the provider's own count).
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class Reservation:
    """Tokens one model call holds of its tree's budget until its reply settles them."""

    root_session_id: int
    tokens: int


class TreeBudget(Base):
    __tablename__ = "tree_budget"

    #: The tree's root session; every session of the tree names it in ``budget_root_id``.
    root_session_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("agent_session.id"), primary_key=True)
    #: The tokens (prompt + completion) the tree may spend.
    budget_tokens: Mapped[int] = mapped_column(BigInteger)
    #: Tokens the provider reported for the tree's stored replies (settled reservations).
    spent_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"), default=0)
    #: Estimates of the model calls in flight (taken, not yet settled; a call whose reply was
    #: never stored stays here).
    reserved_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"), default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


def open_budget(s: Session, root_session_id: int, tokens: int) -> None:
    """Give the tree rooted at ``root_session_id`` (a session just created, with no child yet) a
    budget of ``tokens``, in the caller's transaction (the one that creates the session)."""
    s.add(TreeBudget(root_session_id=root_session_id, budget_tokens=tokens))
    s.flush()
    s.execute(
        update(AgentSession)
        .where(AgentSession.id == root_session_id)
        .values(budget_root_id=root_session_id)
        .execution_options(synchronize_session=False)
    )


def budget_of(s: Session, session_id: int) -> dict[str, int] | None:
    """The budget of the tree ``session_id`` belongs to (``root_session_id``, ``tokens``,
    ``spent``, ``reserved``), one query; None when its tree has no budget."""
    row = s.execute(
        text(
            "SELECT b.root_session_id, b.budget_tokens, b.spent_tokens, b.reserved_tokens"
            " FROM agent_session a JOIN tree_budget b ON b.root_session_id = a.budget_root_id WHERE a.id = :sid"
        ),
        {"sid": session_id},
    ).one_or_none()
    if row is None:
        return None
    return {"root_session_id": int(row[0]), "tokens": int(row[1]), "spent": int(row[2]), "reserved": int(row[3])}


def reserve(s: Session, root_session_id: int, tokens: int) -> bool:
    """Reserve ``tokens`` of the tree's budget for one model call. False, and nothing written,
    when the reservation would take the tree past its budget (or the tree has no budget row)."""
    rows = cast(
        Any,
        s.execute(
            text(
                "UPDATE tree_budget SET reserved_tokens = reserved_tokens + :r"
                " WHERE root_session_id = :root AND spent_tokens + reserved_tokens + :r <= budget_tokens"
            ),
            {"r": tokens, "root": root_session_id},
        ),
    ).rowcount
    return bool(rows)


def release(s: Session, root_session_id: int, tokens: int) -> None:
    """Return a reservation whose call stored no reply (the provider failed)."""
    s.execute(
        text("UPDATE tree_budget SET reserved_tokens = reserved_tokens - :r WHERE root_session_id = :root"),
        {"r": tokens, "root": root_session_id},
    )


#: The usage INSERT with the reservation's settlement, one statement (PostgreSQL's
#: data-modifying WITH): the hot path pays no extra trip for the settlement.
_SETTLE_AND_RECORD = text(
    "WITH settled AS (UPDATE tree_budget SET reserved_tokens = reserved_tokens - :reserved,"
    " spent_tokens = spent_tokens + :prompt_tokens + :completion_tokens"
    " WHERE root_session_id = :root RETURNING 1)"
    " INSERT INTO model_call_usage (session_id, execution_id, model, prompt_tokens, completion_tokens,"
    " cached_tokens, reasoning_tokens, created_at)"
    " VALUES (:session_id, :execution_id, :model, :prompt_tokens, :completion_tokens, :cached_tokens,"
    " :reasoning_tokens, :created_at)"
)


def settle_and_record(s: Session, *, root_session_id: int, reserved: int, usage: dict[str, Any]) -> None:
    """Settle one call's reservation to the provider's figures and record its usage row, in the
    caller's transaction (the one that stores the reply). SQLite has no data-modifying WITH:
    there, two statements."""
    if s.get_bind().dialect.name != "postgresql":
        from models.usage import record_usage

        s.execute(
            text(
                "UPDATE tree_budget SET reserved_tokens = reserved_tokens - :r,"
                " spent_tokens = spent_tokens + :spent WHERE root_session_id = :root"
            ),
            {"r": reserved, "spent": usage["prompt_tokens"] + usage["completion_tokens"], "root": root_session_id},
        )
        record_usage(s, **usage)
        return
    s.execute(_SETTLE_AND_RECORD, {**usage, "created_at": utcnow(), "root": root_session_id, "reserved": reserved})
