"""tree_budget: a budget per agent tree, in tokens, USD and model calls (any of the three),
drawn on by every model call of the tree (docs/usage.md, "Budgets").

Before each model call of a budgeted tree, ``reserve`` takes an estimate with ONE conditional
UPDATE that lands only while, for each kind the tree limits, ``spent + reserved + estimated +
estimate <= budget`` (a model call counts 1 of ``budget_model_calls``); the same statement
holds the estimate on the calling session (``agent_session.held_tokens``/``held_usd``). The
reply's transaction settles it (``settle_and_record``: the reservation returns, the provider's
figure is spent) in the same statement that records the call's usage. A call whose reply is
never stored (the worker died after the provider answered) stays held on its session: the next
take charges it as estimated (``charge_estimated``); the books never undercount. Parallel calls
overshoot the budget by at most the reservations in flight."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_UP, Decimal
from enum import StrEnum
from typing import Any, cast

from sqlalchemy import BigInteger, ForeignKey, Integer, column, text, update
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import USD, Base, UTCDateTime, utcnow
from models.session import AgentSession

#: The completion a model call reserves when its agent sets no ``max_tokens`` /
#: ``max_completion_tokens`` (its prompt's estimate is added: harness.loop.reservation_tokens).
DEFAULT_RESERVATION_TOKENS = 4096
#: The prompt's estimate: characters of its messages' text per token (a rough English average;
#: the reply settles to the provider's own count).
CHARS_PER_TOKEN = 4


def _bound(s: Session, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` as the database's driver takes them: SQLite's has no Decimal (floats there)."""
    if s.get_bind().dialect.name == "postgresql":
        return params
    return {k: float(v) if isinstance(v, Decimal) else v for k, v in params.items()}


def usd(value: float) -> Decimal:
    """A USD amount as the database keeps it (nine decimals)."""
    return Decimal(f"{value:.9f}")


_usd = usd  #: for functions whose ``usd`` parameter hides the helper


@dataclass(frozen=True)
class Reservation:
    """What one model call holds of its tree's budget until its reply settles it."""

    root_session_id: int
    tokens: int
    #: The session whose call holds it (its ``held_tokens``); None: held by the tree alone.
    session_id: int | None = None
    #: Its USD estimate (0 without a price for the model: models.prices).
    usd: Decimal = Decimal(0)
    #: The model the call asked for (its price settles the reply when the provider names none).
    model: str | None = None
    #: For a capped child (``child_budget``): what was left of its allocation when the call
    #: reserved (the reservation itself is held on the session only: the allocation is already in
    #: the tree's ``reserved_tokens``). None: not capped, the tokens were added to the tree's.
    cap_left: int | None = None

    @property
    def tree_tokens(self) -> int:
        """What this reservation added to the tree's ``reserved_tokens``."""
        return self.tokens if self.cap_left is None else 0

    def from_allocation(self, spent: int) -> int:
        """What ``spent`` tokens of this call take out of the tree's ``reserved_tokens`` when they
        are settled (or estimated): the reservation itself, or for a capped child the part of its
        allocation they use (any excess is past the cap, counted in spent alone)."""
        return self.tokens if self.cap_left is None else min(spent, max(self.cap_left, 0))


@dataclass(frozen=True)
class BudgetLimits:
    """What a tree may spend; None: that kind is not limited. At least one is set."""

    tokens: int | None = None
    usd: float | None = None
    model_calls: int | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.tokens, self.usd, self.model_calls))


