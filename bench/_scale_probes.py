"""What ``bench/scale.py`` reads while it runs: when the parents answered (session_status
events as a hint, the database as the truth), what the database spent (pg_stat_database,
pg_stat_user_tables, pg_stat_statements when the server preloads it, the statements counted in
the workers by ``bench/_counting``, WAL), and what the workers spent (CPU time, VmHWM)."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# --- what a client sees: the session_status events ---------------------------------------------


class Answers:
    """Listens on the session_status channel (Redis pub/sub) in a thread and counts the
    WAITING_USER and FAILED events of the sessions it watches. Only a hint of when to look in
    the database: pub/sub is one channel per Redis server, and another stack on the same server
    (a test run beside the bench) publishes the same session ids for its own database."""

    def __init__(self, redis_url: str) -> None:
        import redis

        self._client = redis.Redis.from_url(redis_url)
        self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
        self._pubsub.subscribe("session_status")
        self._lock = threading.Lock()
        self.watching: set[int] = set()
        self.answered: set[int] = set()
        self.failed: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="answers", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(timeout=0.2)
            if message is None:
                continue
            event = json.loads(message["data"])
            sid, phase = int(event["session_id"]), event.get("phase")
            with self._lock:
                if sid not in self.watching:
                    continue
                if phase == "WAITING_USER":
                    self.answered.add(sid)
                elif phase == "FAILED":
                    self.failed.add(sid)

    def watch(self, ids: list[int]) -> None:
        with self._lock:
            self.watching = set(ids)
            self.answered = set()
            self.failed = set()

    def hints(self) -> tuple[int, int]:
        """(WAITING_USER events, FAILED events) seen for the watched sessions."""
        with self._lock:
            return len(self.answered), len(self.failed)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pubsub.close()
        self._client.close()


class Checker:
    """Asks the kind's database whether every parent answered, on one connection opened before
    the step's counters are read: each check is exactly one transaction, subtracted from the
    step's count. ``close()`` before the counters are read again (the backend then publishes)."""

    #: Seconds between two checks when the events do not say that everything answered (an
    #: event may be lost: publishing is best effort).
    EVERY_SECONDS = 2.0

    def __init__(self, url: str, ids: list[int]) -> None:
        from sqlalchemy import create_engine

        self.ids = ids
        self.engine = create_engine(url, poolclass=_null_pool())
        self.conn = self.engine.connect()
        self.checks = 0
        self.last = 0.0
        self.counts()  # the connection's own setup, before the counters are read
        self.checks = 0

    def counts(self) -> tuple[int, int]:
        """(parents WAITING_USER, parents FAILED)."""
        from sqlalchemy import text

        self.checks += 1
        self.last = time.monotonic()
        row = self.conn.execute(
            text(
                "SELECT count(*) FILTER (WHERE phase = 'WAITING_USER'), count(*) FILTER (WHERE phase = 'FAILED')"
                " FROM agent_session WHERE id = ANY(:ids)"
            ),
            {"ids": self.ids},
        ).one()
        self.conn.commit()
        return int(row[0]), int(row[1])

    def done(self, answers: Answers) -> bool:
        return self.at_least(answers, len(self.ids))

    def at_least(self, answers: Answers, count: int) -> bool:
        """Whether ``count`` parents answered: the events say when to look; the database, at
        least every EVERY_SECONDS, decides."""
        answered, failed = answers.hints()
        if answered < count and not failed and time.monotonic() - self.last < self.EVERY_SECONDS:
            return False
        waiting, failed_rows = self.counts()
        if failed_rows:
            raise RuntimeError(f"{failed_rows} parents FAILED (see the worker logs)")
        return waiting >= count

    def close(self) -> None:
        self.conn.close()
        self.engine.dispose()


def _null_pool() -> Any:
    from sqlalchemy.pool import NullPool

    return NullPool


