"""Stuck tool threads as a metric: each process publishes its count to Redis, and the metrics
exporter (recovery/metrics.py) sums the live processes' counts at scrape time (docs/tools.md,
"Stuck threads").

A thread cannot be stopped, so the count is process memory (``registry.stuck_threads``); the
exporter is another process. A process with stuck threads keeps one key
``tool_threads_stuck:<host>:<pid>`` holding its count, with a time to live of
``REPORT_TTL_SECONDS``: a daemon thread writes it at every change and every third of that time,
and deletes it when the count is back to 0. A process that dies (SIGKILL) stops writing it and
Redis drops it within the time to live, so a dead process's threads stop being counted. The set
``INDEX_KEY`` names the keys written (the reader never scans the keyspace); the reader forgets
the names whose key expired.

Best effort: the writes run on the reporter's thread, never on a loop's, so a Redis that does
not answer never delays a tool call; it costs the metric only (logged at WARNING).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from logfmt import log_event

log = logging.getLogger(__name__)

#: Every key a process wrote its count under.
INDEX_KEY = "tool_threads_stuck:processes"
#: A process's count outlives its last write by this long (then it is a dead process's).
REPORT_TTL_SECONDS = 60
#: How often a process with stuck threads writes its count again.
REFRESH_SECONDS = REPORT_TTL_SECONDS / 3


def process_key(host: str, pid: int) -> str:
    """The key of one process's count."""
    return f"tool_threads_stuck:{host}:{pid}"


def _redis() -> Any:
    from harness.events import _client
    from settings import get_settings

    return _client(get_settings().REDIS_URL)


def publish(count: int, client: Any = None) -> None:
    """Write this process's count (delete it at 0). Raises the client's error."""
    client = client or _redis()
    key = process_key(socket.gethostname(), os.getpid())
    pipe = client.pipeline(transaction=False)
    if count > 0:
        pipe.set(key, count, ex=REPORT_TTL_SECONDS)
        pipe.sadd(INDEX_KEY, key)
    else:
        pipe.delete(key)
        pipe.srem(INDEX_KEY, key)
    pipe.execute()


class Reporter:
    """One thread per process, alive while the process has stuck threads (or just had): it
    writes the count that ``count`` returns at every ``changed()`` and every REFRESH_SECONDS,
    and ends once it wrote 0 with no change since."""

    def __init__(self, count: Callable[[], int]) -> None:
        self.count = count
        self.forget()

    def forget(self) -> None:
        """A new state: at the start, and in a forked child (the parent's thread is not there;
        the parent's key is the parent's)."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def changed(self) -> None:
        with self._lock:
            self._wake.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tool-threads-stuck-reporter", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        failing = False
        while True:
            self._wake.wait(REFRESH_SECONDS)
            self._wake.clear()
            count = self.count()
            try:
                publish(count)
                failing = False
            except Exception:
                if not failing:
                    log_event(log, "tool_threads_stuck_not_published", logging.WARNING, exc_info=True, stuck=count)
                failing = True
            if count > 0 or failing:
                continue
            with self._lock:
                # NOTE: ``changed`` sets the event under this lock: a change after the write of
                # 0 is either seen here (the thread goes on) or finds no thread (it starts one).
                if not self._wake.is_set():
                    self._thread = None
                    return


@dataclass(frozen=True)
class StuckThreads:
    """What the live processes published: the sum, the largest count, how many processes."""

    total: int
    max_per_process: int
    processes: int


def read_all(client: Any) -> StuckThreads:
    """Sum the counts of the processes whose key is still alive; forget the others. Raises the
    client's error."""
    keys = sorted(k.decode() if isinstance(k, bytes) else str(k) for k in client.smembers(INDEX_KEY))
    values = client.mget(keys) if keys else []
    gone = [k for k, v in zip(keys, values, strict=True) if v is None]
    if gone:
        client.srem(INDEX_KEY, *gone)
    counts = [int(v) for v in values if v is not None]
    return StuckThreads(sum(counts), max(counts, default=0), len(counts))
