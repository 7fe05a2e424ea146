"""Engine and the unit-of-work helper: one Session per transaction."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

from sqlalchemy import BigInteger, CursorResult, Engine, Executable, Select, TextClause, bindparam, create_engine, event
from sqlalchemy import exc as exc_mod
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql.dml import UpdateBase

from settings import get_settings

_lock = threading.Lock()
T = TypeVar("T")
_engines: dict[str, Engine] = {}


def _make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # Embedded default only: WAL lets readers and one writer across processes coexist.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=60000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            # Take the write lock at BEGIN so that two writers serialize instead of deadlocking.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    size, overflow = pool_limits()
    engine = create_engine(
        url,
        pool_size=size,
        max_overflow=overflow,
        pool_timeout=_pool_timeout_seconds(),
        connect_args=_server_bounds(url),
    )
    _ping_when_idle(engine)
    _bound_each_transaction(engine)
    _never_send_a_warm_up(engine)
    return engine


#: An execution option: the statement is compiled into the engine's cache, then ends before the
#: driver is called (models.warmup). Nothing reaches the database.
WARM_UP_ONLY = "agent_recovery_warm_up_only"


def _never_send_a_warm_up(engine: Engine) -> None:
    """Every execution on a connection marked :data:`WARM_UP_ONLY` stops before the driver:
    SQLAlchemy's ``do_execute`` hooks treat True as "the execution already took place". One
    lookup per execution otherwise; set once here (never added or removed while other
    threads execute)."""

    def _stop(cursor: Any, statement: Any, *rest: Any) -> bool | None:
        return True if rest[-1].execution_options.get(WARM_UP_ONLY) else None

    for hook in ("do_execute", "do_execute_no_params", "do_executemany"):
        event.listen(engine, hook, _stop)


def _server_bounds(url: str) -> dict[str, Any]:
    """PostgreSQL (psycopg2): the server ends a transaction left idle for half a lease, and TCP
    keepalives with ``tcp_user_timeout`` find a peer gone silent within half a lease
    (models.lease.connect_bounds): a stalled client (a paused process, a suspended VM, a path
    that stopped answering) never holds a row past its lease. Its next statement then fails as
    a lost connection: an infrastructure fault, its work left to the scan."""
    if not url.startswith("postgresql"):
        return {}
    from models.lease import connect_bounds

    return connect_bounds()


#: Loops this process runs at once (:func:`size_for_loops`): 1 until a worker boot says more.
_loops = 1
#: Connections this process may hold at most, set by :func:`fit_to_server` (None: no cap).
_cap: int | None = None


#: The derived pool's ceiling (kept, burst) whatever the loops: at a 2 s model, 256 loops of
#: one threads worker ran on 30 connections as fast as on more (docs/scaling.md), and one
#: machine's worker stays within a PgBouncer-less budget of about 40.
DERIVED_POOL_MAX, DERIVED_OVERFLOW_MAX = 20, 10


def derived_pool_limits(loops: int) -> tuple[int, int]:
    """``(pool_size, max_overflow)`` for a process that runs ``loops`` agent loops at once.

    A loop holds a connection only inside a transaction (milliseconds) and waits on its model
    for seconds in between, so connections are a fraction of the loops: two, plus a quarter of
    the loops kept open, plus an eighth of them in bursts, up to DERIVED_POOL_MAX kept and
    DERIVED_OVERFLOW_MAX more. Two is the floor of a process that runs ONE loop (prefork): its
    loop's transaction and its heartbeat's renewal at the same time, with two more in a burst
    (the statement warm-up, a re-measure of the database's clock). 64 loops: 18 kept, 28 at
    most; 256 loops: 20 kept, 30 at most (docs/scaling.md, "The database pool")."""
    return min(2 + loops // 4, DERIVED_POOL_MAX), min(2 + loops // 8, DERIVED_OVERFLOW_MAX)


def pool_limits() -> tuple[int, int]:
    """``(pool_size, max_overflow)`` of this process's engines: ``DB_POOL_SIZE`` and
    ``DB_POOL_MAX_OVERFLOW`` when set, else :func:`derived_pool_limits`; within the cap that
    :func:`fit_to_server` found (the overflow shrinks first, then the pool, never below one)."""
    s = get_settings()
    derived_size, derived_overflow = derived_pool_limits(_loops)
    size = s.DB_POOL_SIZE or derived_size
    overflow = derived_overflow if s.DB_POOL_MAX_OVERFLOW < 0 else s.DB_POOL_MAX_OVERFLOW
    if _cap is not None and size + overflow > _cap:
        size = max(1, min(size, _cap))
        overflow = max(0, _cap - size)
    return size, overflow


def _pool_timeout_seconds() -> float:
    """How long a thread waits for a free connection: half a lease (models.lease). Past it,
    SQLAlchemy's TimeoutError, an infrastructure fault (harness.errors): the task ends without
    writing a result and its lease lapses to the scan, as after any database fault."""
    from models.lease import lock_wait_seconds

    return lock_wait_seconds()


def loops_per_process() -> int:
    """The agent loops this process runs at once (:func:`size_for_loops`; 1 by default)."""
    return _loops


def size_for_loops(loops: int) -> None:
    """This process runs ``loops`` agent loops at once (a worker's boot: its concurrency on a
    threads pool, 1 in each process of a prefork pool): engines made from now on are sized for
    it, those made before are disposed (the next use makes them again)."""
    global _loops
    _loops = max(1, int(loops))
    dispose_engines()


def fit_to_server(processes: int, url: str | None = None) -> int | None:
    """Cap each of a worker's ``processes`` (its pool processes and its main one) so that all
    of them together never hold more connections than PostgreSQL accepts from clients
    (``max_connections - superuser_reserved_connections``); engines are made again with the
    cap. Returns the cap (None: not PostgreSQL, or no cap needed). The server's limits are
    read once, at boot; a database that is down then raises here, and the pool stays uncapped
    (``tasks.signals`` logs it). Behind PgBouncer these are the server's limits, which bound
    PgBouncer's own pools; the workers' bound is then PgBouncer's ``max_client_conn``."""
    global _cap
    engine = get_engine(url)
    if engine.dialect.name != "postgresql":
        return None
    accepted = "SELECT current_setting('max_connections')::int - current_setting('superuser_reserved_connections')::int"
    with engine.connect() as conn:
        total = int(conn.exec_driver_sql(accepted).scalar_one())
    per_process = max(1, total // max(1, processes))
    size, overflow = pool_limits()
    if size + overflow <= per_process:
        return None
    _cap = per_process
    dispose_engines()
    return per_process


def _bound_each_transaction(engine: Engine) -> None:
    """In the ``transaction`` scope of the server bounds (models.lease.settings_scope), every
    transaction starts by setting them for itself: a pooler in transaction mode may run it on
    any server connection, and keeps nothing a client set for its session."""
    from models.lease import transaction_bounds_sql

    statement = transaction_bounds_sql()
    if statement is None:
        return

    @event.listens_for(engine, "begin")
    def _set_local(conn: Any) -> None:
        conn.exec_driver_sql(statement)


#: A pooled connection used less than this many seconds ago is handed out without a ping.
PING_AFTER_IDLE_SECONDS = 0.5


def _ping_when_idle(engine: Engine) -> None:
    """Pessimistic disconnect handling with a bypass window (as HikariCP's 500 ms
    ``aliveBypassWindowMs``): a connection is pinged at checkout only when it sat idle in the
    pool for ``PING_AFTER_IDLE_SECONDS``. A task's transactions follow each other within
    milliseconds; ``pool_pre_ping`` paid a round trip for every one of them (13 for a delegating
    round). A dead connection found by the ping is replaced (``DisconnectionError``:
    the pool reconnects); one that died inside the window fails its statement, which is an
    infrastructure error like any cut mid-statement (the task stops without writing a result,
    and the pool drops the invalidated connection)."""

    @event.listens_for(engine, "connect")
    @event.listens_for(engine, "checkin")
    def _stamp(dbapi_conn: Any, record: Any) -> None:
        record.info["checked_in_at"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping(dbapi_conn: Any, record: Any, proxy: Any) -> None:
        last = record.info.get("checked_in_at")
        if last is not None and time.monotonic() - last < PING_AFTER_IDLE_SECONDS:
            return
        try:
            alive = engine.dialect.do_ping(dbapi_conn)  # what pool_pre_ping runs (autocommit SELECT 1)
        except Exception as exc:
            raise exc_mod.DisconnectionError() from exc
        if not alive:
            raise exc_mod.DisconnectionError()


def get_engine(url: str | None = None) -> Engine:
    """The process's engine for ``url`` (default: DATABASE_URL)."""
    url = url or get_settings().DATABASE_URL
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            engine = _engines[url] = _make_engine(url)
        return engine


#: Called after :func:`dispose_engines` (models.clock forgets its measurement of the database's
#: time there): modules that keep state derived from an engine register here, so that this
#: module imports none of them.
_on_dispose: list[Callable[[], None]] = []


def on_dispose(hook: Callable[[], None]) -> None:
    """Call ``hook`` after every :func:`dispose_engines`."""
    _on_dispose.append(hook)


def dispose_engines() -> None:
    """Forget pooled connections, e.g. in a forked worker child (never share sockets), and
    whatever was derived from them (the ``on_dispose`` hooks)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose(close=False)
        _engines.clear()
        _factories.clear()
    for hook in _on_dispose:
        hook()


def release_for_fork(*, close: bool) -> None:
    """The pools' connections around a fork, the engines kept: in the parent before it
    (``close=True``: its connections closed) or in the child right after it (``close=False``:
    the inherited sockets forgotten, never used nor closed, as SQLAlchemy advises for
    ``os.fork``). Unlike :func:`dispose_engines`, a forked pool process keeps the engines it
    inherited: their dialect, initialized by the parent's first connect (a few server queries),
    and their compiled-SQL cache. The ``on_dispose`` hooks run as after a dispose."""
    with _lock:
        for engine in _engines.values():
            engine.dispose(close=close)
    for hook in _on_dispose:
        hook()


class CallClock:
    """When the database work a thread has in flight began (``since``, monotonic; 0.0 when it
    has none): a heartbeat renews a lease only while its holder's calls end
    (harness.fence, docs/invariants.md I6). One per thread: loops may run many per process."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since = 0.0

    def in_flight_seconds(self) -> float:
        """How long the work in flight has lasted so far; 0.0 when none is."""
        since = self.since  # one read: the owning thread may end its work meanwhile
        return time.monotonic() - since if since else 0.0


_threads = threading.local()


def call_clock() -> CallClock:
    """This thread's :class:`CallClock`."""
    try:
        return _threads.clock  # type: ignore[no-any-return]
    except AttributeError:
        clock = _threads.clock = CallClock()
        return clock


@contextmanager
def call_in_flight() -> Iterator[None]:
    """Database work of this thread, on its :class:`CallClock` from its start to its end (an
    outer one, if any, keeps its start)."""
    clock = call_clock()
    outer = clock.since
    if not outer:
        clock.since = time.monotonic()
    try:
        yield
    finally:
        clock.since = outer


@contextmanager
def transaction(url: str | None = None) -> Iterator[Session]:
    """One Session, one transaction: commit on success, roll back on any exception. The whole of
    it (the checkout and its ping, every statement, the commit) is database work in flight on
    the thread's :class:`CallClock` (as :func:`call_in_flight`, inlined: this is the hot path)."""
    clock = call_clock()
    outer = clock.since
    if not outer:
        clock.since = time.monotonic()
    try:
        with _sessions(get_engine(url))() as session, session.begin():
            yield session
    finally:
        clock.since = outer


#: Set (True) on a statement :func:`built_once` built that yields plain rows: see ``_Session``.
_PLAIN_ROWS = "_agent_recovery_plain_rows"


class _Session(Session):
    """A Session that runs text, and a statement :func:`built_once` marked as yielding plain rows
    (DML, or a select of columns: no mapped entity in what it returns), on its transaction's
    Connection, after the Session's autoflush (for text the Session itself would not flush:
    flushing earlier in the same transaction changes nothing it commits). The Session's ORM
    execution path (its execute context, the ORM's compile state and bulk-DML handling, none of
    which such a statement uses) cost 0.06-0.09 ms of CPU on one primary-key UPDATE or SELECT,
    and about 0.25 ms a statement over a delegating round's (``bench/profile.py --timed``).
    The rows, the rowcount and the transaction are the same either way; a statement that
    returns mapped objects goes the Session's way."""

    def execute(self, statement: Any, params: Any = None, **kw: Any) -> Any:
        if not kw and (getattr(statement, _PLAIN_ROWS, False) or isinstance(statement, TextClause)):
            if self.autoflush:
                self.flush()  # what Session.execute does first for an ORM statement; nothing if clean
            return self.connection().execute(statement, params)
        return super().execute(statement, params, **kw)


def _yields_plain_rows(stmt: Any) -> bool:
    """Whether ``stmt`` returns through a Connection what it returns through a Session: DML
    without an entity in its RETURNING, a select of columns, or text."""
    if isinstance(stmt, TextClause):
        return True
    try:
        if isinstance(stmt, Select):
            described = stmt.column_descriptions
        elif isinstance(stmt, UpdateBase):
            described = stmt.returning_column_descriptions
        else:
            return False
    except AttributeError:  # e.g. RETURNING a mapped class: SQLAlchemy cannot describe it
        return False
    for column in described:
        found = sa_inspect(column["expr"], raiseerr=False)
        if getattr(found, "is_mapper", False) or getattr(found, "is_aliased_class", False):
            return False
    return True


def _mark_plain(built: Any) -> None:
    for stmt in built if isinstance(built, tuple) else (built,):
        if isinstance(stmt, Executable) and _yields_plain_rows(stmt):
            setattr(stmt, _PLAIN_ROWS, True)


_factories: dict[Engine, sessionmaker[_Session]] = {}


def _sessions(engine: Engine) -> sessionmaker[_Session]:
    factory = _factories.get(engine)
    if factory is None:
        factory = _factories[engine] = sessionmaker(bind=engine, class_=_Session, expire_on_commit=False)
    return factory


def unbegun_session(engine: Engine) -> Session:
    """A Session of the kind :func:`transaction` opens, on ``engine``, with no transaction
    begun: the caller ends it (``models.warmup`` rolls back each of its executions)."""
    return _sessions(engine)()


def dialect_name(url: str | None = None) -> str:
    return get_engine(url).dialect.name


def is_postgresql(s: Session) -> bool:
    return s.get_bind().dialect.name == "postgresql"


def cas(s: Session, stmt: Executable, params: dict[str, Any] | None = None) -> int:
    """Run one conditional UPDATE (a compare-and-set); the rowcount says whether it landed.
    ``params``: the values of a statement built once with bind parameters (``built_once``)."""
    if params is not None:
        result = s.execute(stmt, params)
    else:
        result = s.execute(stmt.execution_options(synchronize_session=False))
    return int(cast("CursorResult[Any]", result).rowcount)


def ids_param() -> Any:
    """``b_ids``: a list of row ids as ONE expanding bind parameter, so a statement built once
    serves any count of ids (``stmt`` run with ``{"b_ids": [...]}``)."""
    return bindparam("b_ids", expanding=True, type_=BigInteger())


def built_once(fn: Callable[..., T]) -> Callable[..., T]:
    """A statement builder whose statements are built ONCE per shape (its arguments: enums,
    tuples, flags, a worker identity) with bind parameters for the values: building a
    SQLAlchemy statement and its cache key costs more than a PostgreSQL round trip on the hot
    path (about 0.3 ms a statement). Statements built here carry
    ``synchronize_session=False`` (they are Core compare-and-sets, never ORM bulk updates), and
    those that yield plain rows run on the transaction's Connection (``_Session``)."""

    @functools.wraps(fn)
    def build(*args: Any) -> T:
        return cached(*args)

    @functools.lru_cache(maxsize=256)
    def cached(*args: Any) -> T:
        built = fn(*args)
        _mark_plain(built)
        _mark_origin(built, fn, args)
        return built

    return build


#: Set on every statement :func:`built_once` built: ``(module, builder name, its arguments, the
#: statement's index when the builder returns a tuple, else None)`` (models.warmup records it).
BUILT_BY = "_agent_recovery_built_by"


def _mark_origin(built: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    many = isinstance(built, tuple)
    for index, stmt in enumerate(built if many else (built,)):
        if isinstance(stmt, Executable):
            setattr(stmt, BUILT_BY, (fn.__module__, fn.__qualname__, args, index if many else None))