def answer_times(url: str, ids: list[int]) -> dict[int, float]:
    """Each parent's answer: its last ASSISTANT message without tool calls (written by the
    worker, its clock: this machine's), as epoch seconds."""
    from sqlalchemy import text

    from models import transaction

    with transaction(url) as s:
        rows = s.execute(
            text(
                "SELECT session_id, max(created_at) FROM message WHERE session_id = ANY(:ids) AND role = 'ASSISTANT'"
                " AND tool_calls IS NULL AND NOT deleted GROUP BY session_id"
            ),
            {"ids": ids},
        ).all()
    return {int(sid): at.timestamp() for sid, at in rows}


def not_once(url: str, ids: list[int]) -> list[str]:
    """Parents of ``ids`` whose answer (an ASSISTANT message without tool calls) is not there
    exactly once, and tool calls of theirs with more than one TOOL result: empty when every
    parent was answered, and every child delivered, exactly once."""
    from sqlalchemy import text

    from models import transaction

    with transaction(url) as s:
        answers: dict[int, int] = dict(
            s.execute(
                text(
                    "SELECT s.id, count(m.id) FROM agent_session s LEFT JOIN message m ON m.session_id = s.id"
                    " AND m.role = 'ASSISTANT' AND m.tool_calls IS NULL AND NOT m.deleted"
                    " WHERE s.id = ANY(:ids) GROUP BY s.id"
                ),
                {"ids": ids},
            ).all()
        )
        twice = s.execute(
            text(
                "SELECT session_id, tool_call_id, count(*) FROM message WHERE session_id = ANY(:ids)"
                " AND role = 'TOOL' AND NOT deleted GROUP BY session_id, tool_call_id HAVING count(*) > 1"
            ),
            {"ids": ids},
        ).all()
    out = [f"parent {sid}: {n} answers" for sid, n in sorted(answers.items()) if n != 1]
    out += [f"parent {sid}: {n} results for tool call {call}" for sid, call, n in twice]
    return out


# --- what the database and the workers spent ---------------------------------------------------


@dataclass
class DbCounters:
    statements: int
    xacts: int
    inserted: int
    updated: int
    deleted: int
    wal_lsn: str
    server_statements: int = 0  #: pg_stat_statements calls of the database (BEGIN/COMMIT left out)
    server_wal: int = 0  #: pg_stat_statements WAL bytes of the database

    def minus(self, before: DbCounters, wal_bytes: int) -> dict[str, int]:
        return {
            "server_statements": self.server_statements - before.server_statements,
            "db_wal": self.server_wal - before.server_wal,
            "statements": self.statements - before.statements,
            "xacts": self.xacts - before.xacts,
            "rows": (self.inserted - before.inserted)
            + (self.updated - before.updated)
            + (self.deleted - before.deleted),
            "inserted": self.inserted - before.inserted,
            "updated": self.updated - before.updated,
            "wal": wal_bytes,
        }


def statements_key(kind: str) -> str:
    return f"bench:scale:statements:{os.getpid()}:{kind}"


