"""Shared fixtures: a throwaway PostgreSQL database built by `alembic upgrade head`, Redis.

Tests that need PostgreSQL or Redis skip on a developer machine without them, and FAIL in CI
(CI=true): a missing service must never turn into a silent green run.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Collection
    from pathlib import Path
    from typing import Any

    from sqlalchemy.engine import Engine
    from xdist.remote import Producer
    from xdist.scheduler import LoadScopeScheduling

    from devstack.processes import Beat, Service, Worker
    from doubles.scripted_model import Script, ScriptedModelServer
    from tests.types import ModelFactory, StackFactory

PG_ADMIN_URL = os.environ.get("TEST_PG_ADMIN_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# --- Redis: ONE server for the whole run, disjoint databases per xdist worker ----------------
#: The Redis server of every test, stack helper and worker subprocess (no database number):
#: TEST_REDIS_URL=redis://127.0.0.1:6390 points a whole run at a private redis-server.
REDIS_BASE = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")
#: Highest xdist worker that still gets its own three databases (gw0 14,15,13 ... gw4 2,3,1;
#: database 0 is left alone): `make test` runs fewer workers than that.
MAX_XDIST_WORKERS = 5


def _stack_redis_dbs() -> str:
    """The "broker,backend,events" databases of this process. Under pytest-xdist each worker
    gets its own (gw0 14,15,13; gw1 11,12,10; gw2 8,9,7; gw3 5,6,4; gw4 2,3,1): two workers
    never flush or consume each other's queues. A sequential run keeps STACK_REDIS_DBS (default
    14,15,13)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... set by xdist
    if not worker.startswith("gw"):
        return os.environ.get("STACK_REDIS_DBS", "14,15,13")
    index = int(worker[2:])
    if index >= MAX_XDIST_WORKERS:
        raise pytest.UsageError(
            f"xdist worker {worker}: one Redis server has databases for {MAX_XDIST_WORKERS} workers "
            f"(3 each); run with -n {MAX_XDIST_WORKERS} or fewer"
        )
    events = 13 - 3 * index
    return f"{events + 1},{events + 2},{events}"


# --- RabbitMQ tests: one at a time under pytest-xdist -----------------------------------------
#: Every amqp test uses RabbitMQ's one set of queues (celery, recovery): they must never overlap.
#: They carry ``xdist_group("rabbitmq")``, but with pytest 9 xdist 3.8's loadgroup silently
#: groups nothing (it renames ``item._nodeid``, which pytest 9 no longer reads: seen as
#: test_rabbitmq.py on gw1 and test_worker_kill[amqp] on gw2 at once, consuming each other's
#: messages). So the scheduler below groups by node id: a test of a module named *rabbitmq*, or
#: a test whose parameters include ``amqp``, and pytest_collection_modifyitems checks that every
#: ``xdist_group("rabbitmq")`` test is recognised by that rule.
RABBITMQ_GROUP = "rabbitmq"


