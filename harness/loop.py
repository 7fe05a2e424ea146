"""What the parent loop (harness.parent) and the child loop (harness.child) share: the
scheduler they ask, their dependencies, the model call, one inline round, and the line
between a result and an infrastructure fault.

- A round without delegates commits one ASSISTANT + every TOOL in one transaction; its reply
  and its tools' starts and results are journaled before (harness.journal).
- Every write carries the epoch the loop was handed (harness.fence); cancellation is a phase
  change any process can request, honoured between rounds, inside ``wait`` and by the fence.
- An infrastructure error (database, broker, Redis) is never a result: the loop stops without
  writing, the lease lapses, and the scan resumes the work (docs/fault-model.md). Only the model, the
  tools and the deadline produce failure results.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness.agents import AgentDef
from harness.approval import Gate
from harness.errors import BudgetExhausted, DeadlineExceeded, ModelUnavailable, is_infrastructure_error
from harness.fence import Fence
from harness.history import Compaction, model_view
from harness.journal import RoundInFlight, commit_round, run_tools
from harness.model import ModelClient, ModelOptions, ModelReply
from harness.scheduler import Scheduler
from harness.tools import lookup
from logfmt import log_event
from models import lease, transaction
from models.base import utcnow
from models.budget import (
    CHARS_PER_TOKEN,
    DEFAULT_RESERVATION_TOKENS,
    Reservation,
    budget_of,
    release,
    reserve,
    reserve_capped,
    shortfall,
    spent_line,
    usd,
)
from models.prices import price_of
from models.worker import identity

log = logging.getLogger(__name__)


__all__ = ["LoopDeps", "Scheduler", "ask", "inline_round", "is_infrastructure_error", "model_messages", "worker_id"]


def worker_id() -> str:
    """The lease owner's name: the worker's stable boot name when it has one (models.worker),
    else a name unique to this process."""
    booted = identity()
    if booted is not None:
        return booted[0]
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass
class LoopDeps:
    scheduler: Scheduler
    model: ModelClient | None = None
    owner: str = ""
    lease_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.model = self.model or ModelClient.from_settings()
        self.owner = self.owner or worker_id()
        self.lease_seconds = self.lease_seconds or lease.lease_seconds()


def tool_specs(names: tuple[str, ...]) -> list[dict[str, Any]]:
    return [t.spec() for t in map(lookup, names) if t is not None]


def model_messages(
    session_id: int,
    agent: AgentDef,
    *,
    s: Session | None = None,
    compaction: Compaction | None = None,
    rows: Sequence[Any] | None = None,
) -> list[dict[str, Any]]:
    """The system prompt and the session's model view, in ``s`` when given (with the
    session's ``compaction`` and its live ``rows`` after the boundary when that transaction
    has read them: harness.history.model_view)."""
    if s is None:
        with transaction() as own:
            return model_messages(session_id, agent, s=own)
    return [{"role": "system", "content": agent.system_prompt}, *model_view(s, session_id, compaction, rows)]


def ask(
    deps: LoopDeps,
    messages: list[dict[str, Any]],
    *,
    tools: tuple[str, ...],
    deadline: datetime | None,
    options: ModelOptions | None = None,
    budget_root_id: int | None = None,
    session_id: int | None = None,
    capped: bool = False,
) -> ModelReply:
    """One model call. In a budgeted tree (``budget_root_id``: the session's
    ``agent_session.budget_root_id``) it first reserves its estimate of the tree's budget, one
    statement (models.budget.reserve); a refused reservation raises ``BudgetExhausted`` and
    calls no model. The reply carries its reservation, settled where the reply is stored."""
    timeout = None
    if deadline is not None:
        timeout = (deadline - utcnow()).total_seconds()
        if timeout <= 0:
            raise DeadlineExceeded()
    assert deps.model is not None
    held = None
    if budget_root_id is not None:
        model = (options.model if options else None) or deps.model.model
        held = _reserve(budget_root_id, options, messages, session_id=session_id, model=model, capped=capped)
    try:
        reply = deps.model.complete(messages, tool_specs(tools) or None, timeout=timeout, options=options)
    except ModelUnavailable:
        _give_back(held)
        if deadline is not None and utcnow() >= deadline:
            raise DeadlineExceeded() from None
        raise
    except BaseException:
        _give_back(held)
        raise
    # The provider answered; its reply is not stored yet. A worker that dies here leaves the
    # reservation held: the next take charges it as estimated (models.budget.charge_estimated).
    crash_point("model.after_reply")
    return reply if held is None else replace(reply, reservation=held)


def reservation_tokens(options: ModelOptions | None, messages: Sequence[dict[str, Any]] = ()) -> int:
    """What one model call reserves of its tree's budget: an estimate of the prompt (its
    messages' text at ``CHARS_PER_TOKEN``) plus the agent's completion limit
    (``max_completion_tokens``, else ``max_tokens``), else ``DEFAULT_RESERVATION_TOKENS``."""
    completion = DEFAULT_RESERVATION_TOKENS
    if options is not None and (options.max_completion_tokens or options.max_tokens):
        completion = int(options.max_completion_tokens or options.max_tokens or 0)
    chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    return chars // CHARS_PER_TOKEN + completion


def reservation_usd(options: ModelOptions | None, messages: Sequence[dict[str, Any]], model: str | None) -> Decimal:
    """The USD one model call reserves: the prompt's estimate at the model's input price and
    the completion limit at its output price (0 when the model has no price: models.prices)."""
    price = price_of(model)
    if price is None:
        return Decimal(0)
    total = reservation_tokens(options, messages)
    completion = reservation_tokens(options)
    return usd((total - completion) * price.input / 1e6 + completion * price.output / 1e6)


def _reserve(
    root_session_id: int,
    options: ModelOptions | None,
    messages: Sequence[dict[str, Any]],
    *,
    session_id: int | None,
    model: str | None,
    capped: bool = False,
) -> Reservation:
    tokens = reservation_tokens(options, messages)
    dollars = reservation_usd(options, messages, model)
    cap_left = None
    with transaction() as s:
        if capped and session_id is not None:
            cap_left = reserve_capped(s, root_session_id, tokens, session_id=session_id, usd=dollars)
            granted = cap_left is not None
        else:
            granted = reserve(s, root_session_id, tokens, session_id=session_id, usd=dollars)
        if not granted:
            log_event(log, "budget_exhausted", root_session_id=root_session_id, reservation=tokens)
            books = budget_of(s, root_session_id)  # the refusal's figures (failure path only)
            held = ""
            needs: dict[str, int | float] = {}
            if books is not None:
                held = ": " + spent_line(books)
                needs = shortfall(books, tokens=tokens, usd=dollars, capped=capped and session_id is not None)
            raise BudgetExhausted(
                f"the budget of this agent tree ran out{held} (a model call reserves {tokens} tokens)",
                tokens=tokens,
                needs=needs,
            )
    crash_point("budget.after_reserve")
    return Reservation(root_session_id, tokens, session_id, dollars, model, cap_left)


def _give_back(held: Reservation | None) -> None:
    """Return the reservation of a call that stored no reply. Best effort: when the database
    fails here the reservation stays charged (the books overcount, never under)."""
    if held is None:
        return
    try:
        with transaction() as s:
            release(s, held)
    except Exception as exc:
        if not is_infrastructure_error(exc):
            raise
        log_event(log, "budget_release_failed", logging.WARNING, root_session_id=held.root_session_id)


def inline_round(
    fence: Fence,
    *,
    session_id: int,
    rnd: RoundInFlight,
    allowed: tuple[str, ...],
    deadline: datetime | None,
    kind: str,
    approval: Gate | None = None,
) -> None:
    """Run (or take from the journal) every tool of a journaled round, then commit assistant +
    every TOOL in one transaction that also closes the journal entry (harness.journal).
    Raises ``harness.approval.AwaitingApproval`` when a call still waits for a decision."""
    results = run_tools(fence, session_id, rnd, allowed=allowed, deadline=deadline, kind=kind, approval=approval)
    commit_round(fence, session_id, rnd, results)
