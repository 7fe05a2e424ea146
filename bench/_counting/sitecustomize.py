"""Counts the SQL statements of a process for ``bench/scale.py`` (never imported by the project).

``bench/scale.py`` puts this folder first on the workers' ``PYTHONPATH``, so Python imports this
module at start-up in the worker's main process (and its forked pool processes inherit it). With
``BENCH_STATEMENTS_REDIS`` and ``BENCH_STATEMENTS_KEY`` set, every statement any SQLAlchemy
engine of the process sends (``before_cursor_execute``: one per ``execute``/``executemany``; the
driver's BEGIN and COMMIT are not statements here) adds one to a counter of the process, and a
daemon thread of the process that sent it adds the counter to the Redis key every 0.1 s. The
shared PostgreSQL server does not preload pg_stat_statements, so the bench counts on the client.
Without the two variables this module does nothing. With ``BENCH_PSYCOGREEN`` set (``--pool gevent``)
it makes psycopg2 cooperative under gevent (psycogreen).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

_URL = os.environ.get("BENCH_STATEMENTS_REDIS", "")
_KEY = os.environ.get("BENCH_STATEMENTS_KEY", "")
FLUSH_SECONDS = 0.1


class _Counter:
    def __init__(self) -> None:
        self.pending = 0
        self.pid = 0  #: the process whose flusher thread runs (a forked child starts its own)
        self.lock = threading.Lock()

    def after_fork(self) -> None:
        """A forked child counts its own statements (the parent's pending ones are the parent's)."""
        self.pending, self.pid, self.lock = 0, 0, threading.Lock()

    def add(self, *_: Any) -> None:
        with self.lock:
            self.pending += 1
            first = self.pid != os.getpid()
            if first:
                self.pid = os.getpid()
        # NOTE: the thread starts outside the lock. Under gevent the lock (made before Celery
        # monkey-patches) is an OS lock and a thread is a greenlet whose start() yields to the
        # hub: started under the lock, the next greenlet's add() blocked the one OS thread, and
        # the whole worker with it (bench/scale.py --pool gevent's naive worker hung so).
        if first:
            threading.Thread(target=self._flush_forever, name="bench-statements", daemon=True).start()

    def _flush_forever(self) -> None:
        import redis

        client = redis.Redis.from_url(_URL)
        while True:
            time.sleep(FLUSH_SECONDS)
            with self.lock:
                n, self.pending = self.pending, 0
            if n:
                try:
                    client.incrby(_KEY, n)
                except Exception:  # a lost count is reported as a smaller figure, never a crash
                    with self.lock:
                        self.pending += n


if _URL and _KEY:
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    _counter = _Counter()
    event.listen(Engine, "before_cursor_execute", _counter.add)
    os.register_at_fork(after_in_child=_counter.after_fork)

if os.environ.get("BENCH_PSYCOGREEN"):
    # bench/scale.py --pool gevent: Celery monkey-patches the worker for gevent, but psycopg2
    # blocks in C; psycogreen makes its waits cooperative (greenlets yield on the socket).
    from psycogreen.gevent import patch_psycopg

    patch_psycopg()
