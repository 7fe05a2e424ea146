"""What every benchmark shares: a throwaway PostgreSQL database migrated to head, the bench's
own Redis databases, progress lines, percentiles, and a stack that kills what it started.

A benchmark imports this module (and every project module) only after it has put the project
root first on ``sys.path``: run as ``python bench/recovery.py``, the script's own folder would
otherwise shadow the project's ``recovery`` package.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PG_ADMIN_URL = os.environ.get("BENCH_PG_ADMIN_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres")
REDIS_BASE = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379")
#: broker, result backend, session events. Apart from the tests' 14/15/13 (and 10-12, taken by
#: parallel crash runs): a test run beside a benchmark flushes those, the benchmark these.
REDIS_DBS = tuple(int(x) for x in os.environ.get("BENCH_REDIS_DBS", "4,5,6").split(","))


def progress(message: str) -> None:
    """A progress line for long work (flushed: the smoke test and a person both read it live)."""
    print(f"  .. {message}", flush=True)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def admin_engine(url: str | None = None) -> Any:
    """An AUTOCOMMIT engine on ``url`` (default: BENCH_PG_ADMIN_URL's server)."""
    from sqlalchemy import create_engine

    return create_engine(url or PG_ADMIN_URL, isolation_level="AUTOCOMMIT")


def point_settings_at(url: str) -> None:
    """DATABASE_URL for this process; settings re-read, engines forgotten."""
    os.environ["DATABASE_URL"] = url
    from settings import get_settings

    get_settings.cache_clear()


@contextmanager
def bench_database(prefix: str = "bench", *, migrate: bool = True) -> Iterator[str]:
    """CREATE DATABASE <prefix>_<pid>, migrate it to head (alembic) unless ``migrate`` is
    False, yield its URL, DROP it."""
    from sqlalchemy import text

    name = f"{prefix}_{os.getpid()}"
    admin = admin_engine()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    try:
        if migrate:
            point_settings_at(url)
            from migrations import upgrade

            upgrade(url)
        yield url
    finally:
        from models.db import dispose_engines

        dispose_engines()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def bench_env(pg_url: str, model_url: str, **extra: str) -> dict[str, str]:
    """``devstack.processes.service_env`` on the bench's own Redis databases."""
    from devstack.processes import service_env

    broker, backend, events = REDIS_DBS
    urls = {
        "CELERY_BROKER_URL": f"{REDIS_BASE}/{broker}",
        "CELERY_RESULT_BACKEND": f"{REDIS_BASE}/{backend}",
        "REDIS_URL": f"{REDIS_BASE}/{events}",
    }
    return service_env(pg_url, model_url, redis_base=REDIS_BASE, **{**urls, **extra})


def flush_redis() -> None:
    """Every queued message, chord counter and result of the bench's Redis databases is gone."""
    import redis

    for db in REDIS_DBS:
        client = redis.Redis.from_url(f"{REDIS_BASE}/{db}")
        client.flushdb()
        client.close()


class Stack:
    """The subprocesses and servers one benchmark started; ``close()`` ends every one of them
    (workers by process group, SIGTERM then SIGKILL). Worker logs live in a temporary folder
    that is removed unless the run failed."""

    def __init__(self, name: str) -> None:
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        self.workers: list[Any] = []
        self.servers: list[Any] = []
        self.failed = False

    def model(self, script: Any) -> Any:
        from doubles.scripted_model import ScriptedModelServer

        server = ScriptedModelServer(script)
        server.start()
        self.servers.append(server)
        return server

    def worker(
        self, env: dict[str, str], name: str, concurrency: int = 2, pool: str = "prefork", **extra_env: str
    ) -> Any:
        """A real worker; prefork unless ``pool`` says otherwise: the figures in docs/benchmarks.md
        were measured on prefork workers."""
        from devstack.processes import Worker

        w = Worker({**env, **extra_env}, self.log_dir, name=name, concurrency=concurrency, pool=pool)
        self.workers.append(w)
        return w.start(timeout=60)

    def add_worker(self, w: Any) -> Any:
        """Track a worker-like object (``kill()``/``stop()``/``log()``) started elsewhere."""
        self.workers.append(w)
        return w

    def dump_logs(self, tail_chars: int = 3000) -> None:
        for w in self.workers:
            print(f"---- {w.log_path} (last {tail_chars} chars)\n{w.log()[-tail_chars:]}", file=sys.stderr)

    def close(self) -> None:
        for w in self.workers:
            try:
                w.stop()
            except Exception as exc:  # keep ending the others
                print(f"could not stop {w.log_path}: {exc}", file=sys.stderr)
        for server in self.servers:
            server.stop()
        if self.failed or os.environ.get("BENCH_KEEP_LOGS"):
            print(f"worker logs kept in {self.log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            self.failed = True
        self.close()


def wait_for(
    predicate: Callable[[], Any],
    *,
    timeout: float,
    what: str,
    describe: Callable[[], str] | None = None,
    interval: float = 0.05,
    every: float = 2.0,
) -> Any:
    """Poll ``predicate`` until it returns a truthy value, with a progress line (and
    ``describe()``) every ``every`` seconds; TimeoutError naming ``what``."""
    started = time.monotonic()
    last = started
    while True:
        value = predicate()
        if value:
            return value
        now = time.monotonic()
        if now - started > timeout:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        if now - last >= every:
            status = f": {describe()}" if describe is not None else ""
            progress(f"waiting for {what} ({now - started:.0f}s){status}")
            last = now
        time.sleep(interval)


def naive_sessions(url: str, tasks: Sequence[str]) -> list[int]:
    """One RUNNING session per task, with the task as its first USER message, on the naive
    baseline's database (bench/_naive_app.py), in one transaction; returns their ids."""
    from harness.history import append_message
    from models import AgentSession, Phase, Role, SessionType, transaction
    from models.base import utcnow

    ids = []
    with transaction(url) as s:
        for task in tasks:
            now = utcnow()
            row = AgentSession(
                user_id="bench",
                session_type=SessionType.NORMAL,
                agent_type="main",
                phase=Phase.RUNNING,
                started_at=now,
                updated_at=now,
            )
            s.add(row)
            s.flush()
            append_message(s, row.id, Role.USER, task)
            ids.append(row.id)
    return ids
