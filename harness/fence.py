"""Fencing (docs/invariants.md, I6): every write of a running loop carries the epoch it was handed.

A fence is checked INSIDE each write transaction with one conditional UPDATE that also renews
the lease; when it does not land, LeaseLost is raised and the transaction rolls back, so a
paused or duplicate worker never writes. A heartbeat thread renews the lease between writes,
only while its holder makes progress: not while a database call of the holder's thread
(``models.db.CallClock``), or a poll of its fence on a tool's thread, has been in flight for half
a lease: a connection frozen in a live process lets the lease lapse, and the scan takes the
work back.
"""

from __future__ import annotations

import logging
import os
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
from models.db import CallClock, call_clock, loops_per_process
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
    #: Polls of ``should_stop`` in flight: thread id -> start (monotonic). A tool polls on its
    #: own thread for the holder, whose heartbeat counts the poll as the holder's work.
    _polls: dict[int, float] = field(default_factory=dict)

    def check(self, s: Session, *, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        raise NotImplementedError

    def renew(self) -> bool:
        raise NotImplementedError

    def _still_owned(self, s: Session) -> bool:
        raise NotImplementedError

    def oldest_poll_since(self) -> float:
        """When the oldest ``should_stop`` poll in flight began (monotonic); 0.0 when none is."""
        with self._lock:
            return min(self._polls.values(), default=0.0)

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
        me = threading.get_ident()
        with self._lock:
            self._polls[me] = now
        try:
            with transaction() as s:
                phase = s.execute(select(AgentSession.phase).where(AgentSession.id == self.session_id)).scalar_one()
                owned = self._still_owned(s)
        finally:
            with self._lock:
                del self._polls[me]
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


def _renew_once(fence: Fence) -> bool | None:
    """One renewal: True when it landed, False when the fence is lost (marked), None after a
    fault (a DB blip: the next beat tries again; the lease has slack)."""
    try:
        if fence.renew():
            return True
        fence.lost = True
        log_event(log, "lease_lost", session_id=fence.session_id, epoch=fence.epoch)
        return False
    except Exception:
        log_event(log, "heartbeat_failed", logging.WARNING, exc_info=True, session_id=fence.session_id)
        return None


def _beat(fence: Fence, calls: CallClock, stall: list[float]) -> bool | None:
    """One beat: a renewal (``_renew_once``), unless the holder's database work (its thread's
    ``calls``, or a poll of the fence on a tool's thread) has been in flight too long
    (``models.lease.stalled_call_seconds``): then None, nothing renewed, and
    ``lease_not_renewed`` logged once per stalled call (``stall`` holds the last one's start)."""
    since = min((t for t in (calls.since, fence.oldest_poll_since()) if t), default=0.0)
    in_flight = time.monotonic() - since if since else 0.0
    if in_flight <= lease.stalled_call_seconds(fence.lease_seconds):
        return _renew_once(fence)
    if stall[0] != since:
        stall[0] = since
        log_event(
            log,
            "lease_not_renewed",
            logging.WARNING,
            session_id=fence.session_id,
            epoch=fence.epoch,
            reason="call_in_flight",
            in_flight_seconds=round(in_flight, 1),
        )
    return None


class _Renewer:
    """A thread that renews one fence at a time and is kept for the next run of its process
    (``Heartbeat``): a thread started and joined for every run cost each child and parent run
    about 0.3-0.45 ms of wall and CPU (the start waits for the new thread to run, the join for
    it to end). Each fence held at a time has a renewer of its own, so one renewal that hangs
    on a frozen connection never delays another fence's."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._fence: Fence | None = None
        self._calls = CallClock()  #: the holder thread's (``hold``)
        self._stall = [0.0]  #: the start of the last stalled call logged
        self._interval = 0.0
        self._due = 0.0
        self._renewing = False
        self._quit = False
        threading.Thread(target=self._run, name="heartbeat", daemon=True).start()

    def hold(self, fence: Fence, calls: CallClock) -> None:
        """Renew ``fence`` every third of its lease from now on, while the holder's database
        work (``calls``, its thread's clock) makes progress."""
        with self._cond:
            self._fence = fence
            self._calls = calls
            self._interval = lease.renewal_seconds(fence.lease_seconds)
            self._due = time.monotonic() + self._interval
            self._cond.notify()

    def let_go(self, timeout: float) -> bool:
        """Renew no more; returns once a renewal in flight has ended: True, or False after
        ``timeout`` (the thread then ends after that renewal instead of being kept)."""
        end = time.monotonic() + timeout
        with self._cond:
            self._fence = None
            while self._renewing:
                left = end - time.monotonic()
                if left <= 0:
                    self._quit = True
                    return False
                self._cond.wait(left)
            return True

    def stop(self) -> None:
        with self._cond:
            self._quit = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._quit:
                fence = self._fence
                if fence is None:
                    self._cond.wait()
                    continue
                delay = self._due - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                calls = self._calls  # read with the fence, under the lock
                self._renewing = True
                self._cond.release()
                try:
                    outcome = _beat(fence, calls, self._stall)
                finally:
                    self._cond.acquire()
                    self._renewing = False
                    self._cond.notify_all()
                if self._fence is fence:  # still held (not let go, or held again, meanwhile)
                    if outcome is False:
                        self._fence = None
                    else:
                        self._due = time.monotonic() + self._interval


class _Renewers:
    """This process's idle renewers: at most ``KEEP``, or one per loop the process runs at once
    (a threads pool's concurrency, ``models.db.loops_per_process``); more are stopped."""

    KEEP = 8

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """None idle: at the start, and in a forked child (threads do not survive a fork)."""
        self._lock = threading.Lock()
        self._idle: list[_Renewer] = []

    def take(self) -> _Renewer:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Renewer()

    def give_back(self, renewer: _Renewer) -> None:
        keep = max(self.KEEP, loops_per_process())
        with self._lock:
            if len(self._idle) < keep:
                self._idle.append(renewer)
                return
        renewer.stop()


_renewers = _Renewers()
os.register_at_fork(after_in_child=_renewers.forget)


class Heartbeat:
    """Renews the fence's lease every third of the lease while the thread that enters it (the
    holder) makes progress (``_beat``); marks the fence lost when a renewal fails. On exit it
    renews no more, after a renewal in flight has ended (at most 5 s). Entered outside any
    transaction of the holder's thread: one open around the whole run would count as one call
    in flight from its start."""

    def __init__(self, fence: Fence) -> None:
        self.fence = fence
        self._renewer: _Renewer | None = None

    def __enter__(self) -> Heartbeat:
        self._renewer = _renewers.take()
        self._renewer.hold(self.fence, call_clock())
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is not None and renewer.let_go(timeout=5):
            _renewers.give_back(renewer)
