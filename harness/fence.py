"""Fencing (docs/invariants.md, I6): every write of a running loop carries the epoch it was handed.

A fence is checked INSIDE each write transaction with one conditional UPDATE that also renews
the lease; when it does not land, LeaseLost is raised and the transaction rolls back, so a
paused or duplicate worker never writes. A heartbeat thread renews the lease between writes.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType

from sqlalchemy import select
from sqlalchemy.orm import Session

from harness.errors import Cancelled
from logfmt import log_event
from models import (
    ACTIVE_EXECUTION,
    STOPPED_PHASES,
    AgentSession,
    LeaseLost,
    Phase,
    SubagentExecution,
    lease,
    transaction,
)
from models.execution import fence_execution
from models.session import fence_session, renew_session_lease

log = logging.getLogger(__name__)

CANCEL_POLL_SECONDS = 0.5


@dataclass
class Fence:
    """Base: ``session_id`` is the session whose phase says "cancelled"."""

    session_id: int
    epoch: int
    lease_seconds: float
    lost: bool = False
    #: The owner was just checked when the fence is made: the first poll waits a period.
    _last_poll: float = field(default_factory=time.monotonic)
    _cancelled: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self, s: Session, *, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        raise NotImplementedError

    def renew(self) -> bool:
        raise NotImplementedError

    def _still_owned(self, s: Session) -> bool:
        raise NotImplementedError

    def raise_if_stopped(self) -> None:
        """Raises LeaseLost when this worker lost the row, Cancelled when the session was
        cancelled (``should_stop``); returns when the loop may go on."""
        if self.should_stop():
            if self.lost:
                raise LeaseLost()
            raise Cancelled()

    def should_stop(self) -> bool:
        """True when this worker lost the row or the session was cancelled (polled, throttled)."""
        if self.lost or self._cancelled:
            return True
        now = time.monotonic()
        with self._lock:
            if now - self._last_poll < CANCEL_POLL_SECONDS:
                return False
            self._last_poll = now
        with transaction() as s:
            phase = s.execute(select(AgentSession.phase).where(AgentSession.id == self.session_id)).scalar_one()
            owned = self._still_owned(s)
        if not owned:
            self.lost = True
        if phase == Phase.CANCELLED:
            self._cancelled = True
        return self.lost or self._cancelled


@dataclass
class SessionFence(Fence):
    """Fence of a NORMAL/SIDE_TASK loop: the session row's epoch."""

    def check(self, s: Session, *, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """Renew the lease inside the write's transaction, unless the session was cancelled.

        NOTE: the UPDATE locks the session row, so a concurrent cancel either landed before
        it (we raise Cancelled and roll the write back) or waits for our commit (the round
        came first). A cancelled parent never commits another round or creates children."""
        S = AgentSession
        if fence_session(s, self.session_id, epoch=self.epoch, lease_seconds=self.lease_seconds):
            return
        row = s.execute(select(S.epoch, S.phase).where(S.id == self.session_id)).one()
        if row.epoch == self.epoch and row.phase in STOPPED_PHASES:
            self._cancelled = True
            raise Cancelled(f"session {self.session_id} was stopped")
        self.lost = True
        raise LeaseLost(f"session {self.session_id}: epoch {self.epoch} is stale")

    def renew(self) -> bool:
        with transaction() as s:
            return renew_session_lease(s, self.session_id, self.epoch, self.lease_seconds)

    def _still_owned(self, s: Session) -> bool:
        epoch = s.execute(select(AgentSession.epoch).where(AgentSession.id == self.session_id)).scalar_one()
        return bool(epoch == self.epoch)


@dataclass
class ExecutionFence(Fence):
    """Fence of a child loop: the execution row's epoch (status must still be active)."""

    execution_id: int = 0

    def _update(self, s: Session, prompt_tokens: int, completion_tokens: int) -> bool:
        return fence_execution(
            s,
            self.execution_id,
            epoch=self.epoch,
            lease_seconds=self.lease_seconds,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )

    def check(self, s: Session, *, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        if not self._update(s, prompt_tokens, completion_tokens):
            self.lost = True
            raise LeaseLost(f"execution {self.execution_id}: epoch {self.epoch} is stale")

    def renew(self) -> bool:
        with transaction() as s:
            return self._update(s, 0, 0)

    def _still_owned(self, s: Session) -> bool:
        E = SubagentExecution
        row = s.execute(select(E.epoch, E.status).where(E.id == self.execution_id)).one()
        return bool(row.epoch == self.epoch and row.status in ACTIVE_EXECUTION)


class Heartbeat:
    """Renews the fence's lease every third of the lease; marks the fence lost when it fails."""

    def __init__(self, fence: Fence) -> None:
        self.fence = fence
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{fence.session_id}", daemon=True)

    def _run(self) -> None:
        interval = lease.renewal_seconds(self.fence.lease_seconds)
        while not self._stop.wait(interval):
            try:
                if not self.fence.renew():
                    self.fence.lost = True
                    log_event(log, "lease_lost", session_id=self.fence.session_id, epoch=self.fence.epoch)
                    return
            except Exception:  # a DB blip: try again next beat; the lease has slack
                log_event(log, "heartbeat_failed", logging.WARNING, exc_info=True, session_id=self.fence.session_id)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
