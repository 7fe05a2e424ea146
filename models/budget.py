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
    #: The session whose call holds it (its ``held_tokens``); None: held by the tree alone.
    session_id: int | None = None


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
    #: Reservations of calls whose reply was never stored (the worker died after reserving),
    #: moved here from ``reserved_tokens`` by the take that found them: charged, never returned.
    estimated_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"), default=0)
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
            "SELECT b.root_session_id, b.budget_tokens, b.spent_tokens, b.reserved_tokens, b.estimated_tokens"
            " FROM agent_session a JOIN tree_budget b ON b.root_session_id = a.budget_root_id WHERE a.id = :sid"
        ),
        {"sid": session_id},
    ).one_or_none()
    if row is None:
        return None
    keys = ("root_session_id", "tokens", "spent", "reserved", "estimated")
    return {k: int(v) for k, v in zip(keys, row, strict=True)}


#: The tree's reservation and the calling session's ``held_tokens``, one statement: the session
#: row moves only when the tree's conditional UPDATE landed (its rowcount is the answer).
_RESERVE_HELD = text(
    "WITH granted AS (UPDATE tree_budget SET reserved_tokens = reserved_tokens + :r"
    " WHERE root_session_id = :root AND spent_tokens + reserved_tokens + estimated_tokens + :r <= budget_tokens"
    " RETURNING 1)"
    " UPDATE agent_session SET held_tokens = held_tokens + :r WHERE id = :sid AND EXISTS (SELECT 1 FROM granted)"
)


def reserve(s: Session, root_session_id: int, tokens: int, *, session_id: int | None = None) -> bool:
    """Reserve ``tokens`` of the tree's budget for one model call of ``session_id`` (held on its
    row until settled: ``held_tokens``), one statement. False, and nothing written, when the
    reservation would take the tree past its budget (or the tree has no budget row)."""
    params = {"r": tokens, "root": root_session_id, "sid": session_id}
    if session_id is not None and s.get_bind().dialect.name == "postgresql":
        return bool(cast(Any, s.execute(_RESERVE_HELD, params)).rowcount)
    rows = cast(
        Any,
        s.execute(
            text(
                "UPDATE tree_budget SET reserved_tokens = reserved_tokens + :r WHERE root_session_id = :root"
                " AND spent_tokens + reserved_tokens + estimated_tokens + :r <= budget_tokens"
            ),
            params,
        ),
    ).rowcount
    if rows and session_id is not None:  # SQLite has no data-modifying WITH: two statements
        s.execute(text("UPDATE agent_session SET held_tokens = held_tokens + :r WHERE id = :sid"), params)
    return bool(rows)


def release(s: Session, root_session_id: int, tokens: int, *, session_id: int | None = None) -> None:
    """Return a reservation whose call stored no reply (the provider failed)."""
    params = {"r": tokens, "root": root_session_id, "sid": session_id}
    s.execute(
        text("UPDATE tree_budget SET reserved_tokens = reserved_tokens - :r WHERE root_session_id = :root"), params
    )
    if session_id is not None:
        s.execute(_UNHOLD, params)


_UNHOLD = text(
    "UPDATE agent_session SET held_tokens = CASE WHEN held_tokens > :r THEN held_tokens - :r ELSE 0 END WHERE id = :sid"
)


def charge_estimated(s: Session, *, session_id: int, execution_id: int | None, root_session_id: int, held: int) -> bool:
    """In the transaction of a take that found ``held`` (> 0) on the session: the call that
    reserved it died before its reply was stored. Its reservation stays charged, as
    ``estimated`` (tree_budget), and one ``model_call_usage`` row says so. False, nothing
    written, when the session no longer holds exactly ``held`` (another take charged it).

    NOTE: a take is fenced (its epoch moved), so the dead call's own transaction cannot store its
    reply after this: the reservation is charged once, as estimated or as spent, never both."""
    rows = cast(
        Any,
        s.execute(
            text("UPDATE agent_session SET held_tokens = 0 WHERE id = :sid AND held_tokens = :held"),
            {"sid": session_id, "held": held},
        ),
    ).rowcount
    if not rows:
        return False
    s.execute(
        text(
            "UPDATE tree_budget SET"
            " reserved_tokens = CASE WHEN reserved_tokens > :held THEN reserved_tokens - :held ELSE 0 END,"
            " estimated_tokens = estimated_tokens + :held WHERE root_session_id = :root"
        ),
        {"held": held, "root": root_session_id},
    )
    from models.usage import record_usage

    record_usage(
        s,
        session_id=session_id,
        execution_id=execution_id,
        model=None,
        prompt_tokens=0,
        completion_tokens=0,
        cached_tokens=0,
        reasoning_tokens=0,
        estimated_tokens=held,
    )
    return True


#: The usage INSERT with the reservation's settlement, one statement (PostgreSQL's
#: data-modifying WITH): the hot path pays no extra trip for the settlement.
_SETTLE_AND_RECORD = text(
    "WITH settled AS (UPDATE tree_budget SET reserved_tokens = reserved_tokens - :reserved,"
    " spent_tokens = spent_tokens + :prompt_tokens + :completion_tokens"
    " WHERE root_session_id = :root RETURNING 1),"
    " unheld AS (UPDATE agent_session"
    " SET held_tokens = CASE WHEN held_tokens > :reserved THEN held_tokens - :reserved ELSE 0 END"
    " WHERE id = :session_id RETURNING 1)"
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
        s.execute(_UNHOLD, {"r": reserved, "sid": usage["session_id"]})
        record_usage(s, **usage)
        return
    s.execute(_SETTLE_AND_RECORD, {**usage, "created_at": utcnow(), "root": root_session_id, "reserved": reserved})