class ServerStatements:
    """pg_stat_statements, when the server preloads it (a private server: the shared one does
    not): exact statement counts and WAL bytes per database. Its view lives in a small database
    of its own, so reading it adds nothing to the kinds' databases."""

    def __init__(self, url: str | None) -> None:
        self.engine: Any = None
        self.why = ""
        if url is None:
            return
        from sqlalchemy import create_engine, text

        engine = create_engine(url, isolation_level="AUTOCOMMIT", poolclass=_null_pool())
        try:
            with engine.connect() as conn:
                preload = str(conn.execute(text("SHOW shared_preload_libraries")).scalar_one())
                if "pg_stat_statements" not in preload:
                    self.why = "the server does not preload pg_stat_statements"
                else:
                    conn.execute(text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
                    conn.execute(text("SELECT 1 FROM pg_stat_statements LIMIT 1")).all()
                    self.engine = engine
                    return
        except Exception as exc:  # the figures fall back to the client's counts
            self.why = f"pg_stat_statements unusable: {type(exc).__name__}"
        engine.dispose()

    def read(self, database: str) -> tuple[int, int]:
        """(calls, WAL bytes) of every top-level statement but BEGIN/COMMIT/ROLLBACK in ``database``
        (with ``pg_stat_statements.track = all`` the foreign keys' checks are nested statements:
        a top-level statement's figures already hold theirs)."""
        if self.engine is None:
            return 0, 0
        from sqlalchemy import text

        with self.engine.connect() as conn:
            row = conn.execute(
                text(
                    "SELECT coalesce(sum(calls), 0), coalesce(sum(wal_bytes), 0) FROM pg_stat_statements"
                    " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = :d)"
                    " AND toplevel AND upper(query) NOT IN ('BEGIN', 'COMMIT', 'ROLLBACK')"
                ),
                {"d": database},
            ).one()
        return int(row[0]), int(row[1])

    def close(self) -> None:
        if self.engine is not None:
            self.engine.dispose()


def db_counters(admin: Any, database: str, kind: str, server: ServerStatements) -> DbCounters:
    """The kind's database counters, read from the admin connection (not the bench database:
    the reading itself is no transaction there)."""
    import redis
    from sqlalchemy import text

    from bench._common import REDIS_BASE, REDIS_DBS

    with admin.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        row = conn.execute(
            text(
                "SELECT xact_commit, tup_inserted, tup_updated, tup_deleted, pg_current_wal_lsn()::text"
                " FROM pg_stat_database WHERE datname = :d"
            ),
            {"d": database},
        ).one()
    client = redis.Redis.from_url(f"{REDIS_BASE}/{REDIS_DBS[2]}")
    try:
        statements = int(client.get(statements_key(kind)) or 0)
    finally:
        client.close()
    calls, wal = server.read(database)
    return DbCounters(statements, int(row[0]), int(row[1]), int(row[2]), int(row[3]), str(row[4]), calls, wal)


def table_counters(url: str) -> dict[str, tuple[int, int, int, int]]:
    """Per table of the kind's database: (rows inserted, updated, of those HOT, deleted), on a
    connection of its own (read before the step's counters, or after them: not the step's)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url, poolclass=_null_pool())
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_stat_clear_snapshot()"))
            rows = conn.execute(
                text("SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del FROM pg_stat_user_tables")
            ).all()
    finally:
        engine.dispose()
    return {str(r[0]): (int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows}


def wal_between(admin: Any, before: str, after: str) -> int:
    from sqlalchemy import text

    with admin.connect() as conn:
        return int(conn.execute(text("SELECT pg_wal_lsn_diff(:a, :b)"), {"a": after, "b": before}).scalar_one())


def _hwm_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(x) for x in (task / "children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def peak_memory(workers: list[Any]) -> tuple[float, float]:
    """(largest VmHWM of a worker's main process, largest VmHWM of a pool process), in MB."""
    main_kb = pool_kb = 0
    for w in workers:
        pid = w.proc.pid
        main_kb = max(main_kb, _hwm_kb(pid))
        for child in _children(pid):
            pool_kb = max(pool_kb, _hwm_kb(child))
    return main_kb / 1024, pool_kb / 1024


def summed_peak_memory(workers: list[Any]) -> float:
    """The sum of the VmHWM of every worker's main and pool processes, in MB: an upper bound
    of what they all held at any one moment (each peak may come at its own time)."""
    return sum(_hwm_kb(pid) for w in workers for pid in [w.proc.pid, *_children(w.proc.pid)]) / 1024


def cpu_seconds(workers: list[Any]) -> float:
    """CPU time (user + system) the workers' main and pool processes have used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for w in workers:
        for pid in [w.proc.pid, *_children(w.proc.pid)]:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


def _stat_ticks(pid: int, *, reaped: bool = False) -> int:
    """utime + stime of ``pid`` in clock ticks (and its waited-for children's, ``reaped``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return sum(int(x) for x in fields[11 : 15 if reaped else 13])


def _server_pids(pg_port: int, redis_port: int) -> tuple[int | None, int | None]:
    """The local PostgreSQL postmaster started with ``-p pg_port`` and the redis-server listening
    on ``redis_port``, found by their command lines; None when not found here."""
    postmaster = redis = None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if argv[0].endswith("/postgres") and "-p" in argv and argv[argv.index("-p") + 1 :][:1] == [str(pg_port)]:
            postmaster = int(entry.name)
        elif argv[0].startswith("redis-server") and argv[0].endswith(f":{redis_port}"):
            redis = int(entry.name)
    return postmaster, redis


def server_cpu_seconds(pg_url: str, redis_url: str) -> float | None:
    """CPU time so far of the bench's PostgreSQL (its postmaster, its live processes and those that
    ended: a backend's CPU goes to the postmaster when it is reaped) and its Redis, found by their
    ports on this machine; None when either is not a local process with its port on its command
    line (the shared default servers: their CPU is not the bench's alone anyway)."""
    from sqlalchemy import make_url

    postmaster, redis = _server_pids(make_url(pg_url).port or 5432, make_url(redis_url).port or 6379)
    if postmaster is None or redis is None:
        return None
    ticks = _stat_ticks(postmaster, reaped=True) + _stat_ticks(redis)
    ticks += sum(_stat_ticks(pid) for pid in _children(postmaster))
    return ticks / os.sysconf("SC_CLK_TCK")


def storage_per_parent(url: str, parents: int) -> str:
    """Bytes on disk (heap, indexes, TOAST) of the tables a parent writes, per parent so far."""
    from sqlalchemy import text

    from models import transaction

    tables = ("agent_session", "message", "subagent_execution", "pending_round", "round_journal")
    with transaction(url) as s:
        sizes = {t: int(s.execute(text("SELECT pg_total_relation_size(:t)"), {"t": t}).scalar_one()) for t in tables}
    parts = ", ".join(f"{t} {b / parents / 1024:.1f}" for t, b in sizes.items() if b)
    return f"{sum(sizes.values()) / parents / 1024:.1f} kB ({parts})"


def close_connections() -> None:
    """Close this process's pooled connections: their backends end, and publish their counters
    (``models.db.dispose_engines`` only forgets them, for a forked child's sake)."""
    from models import db

    for engine in list(db._engines.values()):
        engine.dispose()
    db.dispose_engines()


#: ``application_name`` of every worker a scale step starts (libpq reads PGAPPNAME): the
#: connections counted as the workers' are those, not the bench's own.
WORKER_APP_NAME = "bench-scale-worker"


class Sampler:
    """Every ``EVERY_SECONDS`` during a step, on connections of its own: the loops in flight (ours
    only: sessions and executions holding a live lease, i.e. a loop that took them and runs) and
    the PostgreSQL connections the workers hold open (``application_name`` =
    :data:`WORKER_APP_NAME`, on the kind's database); keeps the peak of each."""

    EVERY_SECONDS = 0.2

    def __init__(self, admin: Any, database: str, url: str | None) -> None:
        import threading

        from sqlalchemy import create_engine

        self.admin, self.database = admin, database
        self.engine = create_engine(url, poolclass=_null_pool()) if url else None
        self.peak_in_flight = 0
        self.peak_connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scale-sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self.engine is not None:
            self.engine.dispose()

    def _run(self) -> None:
        from sqlalchemy import text

        loops = text(
            "SELECT (SELECT count(*) FROM agent_session WHERE session_type <> 'SUBAGENT'"
            " AND phase IN ('RUNNING', 'RESUMING') AND lease_owner IS NOT NULL AND lease_expires_at > now())"
            " + (SELECT count(*) FROM subagent_execution WHERE status IN ('RUNNING', 'RECOVERING')"
            " AND epoch >= 1 AND lease_owner IS NOT NULL AND lease_expires_at > now())"
        )
        held = text("SELECT count(*) FROM pg_stat_activity WHERE datname = :db AND application_name = :app")
        conn = self.engine.connect() if self.engine is not None else None
        try:
            with self.admin.connect() as admin:
                while not self._stop.wait(self.EVERY_SECONDS):
                    n = admin.execute(held, {"db": self.database, "app": WORKER_APP_NAME}).scalar_one()
                    admin.commit()
                    self.peak_connections = max(self.peak_connections, int(n))
                    if conn is not None:
                        flying = conn.execute(loops).scalar_one()
                        conn.commit()
                        self.peak_in_flight = max(self.peak_in_flight, int(flying))
        finally:
            if conn is not None:
                conn.close()
