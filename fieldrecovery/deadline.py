"""The one total deadline of a field recovery, and the watchdog that enforces it on a stream.

Checking the clock between SSE events does not stop a read that is blocked in ``recv``, and
closing the response from another thread does not wake it (a socket read ignores both). What
does: per-read socket timeouts capped at the time left, plus a watchdog that shuts down
(``SHUT_RDWR``) every socket of the call, from the moment each is connected, and closes the
response at the deadline. The same watchdog stops the call early when its owner loses the
invocation's lease (``stop``).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Protocol

from fieldrecovery.errors import DeadlineExceeded

#: How often the watchdog looks at its stop event (a lost lease) while the call runs.
STOP_POLL_SECONDS = 0.05


class Deadline:
    """An absolute point on the monotonic clock, fixed once (claim to final result)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.seconds = seconds
        self.expires_at = clock() + seconds

    def remaining(self) -> float:
        return max(0.0, self.expires_at - self._clock())

    @property
    def expired(self) -> bool:
        return self._clock() >= self.expires_at

    def check(self) -> None:
        """Raise DeadlineExceeded when no time is left."""
        if self.expired:
            raise DeadlineExceeded()

    def cap(self, seconds: float) -> float:
        """``seconds`` capped at the time left (never below a tiny positive timeout)."""
        return max(0.001, min(seconds, self.remaining()))


def response_socket(response: Any) -> socket.socket | None:
    """The socket under a streaming ``requests`` response, when it still has one."""
    raw = getattr(response, "raw", None)
    connection = getattr(raw, "connection", None) or getattr(raw, "_connection", None)
    sock = getattr(connection, "sock", None)
    return sock if isinstance(sock, socket.socket) else None


class StopSignal(Protocol):
    """What the watchdog polls to stop early: a ``threading.Event`` or a lease's LeaseSignal."""

    def is_set(self) -> bool: ...


class StopReason(StrEnum):
    DEADLINE = "deadline"  #: the total deadline passed
    STOPPED = "stopped"  #: the caller's stop event was set (the owner lost its lease)


class Watchdog:
    """Fires once, at the deadline or when ``stop`` is set: shuts down every socket of the call.

    Sockets are handed over the moment they are connected (``watch_socket``, see transport.py),
    so a read blocked on the status line or the headers is woken as surely as one blocked inside
    the body. ``watch(response)`` also names the response being read, which is closed. ``fired``
    tells the reader that the error it sees was caused by the watchdog, ``reason`` why.
    """

    def __init__(self, deadline: Deadline, stop: StopSignal | None = None) -> None:
        self.deadline = deadline
        self.fired = threading.Event()
        self.reason: StopReason | None = None
        self._stop = stop
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._response: Any = None
        self._sockets: list[tuple[socket.socket, Any]] = []
        self._thread = threading.Thread(target=self._run, name="field-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=1)
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock, _ in sockets:
            sock.close()

    @property
    def stopped(self) -> bool:
        """True when the watchdog fired because of ``stop`` (not the deadline)."""
        return self.fired.is_set() and self.reason == StopReason.STOPPED

    def watch_socket(self, sock: socket.socket, owner: Any = None) -> None:
        """Watch a freshly connected socket (a dup of it: a TLS wrap detaches the original).

        ``owner`` is the connection object whose ``sock`` attribute holds the socket once it is
        set up (urllib3's connection). The dups of connections closed since (``owner.sock`` is
        None) are closed here, so a long call holds one descriptor per LIVE connection, not one
        per connection it ever made.
        """
        try:
            dup = sock.dup()
        except OSError:
            return
        with self._lock:
            closed = [d for d, o in self._sockets if o is not None and getattr(o, "sock", None) is None]
            self._sockets = [(d, o) for d, o in self._sockets if o is None or getattr(o, "sock", None) is not None]
            self._sockets.append((dup, owner))
        for old in closed:
            old.close()
        if self.fired.is_set():
            _shutdown(dup)

    @property
    def watched_sockets(self) -> int:
        """Descriptors held for the call's connections (for tests and diagnostics)."""
        with self._lock:
            return len(self._sockets)

    def watch(self, response: Any) -> None:
        with self._lock:
            self._response = response
        if self.fired.is_set():  # the watchdog fired while the request was being sent
            self._kill(response)

    def _run(self) -> None:
        while True:
            left = self.deadline.remaining()
            if left <= 0:
                self._fire(StopReason.DEADLINE)
                return
            if self._stop is not None and self._stop.is_set():
                self._fire(StopReason.STOPPED)
                return
            if self._done.wait(left if self._stop is None else min(left, STOP_POLL_SECONDS)):
                return

    def _fire(self, reason: StopReason) -> None:
        self.reason = reason
        self.fired.set()
        with self._lock:
            response = self._response
            sockets = [sock for sock, _ in self._sockets]
        for sock in sockets:
            _shutdown(sock)
        if response is not None:
            self._kill(response)

    @staticmethod
    def _kill(response: Any) -> None:
        sock = response_socket(response)
        if sock is not None:
            _shutdown(sock)
        try:
            response.close()
        except Exception:
            pass


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