class TreeBudget(Base):
    __tablename__ = "tree_budget"

    #: The tree's root session; every session of the tree names it in ``budget_root_id``.
    root_session_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("agent_session.id"), primary_key=True)
    #: The tokens (prompt + completion) the tree may spend; NULL: not limited.
    budget_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    #: Tokens the provider reported for the tree's stored replies (settled reservations).
    spent_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"), default=0)
    #: Estimates of the model calls in flight (taken, not yet settled; a call whose reply was
    #: never stored stays here until a take of its session charges it as estimated).
    reserved_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"), default=0)
    #: Reservations of calls whose reply was never stored (the worker died after reserving),
    #: moved here from ``reserved_tokens`` by the take that found them: charged, never returned.
    estimated_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"), default=0)
    #: The USD the tree may spend (prices: MODEL_PRICES_FILE); NULL: not limited.
    budget_usd: Mapped[Decimal | None] = mapped_column(USD, nullable=True)
    spent_usd: Mapped[Decimal] = mapped_column(USD, server_default=text("0"), default=Decimal(0))
    reserved_usd: Mapped[Decimal] = mapped_column(USD, server_default=text("0"), default=Decimal(0))
    estimated_usd: Mapped[Decimal] = mapped_column(USD, server_default=text("0"), default=Decimal(0))
    #: The model calls the tree may make; NULL: not limited.
    budget_model_calls: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    #: Model calls reserved (stored, in flight, or estimated); a call that failed returns its count.
    model_calls: Mapped[int] = mapped_column(BigInteger, server_default=text("0"), default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


def open_budget(s: Session, root_session_id: int, limits: BudgetLimits | int) -> None:
    """Give the tree rooted at ``root_session_id`` (a session just created, with no child yet)
    ``limits`` (an int: a token budget), in the caller's transaction (the one that creates the
    session)."""
    if isinstance(limits, int):
        limits = BudgetLimits(tokens=limits)
    s.add(
        TreeBudget(
            root_session_id=root_session_id,
            budget_tokens=limits.tokens,
            budget_usd=None if limits.usd is None else usd(limits.usd),
            budget_model_calls=limits.model_calls,
        )
    )
    s.flush()
    s.execute(
        update(AgentSession)
        .where(AgentSession.id == root_session_id)
        .values(budget_root_id=root_session_id)
        .execution_options(synchronize_session=False)
    )


_BOOKS = (
    "root_session_id",
    "tokens",
    "spent",
    "reserved",
    "estimated",
    "usd",
    "spent_usd",
    "reserved_usd",
    "estimated_usd",
    "model_calls",
    "calls",
)


class RaiseOutcome(StrEnum):
    """How ``raise_budget`` ended."""

    RAISED = "raised"  #: the tree's budget is higher by the amounts asked for, in each kind it limits
    NO_BUDGET = "no_budget"  #: the session's tree has no budget, or limits none of the kinds named: nothing done
    NOT_FOUND = "not_found"  #: there is no such session: nothing done


#: The kinds a budget limits, as a budget request's arguments and ``budget raise`` name them.
KINDS = ("tokens", "usd", "model_calls")


def raise_budget(
    s: Session, session_id: int, tokens: int = 0, *, usd: Decimal | float = 0, model_calls: int = 0
) -> RaiseOutcome:
    """Raise the budget of the tree ``session_id`` belongs to by ``tokens``, ``usd`` and
    ``model_calls`` (0: that kind unchanged): ONE conditional UPDATE (the tree named by the
    session's ``budget_root_id``, limiting at least one kind named), whose rowcount says whether
    it landed. A kind the tree does not limit stays unlimited (NULL + n is NULL). Calls refused
    before it stay refused: a session that already ended ``budget_exhausted`` is not run again
    by this."""
    dollars = usd if isinstance(usd, Decimal) else _usd(usd)
    rows = cast(
        Any,
        s.execute(
            text(
                "UPDATE tree_budget SET budget_tokens = budget_tokens + :t, budget_usd = budget_usd + :u,"
                " budget_model_calls = budget_model_calls + :m"
                " WHERE root_session_id = (SELECT budget_root_id FROM agent_session WHERE id = :sid)"
                " AND ((:t > 0 AND budget_tokens IS NOT NULL) OR (:u > 0 AND budget_usd IS NOT NULL)"
                " OR (:m > 0 AND budget_model_calls IS NOT NULL))"
            ),
            _bound(s, {"t": tokens, "u": dollars, "m": model_calls, "sid": session_id}),
        ),
    ).rowcount
    if rows:
        return RaiseOutcome.RAISED
    found = s.execute(text("SELECT 1 FROM agent_session WHERE id = :sid"), {"sid": session_id}).first()
    return RaiseOutcome.NO_BUDGET if found else RaiseOutcome.NOT_FOUND


def shortfall(books: dict[str, Any], *, tokens: int, usd: Decimal, capped: bool = False) -> dict[str, int | float]:
    """What a refused call of ``tokens`` (and ``usd``, and one model call) needs, for each kind
    the tree limits that it did not fit (``books``: ``budget_of``'s, read after the refusal):
    the larger of the call's own share and what the tree lacks for it (more than the call's
    share only when the tree is already past its limit). ``capped``: the call was a capped
    child's, whose tokens are its allocation's, not the tree's (no ``tokens`` here). Empty
    when every kind the tree limits fits it now (a capped child refused by its cap alone)."""
    out: dict[str, int | float] = {}
    if not capped and books["tokens"] is not None:
        charged = books["spent"] + books["reserved"] + books["estimated"]
        if charged + tokens > books["tokens"]:
            out["tokens"] = max(tokens, charged + tokens - books["tokens"])
    if books["usd"] is not None:
        limit = Decimal(str(books["usd"]))
        charged_usd = sum((Decimal(str(books[k])) for k in ("spent_usd", "reserved_usd", "estimated_usd")), Decimal(0))
        if charged_usd + usd > limit:
            lacking = max(usd, charged_usd + usd - limit)
            out["usd"] = float(lacking.quantize(Decimal("0.000000001"), rounding=ROUND_UP))
    if books["model_calls"] is not None and books["calls"] + 1 > books["model_calls"]:
        out["model_calls"] = max(1, books["calls"] + 1 - books["model_calls"])
    return out


def budget_of(s: Session, session_id: int) -> dict[str, Any] | None:
    """The budget of the tree ``session_id`` belongs to, one query; None when its tree has no
    budget. Keys: ``root_session_id``, ``tokens`` (the token budget, None: not limited),
    ``spent``, ``reserved``, ``estimated`` (tokens); ``usd``, ``spent_usd``, ``reserved_usd``,
    ``estimated_usd`` (floats); ``model_calls`` (the calls budget) and ``calls`` (reserved)."""
    row = s.execute(
        text(
            "SELECT b.root_session_id, b.budget_tokens, b.spent_tokens, b.reserved_tokens, b.estimated_tokens,"
            " b.budget_usd, b.spent_usd, b.reserved_usd, b.estimated_usd, b.budget_model_calls, b.model_calls"
            " FROM agent_session a JOIN tree_budget b ON b.root_session_id = a.budget_root_id WHERE a.id = :sid"
        ),
        {"sid": session_id},
    ).one_or_none()
    if row is None:
        return None
    out: dict[str, Any] = {}
    for key, value in zip(_BOOKS, row, strict=True):
        if value is None:
            out[key] = None
        else:
            out[key] = float(value) if "usd" in key else int(value)
    return out


def spent_line(books: dict[str, Any]) -> str:
    """``budget_of``'s figures in words, each limited kind: ``4800 of 5000 tokens spent, 0
    reserved`` (``, N estimated`` when above 0), then ``$0.0140 of $0.0200 spent`` and ``3 of 3
    model calls``."""
    parts = []
    if books["tokens"] is not None:
        tokens = f"{books['spent']} of {books['tokens']} tokens spent, {books['reserved']} reserved"
        parts.append(tokens + (f", {books['estimated']} estimated" if books["estimated"] else ""))
    if books["usd"] is not None:
        parts.append(f"${books['spent_usd']:.4f} of ${books['usd']:.4f} spent, ${books['reserved_usd']:.4f} reserved")
    if books["model_calls"] is not None:
        parts.append(f"{books['calls']} of {books['model_calls']} model calls")
    return "; ".join(parts)


#: What a reservation must fit in: every kind the tree limits.
_FITS = (
    "(budget_tokens IS NULL OR spent_tokens + reserved_tokens + estimated_tokens + :r <= budget_tokens)"
    " AND (budget_usd IS NULL OR spent_usd + reserved_usd + estimated_usd + :usd <= budget_usd)"
    " AND (budget_model_calls IS NULL OR model_calls + 1 <= budget_model_calls)"
)
_TAKE = (
    "UPDATE tree_budget SET reserved_tokens = reserved_tokens + :r, reserved_usd = reserved_usd + :usd,"
    f" model_calls = model_calls + 1 WHERE root_session_id = :root AND {_FITS}"
)
#: The tree's reservation and the calling session's held estimate, one statement: the session
#: row moves only when the tree's conditional UPDATE landed (its rowcount is the answer).
_RESERVE_HELD = text(
    f"WITH granted AS ({_TAKE} RETURNING 1)"
    " UPDATE agent_session SET held_tokens = held_tokens + :r, held_usd = held_usd + :usd"
    " WHERE id = :sid AND EXISTS (SELECT 1 FROM granted)"
)
_HOLD = text("UPDATE agent_session SET held_tokens = held_tokens + :r, held_usd = held_usd + :usd WHERE id = :sid")
#: A capped child's reservation: its tokens must fit what is left of its allocation (already in
#: the tree's ``reserved_tokens``), its USD and model call the tree's limits. One statement; the
#: session row returns what was left of the allocation before this call.
_CAP_FITS = "EXISTS (SELECT 1 FROM agent_session WHERE id = :sid AND cap_used_tokens + held_tokens + :r <= cap_tokens)"
_TAKE_CAPPED = (
    "UPDATE tree_budget SET reserved_usd = reserved_usd + :usd, model_calls = model_calls + 1"
    " WHERE root_session_id = :root"
    " AND (budget_usd IS NULL OR spent_usd + reserved_usd + estimated_usd + :usd <= budget_usd)"
    f" AND (budget_model_calls IS NULL OR model_calls + 1 <= budget_model_calls) AND {_CAP_FITS}"
)
_RESERVE_CAPPED = text(
    f"WITH granted AS ({_TAKE_CAPPED} RETURNING 1)"
    " UPDATE agent_session SET held_tokens = held_tokens + :r, held_usd = held_usd + :usd"
    " WHERE id = :sid AND EXISTS (SELECT 1 FROM granted) RETURNING cap_tokens - cap_used_tokens"
)


def reserve(
    s: Session, root_session_id: int, tokens: int, *, session_id: int | None = None, usd: Decimal = Decimal(0)
) -> bool:
    """Reserve ``tokens`` (and ``usd``, and one model call) of the tree's budget for one model
    call of ``session_id`` (held on its row until settled), one statement. False, and nothing
    written, when the reservation would take the tree past any of its limits (or the tree has
    no budget row)."""
    params = _bound(s, {"r": tokens, "usd": usd, "root": root_session_id, "sid": session_id})
    if session_id is not None and s.get_bind().dialect.name == "postgresql":
        return bool(cast(Any, s.execute(_RESERVE_HELD, params)).rowcount)
    rows = cast(Any, s.execute(text(_TAKE), params)).rowcount
    if rows and session_id is not None:  # SQLite has no data-modifying WITH: two statements
        s.execute(_HOLD, params)
    return bool(rows)


_UNHOLD = text(
    "UPDATE agent_session SET held_tokens = CASE WHEN held_tokens > :r THEN held_tokens - :r ELSE 0 END,"
    " held_usd = CASE WHEN held_usd > :usd THEN held_usd - :usd ELSE 0 END WHERE id = :sid"
)


def reserve_capped(s: Session, root_session_id: int, tokens: int, *, session_id: int, usd: Decimal) -> int | None:
    """``reserve`` for a capped child (``child_budget``): one statement. Returns what was left
    of its allocation before this call, or None (nothing written) when the call does not fit its
    allocation or the tree's USD or model-call limits."""
    params = _bound(s, {"r": tokens, "usd": usd, "root": root_session_id, "sid": session_id})
    if s.get_bind().dialect.name == "postgresql":
        left = s.execute(_RESERVE_CAPPED, params).scalar()
        return None if left is None else int(left)
    if not cast(Any, s.execute(text(_TAKE_CAPPED), params)).rowcount:
        return None
    s.execute(_HOLD, params)
    left = s.execute(text("SELECT cap_tokens - cap_used_tokens FROM agent_session WHERE id = :sid"), params).scalar()
    return int(left or 0)


def allocate_child(s: Session, *, child_session_id: int, cap: int) -> int | None:
    """In the transaction that creates (or follows up) a child of a budgeted tree, whose parent's
    agent sets ``child_budget = { tokens = cap }``: set aside ``cap`` tokens of the tree's budget
    for it (fewer when less is left; all of ``cap`` when the tree limits no tokens), in the
    tree's ``reserved_tokens``, and cap the child there. Returns the allocation; None when the
    child's tree has no budget (nothing written). The tree row is locked for the read and the
    write (the delegating round's transaction: parent row, child rows, then the tree row)."""
    lock = " FOR UPDATE OF b" if s.get_bind().dialect.name == "postgresql" else ""
    row = s.execute(
        text(
            "SELECT b.root_session_id, b.budget_tokens, b.spent_tokens + b.reserved_tokens + b.estimated_tokens"
            " FROM tree_budget b JOIN agent_session a ON a.budget_root_id = b.root_session_id"
            f" WHERE a.id = :sid{lock}"
        ),
        {"sid": child_session_id},
    ).one_or_none()
    if row is None:
        return None
    root, budget, charged = int(row[0]), row[1], int(row[2])
    allocation = cap if budget is None else max(min(cap, int(budget) - charged), 0)
    s.execute(
        text("UPDATE tree_budget SET reserved_tokens = reserved_tokens + :a WHERE root_session_id = :root"),
        {"a": allocation, "root": root},
    )
    s.execute(
        text("UPDATE agent_session SET cap_tokens = :a, cap_used_tokens = 0 WHERE id = :sid"),
        {"a": allocation, "sid": child_session_id},
    )
    return allocation


def return_allocation(s: Session, *, child_session_id: int, root_session_id: int) -> None:
    """In the child's ending transaction: the part of its allocation it did not use goes back to
    the tree (``reserved_tokens``), and the child is capped no more. Nothing when it has no
    allocation (already returned: a second end returns nothing)."""
    s.execute(
        text(
            "UPDATE tree_budget SET reserved_tokens = reserved_tokens - (SELECT CASE WHEN cap_tokens > cap_used_tokens"
            " THEN cap_tokens - cap_used_tokens ELSE 0 END FROM agent_session WHERE id = :sid)"
            " WHERE root_session_id = :root"
            " AND EXISTS (SELECT 1 FROM agent_session WHERE id = :sid AND cap_tokens IS NOT NULL)"
        ),
        {"sid": child_session_id, "root": root_session_id},
    )
    s.execute(text("UPDATE agent_session SET cap_tokens = NULL WHERE id = :sid"), {"sid": child_session_id})


def release(s: Session, held: Reservation) -> None:
    """Return a reservation whose call stored no reply (the provider failed), its model call
    count too."""
    params = _bound(s, {"r": held.tokens, "usd": held.usd, "root": held.root_session_id, "sid": held.session_id})
    s.execute(
        text(
            "UPDATE tree_budget SET reserved_tokens = reserved_tokens - :tree_r, reserved_usd = reserved_usd - :usd,"
            " model_calls = model_calls - 1 WHERE root_session_id = :root"
        ),
        {**params, "tree_r": held.tree_tokens},
    )
    if held.session_id is not None:
        s.execute(_UNHOLD, params)


def charge_estimated(
    s: Session,
    *,
    session_id: int,
    execution_id: int | None,
    root_session_id: int,
    held: int,
    cap_left: int | None = None,
) -> bool:
    """In the transaction of a take that found ``held`` (> 0) tokens on the session: the call
    that reserved them died before its reply was stored. Its reservation stays charged, as
    ``estimated`` (tree_budget, tokens and USD), and one ``model_call_usage`` row says so.
    False, nothing written, when the session no longer holds exactly ``held`` (another take
    charged it).

    NOTE: a take is fenced (its epoch moved), so the dead call's own transaction cannot store its
    reply after this: the reservation is charged once, as estimated or as spent, never both."""
    held_usd = s.execute(text("SELECT held_usd FROM agent_session WHERE id = :sid"), {"sid": session_id}).scalar()
    rows = cast(
        Any,
        s.execute(
            text(
                "UPDATE agent_session SET held_tokens = 0, held_usd = 0"
                " WHERE id = :sid AND held_tokens = :held AND held_usd = :usd"
            ),
            _bound(s, {"sid": session_id, "held": held, "usd": held_usd}),
        ),
    ).rowcount
    if not rows:
        return False
    # ``cap_left``: a capped child's allocation left (its take's facts); the estimate comes out
    # of the allocation, and counts as used by the child.
    dead = Reservation(root_session_id, held, session_id, Decimal(str(held_usd or 0)), cap_left=cap_left)
    s.execute(
        text(
            "UPDATE tree_budget SET"
            " reserved_tokens = CASE WHEN reserved_tokens > :out THEN reserved_tokens - :out ELSE 0 END,"
            " reserved_usd = CASE WHEN reserved_usd > :usd THEN reserved_usd - :usd ELSE 0 END,"
            " estimated_tokens = estimated_tokens + :held, estimated_usd = estimated_usd + :usd"
            " WHERE root_session_id = :root"
        ),
        _bound(s, {"held": held, "out": dead.from_allocation(held), "usd": held_usd, "root": root_session_id}),
    )
    if cap_left is not None:
        s.execute(
            text("UPDATE agent_session SET cap_used_tokens = cap_used_tokens + :held WHERE id = :sid"),
            {"held": held, "sid": session_id},
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


#: The settlement of a reservation, as the two WITH entries of the statement that records the
#: call's usage (its parameters: ``settlement_params`` with the usage row's ``session_id``,
#: ``prompt_tokens`` and ``completion_tokens``): the tree's reserved tokens return and the
#: provider's figure is spent; the calling session's held tokens go.
_SETTLED = (
    "UPDATE tree_budget SET reserved_tokens = reserved_tokens - :from_reserved,"
    " spent_tokens = spent_tokens + :prompt_tokens + :completion_tokens,"
    " reserved_usd = reserved_usd - :reserved_usd, spent_usd = spent_usd + :spent_usd"
    " WHERE root_session_id = :root RETURNING 1"
)
_UNHELD = (
    "UPDATE agent_session"
    " SET held_tokens = CASE WHEN held_tokens > :reserved THEN held_tokens - :reserved ELSE 0 END,"
    " held_usd = CASE WHEN held_usd > :reserved_usd THEN held_usd - :reserved_usd ELSE 0 END,"
    " cap_used_tokens = cap_used_tokens + :cap_used WHERE id = :session_id RETURNING 1"
)

#: The usage INSERT with the reservation's settlement, one statement (PostgreSQL's
#: data-modifying WITH): the hot path pays no extra trip for the settlement.
_SETTLE_AND_RECORD = text(
    f"WITH settled AS ({_SETTLED}), unheld AS ({_UNHELD})"
    " INSERT INTO model_call_usage (session_id, execution_id, model, prompt_tokens, completion_tokens,"
    " cached_tokens, reasoning_tokens, created_at)"
    " VALUES (:session_id, :execution_id, :model, :prompt_tokens, :completion_tokens, :cached_tokens,"
    " :reasoning_tokens, :created_at)"
)


def settlement_ctes() -> tuple[Any, Any]:
    """The settlement as two WITH entries (``settled``, ``unheld``) for another statement to
    carry (PostgreSQL only; the parameters as for ``_SETTLE_AND_RECORD``)."""
    one = column("one", Integer)
    return (
        text(_SETTLED).columns(one).cte("settled"),
        text(_UNHELD).columns(one).cte("unheld"),
    )


def settlement_params(held: Reservation, spent_usd: Decimal, usage: dict[str, Any]) -> dict[str, Any]:
    """The settlement's parameters (beside the usage row's) for the reply whose ``usage`` row
    settles ``held`` at ``spent_usd``."""
    spent = usage["prompt_tokens"] + usage["completion_tokens"]
    return {
        "root": held.root_session_id,
        "reserved": held.tokens,
        "from_reserved": held.from_allocation(spent),
        "reserved_usd": held.usd,
        "spent_usd": spent_usd,
        "cap_used": 0 if held.cap_left is None else spent,
    }


def settle_and_record(s: Session, *, held: Reservation, spent_usd: Decimal, usage: dict[str, Any]) -> None:
    """Settle one call's reservation to the provider's figures (``spent_usd``: the reply's
    price) and record its usage row, in the caller's transaction (the one that stores the
    reply). SQLite has no data-modifying WITH: there, three statements."""
    spent = usage["prompt_tokens"] + usage["completion_tokens"]
    params = settlement_params(held, spent_usd, usage)
    if s.get_bind().dialect.name != "postgresql":
        from models.usage import record_usage

        s.execute(
            text(
                "UPDATE tree_budget SET reserved_tokens = reserved_tokens - :from_reserved,"
                " spent_tokens = spent_tokens + :spent, reserved_usd = reserved_usd - :reserved_usd,"
                " spent_usd = spent_usd + :spent_usd WHERE root_session_id = :root"
            ),
            _bound(s, {**params, "spent": spent}),
        )
        s.execute(_UNHOLD, _bound(s, {"r": held.tokens, "usd": held.usd, "sid": usage["session_id"]}))
        s.execute(
            text("UPDATE agent_session SET cap_used_tokens = cap_used_tokens + :cap_used WHERE id = :sid"),
            {**params, "sid": usage["session_id"]},
        )
        record_usage(s, **usage)
        return
    s.execute(_SETTLE_AND_RECORD, {**usage, **params, "created_at": utcnow()})
