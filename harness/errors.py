"""Errors of the agent runtime: one root, leaves named as facts; and the one boundary where
an infrastructure fault (database, Redis, broker) is told apart from a result."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from logfmt import log_event


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


class MaxRoundsReached(HarnessError):
    """The agent's max_rounds passed without a final answer."""


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
