"""session_status events on Redis pub/sub and the external phase view (docs/state-machines.md, "Session phase").

RESUMING means "recovery owns this session" inside; everywhere a client can see a phase it is
shown as RUNNING.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections import deque
from functools import lru_cache
from typing import Any

from logfmt import log_event
from models import Phase
from settings import get_settings

log = logging.getLogger(__name__)

CHANNEL = "session_status"


def external_phase(phase: Phase | str | None) -> str | None:
    """The phase a client may see: RESUMING is shown as RUNNING."""
    if phase is None:
        return None
    value = str(phase)
    return Phase.RUNNING.value if value == Phase.RESUMING.value else value


@lru_cache(maxsize=1)
def _redis() -> Any:
    """The client of the configured REDIS_URL (LOCAL client presence)."""
    return _client(get_settings().REDIS_URL)


@lru_cache(maxsize=4)
def _client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)


#: Events waiting for the publisher thread beyond this are dropped (counted): a Redis that does
#: not answer never grows a process's memory.
MAX_WAITING = 1000
#: How long a process that exits waits for its last events to be sent (the CLI's, say).
FLUSH_AT_EXIT_SECONDS = 1.0


class _Publisher:
    """One thread per process sends the events, in the order they were asked for, so that a
    task never waits for Redis: a publish cost a run a round trip (two per run, about 0.3 ms
    each on loopback), and up to ``socket_timeout`` each while Redis does not answer. Events
    that wait together go in one pipeline. Started at the first event of a process (after a
    fork too: threads do not survive it, and the events the parent had not sent are its own)."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """A new state: at the start, and in a forked child (the parent's thread is not there,
        and what it had not sent is the parent's to send)."""
        self._cond = threading.Condition()
        self._waiting: deque[tuple[str, int, str]] = deque()
        self._sending = False
        self._started = False
        self.dropped = 0

    def put(self, url: str, session_id: int, payload: str) -> None:
        with self._cond:
            if len(self._waiting) >= MAX_WAITING:
                self.dropped += 1
                report = self.dropped % MAX_WAITING == 1  # one line per MAX_WAITING dropped
            else:
                self._waiting.append((url, session_id, payload))
                report = False
                if not self._started:
                    self._start()
                self._cond.notify()
        if report:
            log_event(log, "session_status_dropped", logging.WARNING, waiting=MAX_WAITING, dropped=self.dropped)

    def _start(self) -> None:
        self._started = True
        threading.Thread(target=self._run, name="session-status", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting:
                    self._cond.wait()
                batch = list(self._waiting)
                self._waiting.clear()
                self._sending = True
            try:
                _send(batch)
            finally:
                with self._cond:
                    self._sending = False
                    self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every event asked for so far was sent (or failed); False after ``timeout``."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._waiting or self._sending:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True


def _send(batch: list[tuple[str, int, str]]) -> None:
    by_url: dict[str, list[tuple[int, str]]] = {}
    for url, session_id, payload in batch:
        by_url.setdefault(url, []).append((session_id, payload))
    for url, events in by_url.items():
        try:
            client = _client(url)
            if len(events) == 1:  # the usual case: a pipeline would only add its own cost
                client.publish(CHANNEL, events[0][1])
                continue
            pipe = client.pipeline(transaction=False)
            for _, payload in events:
                pipe.publish(CHANNEL, payload)
            pipe.execute()
        except Exception:  # a missing event never stops the work
            first, n = events[0][0], len(events)
            log_event(log, "session_status_not_published", logging.DEBUG, exc_info=True, session_id=first, events=n)


_publisher = _Publisher()
os.register_at_fork(after_in_child=_publisher.forget)
atexit.register(_publisher.flush, FLUSH_AT_EXIT_SECONDS)


def publish_status(session_id: int, phase: Phase | str | None) -> None:
    """Best effort: an event lost here is repaired by the next snapshot a client reads. Sent by
    this process's publisher thread after the call returns (``flush_status_events`` waits)."""
    url = get_settings().REDIS_URL
    if not url.startswith("redis"):
        return
    event = {"type": CHANNEL, "session_id": session_id, "phase": external_phase(phase)}
    _publisher.put(url, session_id, json.dumps(event))


def flush_status_events(timeout: float = FLUSH_AT_EXIT_SECONDS) -> bool:
    """Wait until this process's events asked for so far were sent; False after ``timeout``."""
    return _publisher.flush(timeout)
