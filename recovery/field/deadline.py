"""The one total deadline of a field recovery, and the watchdog that enforces it on a stream.

Checking the clock between SSE events does not stop a read that is blocked in ``recv``, and
closing the response from another thread does not wake it (CELERY-NOTES, SSE section). What
does: per-read socket timeouts capped at the time left, plus a watchdog timer that shuts the
socket down (``SHUT_RDWR``) and then closes the response at the deadline.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from recovery.field.errors import DeadlineExceeded


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


class Watchdog:
    """Fires once at the deadline: shuts down the socket of the response being read, closes it.

    ``watch(response)`` names the response currently read; ``fired`` tells the reader that the
    error it sees was caused by the deadline.
    """

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline
        self.fired = threading.Event()
        self._lock = threading.Lock()
        self._response: Any = None
        self._timer = threading.Timer(deadline.remaining(), self._fire)
        self._timer.daemon = True

    def __enter__(self) -> Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def watch(self, response: Any) -> None:
        with self._lock:
            self._response = response
        if self.fired.is_set():  # the deadline passed while the request was being sent
            self._kill(response)

    def _fire(self) -> None:
        self.fired.set()
        with self._lock:
            response = self._response
        if response is not None:
            self._kill(response)

    @staticmethod
    def _kill(response: Any) -> None:
        sock = response_socket(response)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            response.close()
        except Exception:
            pass