def rabbitmq_scope(nodeid: str) -> bool:
    """True for a test of the RabbitMQ group, from its node id alone (the xdist controller
    does not collect, so it has no markers)."""
    path, _, rest = nodeid.partition("::")
    params = rest[rest.find("[") + 1 : rest.rfind("]")].split("-") if "[" in rest else []
    return RABBITMQ_GROUP in path.rsplit("/", 1)[-1] or "amqp" in params


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadScopeScheduling | None:
    """--dist loadgroup as it is meant to work: each test its own scope, except that the
    RabbitMQ tests form one scope (one worker, one after another)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RabbitMQGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return RABBITMQ_GROUP if rabbitmq_scope(nodeid) else nodeid

    return RabbitMQGroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marked = any(m.args[:1] == (RABBITMQ_GROUP,) for m in item.iter_markers("xdist_group"))
        if marked != rabbitmq_scope(item.nodeid):
            raise pytest.UsageError(
                f"{item.nodeid}: xdist_group({RABBITMQ_GROUP!r}) and tests/conftest.py rabbitmq_scope() disagree"
            )


# Set before anything imports devstack.processes (it reads them at import) and before the settings are
# read: in-process code (session_status events, presence, the Celery app of the test process)
# uses this worker's databases too, never a default database of a shared server.
os.environ["STACK_REDIS_URL"] = REDIS_BASE
os.environ["STACK_REDIS_DBS"] = _stack_redis_dbs()
_BROKER_DB, _BACKEND_DB, _EVENTS_DB = os.environ["STACK_REDIS_DBS"].split(",")
os.environ["CELERY_BROKER_URL"] = f"{REDIS_BASE}/{_BROKER_DB}"
os.environ["CELERY_RESULT_BACKEND"] = f"{REDIS_BASE}/{_BACKEND_DB}"
os.environ["REDIS_URL"] = f"{REDIS_BASE}/{_EVENTS_DB}"


def _missing(what: str, exc: BaseException) -> None:
    message = f"{what} is not reachable: {type(exc).__name__}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: services are required)", pytrace=False)
    pytest.skip(message)


def _admin_engine() -> Engine:
    from sqlalchemy import create_engine

    return create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")


def _create_database(prefix: str) -> tuple[Engine, str, str]:
    """CREATE DATABASE <prefix>_<pid>_<rand>; returns (admin engine, name, url)."""
    from sqlalchemy import text

    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        admin = _admin_engine()
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # any driver error means "not reachable"
        _missing("PostgreSQL", exc)
    return admin, name, PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """URL of a fresh database migrated to head; dropped at the end of the session."""
    from sqlalchemy import text

    admin, name, url = _create_database("ar_test")
    os.environ["DATABASE_URL"] = url
    from settings import get_settings

    get_settings.cache_clear()
    from migrations import upgrade

    upgrade(url)
    yield url
    from models.db import dispose_engines

    dispose_engines()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


#: Emptied before each test, with every table that references them (what TRUNCATE ... CASCADE
#: empties); operator_action, worker_presence and release_move reference nothing, so they are named.
TABLES = (
    "message",
    "subagent_execution",
    "pending_round",
    "agent_session",
    "operator_action",
    "worker_presence",
    "release_move",
)

#: TABLES and the tables that reference them, transitively: (table, the table it references or NULL).
_REACHED_SQL = """
WITH RECURSIVE reached(oid) AS (
    SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') AND c.relname = ANY(:names)
  UNION
    SELECT f.conrelid FROM pg_constraint f JOIN reached r ON f.confrelid = r.oid WHERE f.contype = 'f'
)
SELECT r.oid::regclass::text, f.confrelid::regclass::text
FROM reached r LEFT JOIN pg_constraint f ON f.conrelid = r.oid AND f.contype = 'f' AND f.confrelid <> r.oid
"""
#: The sequences owned by those tables' columns (serial or identity), as RESTART IDENTITY restarts them.
_RESTART_SQL = """
SELECT setval(s.seqrelid, s.seqstart, false)
FROM pg_sequence s JOIN pg_depend d ON d.objid = s.seqrelid AND d.classid = 'pg_class'::regclass
WHERE d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i') AND d.refobjid = ANY(CAST(:tables AS regclass[]))
"""


def _deletion_order(edges: list[tuple[str, str | None]]) -> list[str] | None:
    """The tables of ``edges`` (table, a table it references), each after every table that
    references it; None when they reference each other in a cycle."""
    refs: dict[str, set[str]] = {}
    for table, target in edges:
        refs.setdefault(table, set())
        if target is not None:
            refs[table].add(target)
    referenced_by = {t: {s for s, targets in refs.items() if t in targets} for t in refs}
    order: list[str] = []
    while referenced_by:
        free = sorted(t for t, sources in referenced_by.items() if not sources - set(order))
        if not free:
            return None
        order += free
        for t in free:
            del referenced_by[t]
    return order


def _empty_tables(conn: Any, names: list[str]) -> None:
    """What ``TRUNCATE names RESTART IDENTITY CASCADE`` does, by DELETE: TRUNCATE gives each of
    the ten tables and their indexes new files (56-122 ms a test on a loaded machine, against
    31-51 ms for these deletes of a test's few rows). The same locks (ACCESS EXCLUSIVE, waited
    for as TRUNCATE waits: a killed worker's transaction still ending on the server ends first),
    the same tables (every one that references them), the same sequences restarted. Tables
    that reference each other in a cycle, or refuse the deletes, are truncated as before."""
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    edges = [(t, ref) for t, ref in conn.execute(text(_REACHED_SQL), {"names": names})]
    order = _deletion_order(edges)
    if order is None:  # a cycle of references between tables: only TRUNCATE empties it at once
        conn.execute(text(f"TRUNCATE {', '.join(names)} RESTART IDENTITY CASCADE"))
        return
    deletes = "".join(f"; DELETE FROM {table}" for table in order)  # one round trip
    try:
        with conn.begin_nested():  # a reference that refuses the deletes (ON DELETE RESTRICT)
            conn.execute(text(f"LOCK TABLE {', '.join(order)} IN ACCESS EXCLUSIVE MODE{deletes}"))
    except DBAPIError:
        conn.execute(text(f"TRUNCATE {', '.join(names)} RESTART IDENTITY CASCADE"))
        return
    conn.execute(text(_RESTART_SQL), {"tables": order})


@pytest.fixture
def db(pg_url: str) -> Iterator[str]:
    """A clean database for one test (tables emptied before it)."""
    from sqlalchemy import text

    from models.db import get_engine

    engine = get_engine(pg_url)
    with engine.begin() as conn:
        existing = {
            r[0]
            for r in conn.execute(
                text("SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename <> 'alembic_version'")
            )
        }
        names = [t for t in TABLES if t in existing]
        if names:
            _empty_tables(conn, names)
        if "recovery_scan" in existing:  # the right to scan is free at the start of every test
            conn.execute(text("UPDATE recovery_scan SET holder = NULL, held_until = NULL"))
            # Its row as the migration seeds it: a test that deleted it (test_metrics' field_table)
            # left the next test in the same process a scan that creates the row at its take (a
            # lock taken on the row beforehand then locked nothing).
            seed = "INSERT INTO recovery_scan (id) SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM recovery_scan WHERE id = 1)"
            conn.execute(text(seed))
    yield pg_url


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A Redis database reserved for tests, flushed before use."""
    import redis

    from devstack.processes import EVENTS_DB

    url = f"{REDIS_BASE}/{EVENTS_DB}"
    try:
        client = redis.Redis.from_url(url)
        client.flushdb()
    except Exception as exc:
        _missing("Redis", exc)
    yield url
    client.close()


@pytest.fixture
def fresh_db_url() -> Iterator[str]:
    """An EMPTY database (no migrations run), for migration tests; dropped after the test."""
    from sqlalchemy import text

    admin, name, url = _create_database("ar_mig")
    yield url
    from models.db import dispose_engines

    dispose_engines()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


# --- a full stack: PostgreSQL + Redis + scripted model + real Celery workers ----------------


class Stack:
    """One test's services; workers are real `celery -A tasks worker` subprocesses."""

    def __init__(self, pg_url: str, log_dir: Path, script: Script) -> None:
        from devstack.processes import APPLIED_ENV_KEYS, apply_env, flush_broker, service_env
        from doubles.scripted_model import ScriptedModelServer

        # What apply_env sets goes back when the stack closes: no later test (in whatever
        # order xdist runs them) inherits a stack's broker, lease or timeouts.
        self._saved_env = {key: os.environ.get(key) for key in APPLIED_ENV_KEYS}
        flush_broker()
        self.model = ScriptedModelServer(script)
        self.model.start()
        self.log_dir = log_dir
        self.env = service_env(pg_url, self.model.base_url)
        apply_env(self.env)
        self.workers: list[Service] = []

    def worker(
        self,
        name: str = "w1",
        concurrency: int = 2,
        beat: bool = False,
        *,
        queues: str | None = None,
        argv: list[str] | None = None,
        pool: str = "prefork",
        **env: str,
    ) -> Worker:
        """A real ``celery -A tasks worker`` subprocess: bare (every queue) unless ``queues``
        narrows it with -Q; ``argv`` is a whole command line after ``celery`` (a Procfile line);
        ``pool``: Celery's -P (prefork or threads)."""
        from devstack.processes import Worker

        w = Worker(
            {**self.env, **env},
            self.log_dir,
            name=name,
            concurrency=concurrency,
            beat=beat,
            queues=queues,
            argv=argv,
            pool=pool,
        )
        self.workers.append(w)
        return w.start()

    def beat(self) -> Beat:
        """``celery -A tasks beat`` (scans every SCAN_INTERVAL_SECONDS)."""
        from devstack.processes import Beat

        b = Beat(self.env, self.log_dir)
        self.workers.append(b)
        return b.start()

    def submit(self, text: str, agent: str = "main") -> int:
        import tasks
        from harness.views import create_session

        sid = create_session(agent, text)
        tasks.app.signature("agent.run", args=(sid, 0)).apply_async()
        return sid

    def snapshot(self, sid: int) -> dict[str, Any]:
        from harness.views import snapshot
        from models import transaction

        with transaction() as s:
            snap = snapshot(s, sid)
        assert snap is not None
        return snap

    def wait_phase(
        self, sid: int, phases: Collection[str] = ("WAITING_USER",), timeout: float = 60.0
    ) -> dict[str, Any]:
        from tests.helpers import wait_until

        def done() -> dict[str, Any] | None:
            snap = self.snapshot(sid)
            return snap if snap["phase"] in phases else None

        try:
            return wait_until(done, timeout=timeout, interval=0.1, what=f"session {sid} in {phases}")
        except AssertionError:
            for w in self.workers:
                print(f"---- {w.log_path}\n{w.log()[-4000:]}")
            raise

    def invariants(self, settled: bool = True) -> list[str]:
        from models import transaction
        from recovery.invariants import check_all

        with transaction() as s:
            return check_all(s, settled=settled)

    def close(self) -> None:
        from devstack.processes import apply_env

        # SIGKILL, then stop() closes the log: the test is over and nothing reads a worker's
        # shutdown. A warm stop cost 2 s per idle prefork worker and up to its 10 s grace for
        # one still in a task, in every stack's teardown.
        for w in self.workers:
            w.kill()
            w.stop()
        self.model.stop()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        apply_env(dict(os.environ))  # the app's broker, backend and settings as before the stack


@pytest.fixture
def stack_factory(db: str, redis_url: str, tmp_path: Path) -> Iterator[StackFactory]:
    stacks: list[Stack] = []

    def make(script: Script) -> Stack:
        st = Stack(db, tmp_path, script)
        stacks.append(st)
        return st

    yield make
    for st in stacks:
        st.close()


@pytest.fixture
def model_factory(db: str) -> Iterator[ModelFactory]:
    """Start scripted model servers (real HTTP on loopback) for in-process loop tests."""
    from doubles.scripted_model import ScriptedModelServer

    servers: list[ScriptedModelServer] = []

    def make(script: Script) -> ScriptedModelServer:
        server = ScriptedModelServer(script)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()
