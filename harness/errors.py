"""Errors of the agent runtime: one root, leaves named as facts; and the one boundary where
an infrastructure fault (database, Redis, broker) is told apart from a result."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from logfmt import log_event

log = logging.getLogger(__name__)
T = TypeVar("T")


class HarnessError(Exception):
    """The agent runtime could not do what was asked."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class BoundaryInvalid(HarnessError):
    """The compaction boundary is not a live message of this session."""


class ModelUnavailable(HarnessError):
    """The model endpoint could not be reached or answered with an error. ``transient``: an
    outage (unreachable, overloaded, a server error), not a refusal of this request.
    ``reason``: the failure code a session that ends on it records (docs/providers.md,
    "Failure reasons"); ``retry_after_seconds``: how long the provider asked us to wait, when
    that was longer than the client's own retries."""

    def __init__(
        self,
        message: str | None = None,
        *,
        code: str = "model_unavailable",
        transient: bool = False,
        reason: str | None = None,
        retry_after_seconds: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.transient = transient
        self.reason = reason or ("bad_response" if code == "bad_response" else "model_unavailable")
        self.retry_after_seconds = retry_after_seconds


class AgentConfigError(HarnessError):
    """The agent definitions are invalid."""


class UnknownAgent(HarnessError):
    """No agent definition has that name."""


class ToolError(HarnessError):
    """A tool failed; its message becomes the TOOL result."""


class Cancelled(HarnessError):
    """The session was cancelled."""


class DeadlineExceeded(HarnessError):
    """The absolute deadline of this execution has passed."""


class BudgetExhausted(HarnessError):
    """Raised when the tree's token budget refused a model call's reservation (docs/usage.md);
    ``tokens``: what the refused call would have reserved; ``needs``: per kind the tree limits
    and the call did not fit (``tokens``, ``usd``, ``model_calls``), what it lacks
    (models.budget.shortfall); empty when nothing a raise of the tree gives would let it run."""

    def __init__(self, message: str = "", *, tokens: int = 0, needs: dict[str, int | float] | None = None) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.needs: dict[str, int | float] = dict(needs or {})


class MaxRoundsReached(HarnessError):
    """The agent's max_rounds passed without a final answer."""


class ToolArgumentsRejected(HarnessError):
    """Raised when the model sent arguments a tool could not take in more rounds in a row than
    the tool's ``max_retries`` (docs/tools.md, "Arguments the model got wrong")."""


class RowBusy(HarnessError):
    """The row is busy: another operation held it through every attempt; try again shortly."""


#: SQLSTATE lock_not_available: the server cut a wait for a row lock (``lock_timeout``).
LOCK_NOT_AVAILABLE = "55P03"
#: An operator's action (a cancel, an approval decision) whose row lock wait was cut is tried
#: this many times in all, waiting BUSY_RETRY_SECONDS, then twice that, ... (with jitter) between.
BUSY_ATTEMPTS = 3
BUSY_RETRY_SECONDS = 0.25


def is_lock_timeout(exc: BaseException) -> bool:
    """True when ``exc`` (or what caused it) is the server cutting a wait for a row lock: the
    row is held by another path, the database is fine."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        orig = getattr(current, "orig", None)
        if (
            getattr(orig, "pgcode", None) == LOCK_NOT_AVAILABLE
            or getattr(current, "pgcode", None) == LOCK_NOT_AVAILABLE
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


def retry_while_busy(action: Callable[[], T], *, what: str, attempts: int = BUSY_ATTEMPTS) -> T:
    """``action()``, tried again while its wait for a row lock is cut (another path holds the
    row: a delivery, a loop's commit, a stalled transaction); raises RowBusy naming ``what``
    after ``attempts`` tries. Only for an action that is one transaction, or a compare-and-set
    whose repeat is a no-op: a cut wait rolled its transaction back."""
    for attempt in range(1, attempts + 1):
        try:
            return action()
        except Exception as exc:
            if not is_lock_timeout(exc):
                raise
            log_event(log, "operator_action_busy", logging.WARNING, what=what, attempt=attempt, attempts=attempts)
            if attempt == attempts:
                raise RowBusy(
                    f"{what} is busy: another operation held its row through {attempts} attempts; try again shortly"
                ) from exc
            time.sleep(BUSY_RETRY_SECONDS * 2 ** (attempt - 1) * random.uniform(0.5, 1.0))
    raise AssertionError("unreachable: attempts >= 1")


#: Driver errors that mean the statement itself is wrong (bad data, a broken constraint, SQL
#: that does not fit the schema): running it again fails again, so they end a run with a reason.
_DETERMINISTIC_DB = ("DataError", "IntegrityError", "ProgrammingError", "NotSupportedError")


def is_infrastructure_error(exc: BaseException) -> bool:
    """True for a CONNECTION-level fault of our own database, Redis or broker: never recorded as
    a result, the work is left to the scan. A statement that cannot succeed (DataError,
    IntegrityError, ProgrammingError) is not one: running it again fails again, so it ends the
    run with a reason. A lost lease (``LeaseLost``) is a fact about ownership, not a fault.

    Only exceptions raised by our own writes reach this question: an exception raised inside a
    user's tool is that call's TOOL result whatever its module (``harness.tools.registry``)."""
    from sqlalchemy import exc as sa_exc

    from models.errors import LeaseLost

    if isinstance(exc, HarnessError | LeaseLost):
        return False  # the model, a tool, the deadline: those are results; a lost lease stops
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, sa_exc.DataError | sa_exc.IntegrityError | sa_exc.ProgrammingError | sa_exc.NotSupportedError):
        return False
    if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError | sa_exc.TimeoutError):
        return True
    if isinstance(exc, sa_exc.InternalError | sa_exc.ResourceClosedError):
        return True  # e.g. "current transaction is aborted" after a cut, a closed cursor
    if _is_connection_fault(exc):
        return True
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_infrastructure_error(cause)


def _is_connection_fault(exc: BaseException) -> bool:
    """A driver's or a broker client's own connection error (raised outside SQLAlchemy)."""
    mod = type(exc).__module__
    name = type(exc).__name__
    if mod.startswith("psycopg2"):
        return name not in _DETERMINISTIC_DB and isinstance(exc, _psycopg2_connection_errors())
    if mod.startswith("redis"):
        import redis.exceptions as rx

        return isinstance(exc, rx.ConnectionError | rx.TimeoutError | rx.BusyLoadingError)
    if mod.startswith(("kombu", "amqp")):
        import amqp.exceptions as ax
        from kombu.exceptions import OperationalError as KombuOperationalError

        broker = (KombuOperationalError, ax.ConnectionError, ax.RecoverableConnectionError)
        return isinstance(exc, (*broker, ConnectionError, TimeoutError))
    return isinstance(exc, ConnectionError)  # the OS's: refused, reset, broken pipe


def _psycopg2_connection_errors() -> tuple[type[BaseException], ...]:
    import psycopg2

    return (psycopg2.OperationalError, psycopg2.InterfaceError, psycopg2.InternalError)


@dataclass
class InfrastructureFault:
    """What ``infrastructure_boundary`` stopped: false while the block has not hit a fault."""

    error: BaseException | None = None

    def __bool__(self) -> bool:
        return self.error is not None


@contextmanager
def infrastructure_boundary(
    log: logging.Logger, event: str, *, level: int = logging.WARNING, **fields: Any
) -> Iterator[InfrastructureFault]:
    """The one place an infrastructure error ends a task: it is logged as ``event`` (with
    ``fields`` and the error's type) and recorded in the yielded fault, never re-raised and
    never a result: the lease lapses and the scan resumes the work (docs/fault-model.md). Every other
    exception passes through, so a handler around the block sees only results and facts."""
    fault = InfrastructureFault()
    try:
        yield fault
    except Exception as exc:
        if not is_infrastructure_error(exc):
            raise
        fault.error = exc
        log_event(log, event, level, **fields, error=type(exc).__name__)
