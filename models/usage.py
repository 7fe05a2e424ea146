"""model_call_usage: the provider's usage of every model call whose reply was stored, one row
per call, inserted in the transaction that stores the reply (docs/providers.md, "Usage"). A
round continued from the journal asks no model and adds no row; a failed call stores no reply
and adds none."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from enum import StrEnum
from typing import Any, cast

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, String, Table, case, func, insert, select, text
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, BigId, UTCDateTime, utcnow
from models.db import built_once
from models.prices import load_prices, price_of
from models.session import AgentSession


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
    #: A call whose reply was never stored (its worker died after reserving): the reservation it
    #: stays charged, its provider's figures unknown (0 above). 0 for a stored reply.
    estimated_tokens: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


#: The columns a stored reply's usage row is written with (``estimated_tokens`` keeps its 0).
USAGE_COLUMNS = (
    "session_id",
    "execution_id",
    "model",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "reasoning_tokens",
    "created_at",
)


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
    estimated_tokens: int = 0,
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
    if estimated_tokens:  # only an estimated call's row names it (the stored replies' shape stays)
        params["estimated_tokens"] = estimated_tokens
    s.execute(_insert_stmt(), params)


@built_once
def _insert_stmt() -> Any:
    return insert(cast(Table, ModelCallUsage.__table__))


@dataclass(frozen=True)
class UsageTotals:
    """Sums of the usage rows of a session or a tree, and how many model calls they count."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    model_calls: int = 0  #: calls whose reply was stored
    #: Reservations of calls whose reply was never stored (the worker died), charged as they were.
    estimated_tokens: int = 0
    estimated_calls: int = 0  #: how many such calls
    #: The stored replies' cost at MODEL_PRICES_FILE's prices (a model it does not name costs 0);
    #: None without a prices file (models.prices).
    usd: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __add__(self, other: UsageTotals) -> UsageTotals:
        counts = {f: getattr(self, f) + getattr(other, f) for f in _COUNTS}
        dollars = None if self.usd is None and other.usd is None else (self.usd or 0.0) + (other.usd or 0.0)
        return UsageTotals(**counts, usd=dollars)


#: The summed fields of UsageTotals, in the order the queries return them.
_COUNTS = (
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "reasoning_tokens",
    "model_calls",
    "estimated_tokens",
    "estimated_calls",
)


def _priced(model: str | None, counts: Sequence[Any]) -> UsageTotals:
    """One model's sums as totals, with their cost when a prices file is set."""
    totals = UsageTotals(*(int(v) for v in counts))
    if load_prices() is None:
        return totals
    price = price_of(model)
    dollars = 0.0
    if price is not None:
        dollars = price.usd(
            prompt_tokens=totals.prompt_tokens,
            cached_tokens=totals.cached_tokens,
            completion_tokens=totals.completion_tokens,
        )
    return replace(totals, usd=dollars)


def _fold(rows: Sequence[Any]) -> UsageTotals:
    """Rows of (model, sums...) folded into one total (zeros, and no USD, when there are none)."""
    out = UsageTotals(usd=None if load_prices() is None else 0.0)
    for row in rows:
        out = out + _priced(row[0], row[1:])
    return out


_SUMS = (
    "COALESCE(SUM(u.prompt_tokens), 0), COALESCE(SUM(u.completion_tokens), 0), "
    "COALESCE(SUM(u.cached_tokens), 0), COALESCE(SUM(u.reasoning_tokens), 0),"
    " COALESCE(SUM(CASE WHEN u.estimated_tokens = 0 THEN 1 ELSE 0 END), 0),"
    " COALESCE(SUM(u.estimated_tokens), 0), COALESCE(SUM(CASE WHEN u.estimated_tokens > 0 THEN 1 ELSE 0 END), 0)"
)


def session_usage(s: Session, session_id: int) -> UsageTotals:
    """The session's own model calls (not its children's): one query on the session index."""
    rows = s.execute(
        text(f"SELECT u.model, {_SUMS} FROM model_call_usage u WHERE u.session_id = :sid GROUP BY u.model"),
        {"sid": session_id},
    ).all()
    return _fold(rows)


def tree_usage(s: Session, root_id: int) -> UsageTotals:
    """The model calls of ``root_id`` and of every descendant (children, their children, ...):
    one recursive query down ``agent_session.parent_session_id``. For a root session this is
    the whole tree; for a child, its own subtree."""
    rows = s.execute(
        text(
            "WITH RECURSIVE tree(id) AS ("
            " SELECT CAST(:root AS BIGINT)"
            " UNION ALL"
            " SELECT c.id FROM agent_session c JOIN tree t ON c.parent_session_id = t.id)"
            f" SELECT u.model, {_SUMS} FROM model_call_usage u JOIN tree t ON u.session_id = t.id GROUP BY u.model"
        ),
        {"root": root_id},
    ).all()
    return _fold(rows)


class UsageGroup(StrEnum):
    """What `usage_by` groups the model calls by."""

    AGENT = "agent"  #: the agent type of the session that called the model
    USER = "user"  #: the session's user (a child's is its root's)
    MODEL = "model"  #: the model that answered, as the provider named it


@dataclass(frozen=True)
class GroupUsage:
    """One group's totals: ``key`` is the agent type, user or model (None: a model not named)."""

    key: str | None
    totals: UsageTotals


def usage_by(s: Session, *, by: UsageGroup, since: datetime | None = None) -> list[GroupUsage]:
    """Totals of every model call recorded at or after ``since`` (all of them when None), one
    per group, ordered by key; one query."""
    u, sess = ModelCallUsage, AgentSession
    key: Any = {UsageGroup.AGENT: sess.agent_type, UsageGroup.USER: sess.user_id, UsageGroup.MODEL: u.model}[by]
    stmt = select(
        key,
        u.model,
        func.coalesce(func.sum(u.prompt_tokens), 0),
        func.coalesce(func.sum(u.completion_tokens), 0),
        func.coalesce(func.sum(u.cached_tokens), 0),
        func.coalesce(func.sum(u.reasoning_tokens), 0),
        func.coalesce(func.sum(case((u.estimated_tokens == 0, 1), else_=0)), 0),
        func.coalesce(func.sum(u.estimated_tokens), 0),
        func.coalesce(func.sum(case((u.estimated_tokens > 0, 1), else_=0)), 0),
    ).select_from(u)
    if by is not UsageGroup.MODEL:
        stmt = stmt.join(sess, sess.id == u.session_id)
    if since is not None:
        stmt = stmt.where(u.created_at >= since)
    rows = s.execute(stmt.group_by(key, u.model).order_by(key)).all()
    groups: dict[str | None, list[Any]] = {}
    for row in rows:  # one row per (key, model): each model's tokens at its own price
        groups.setdefault(row[0], []).append(row[1:])
    return [GroupUsage(k, _fold(v)) for k, v in groups.items()]
