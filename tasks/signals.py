"""Worker signals: a boot generation per start, a watcher of the worker's name, fresh DB
connections in each pool process; logging set up once."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from celery.signals import setup_logging as setup_logging_signal
from celery.signals import (
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)

from logfmt import log_event
from models import lease, warmup
from models.db import release_for_fork

log = logging.getLogger(__name__)


def _pool_shape(sender: object) -> tuple[int, bool]:
    """``(loops per process, forks)`` of the worker being booted: a prefork pool runs one loop
    in each of its ``-c`` processes; a threads (or gevent, eventlet) pool runs ``-c`` loops in
    this process; solo runs one. Outside a worker (tests calling the handler): one, no fork."""
    from celery.concurrency import get_implementation

    pool_cls = getattr(sender, "pool_cls", None)
    concurrency = int(getattr(sender, "concurrency", 0) or 1)
    if pool_cls is None:
        return 1, False
    module = get_implementation(pool_cls).__module__
    if module.endswith(".prefork"):
        return 1, True
    if module.endswith(".solo"):
        return 1, False
    return concurrency, False


def _size_the_database_pool(sender: object) -> bool:
    """Size this worker's database pool from its concurrency (models.db.size_for_loops) and cap
    it to what PostgreSQL accepts (models.db.fit_to_server); returns whether the pool forks."""
    from models.db import fit_to_server, pool_limits, size_for_loops

    loops, forks = _pool_shape(sender)
    size_for_loops(loops)
    processes = (int(getattr(sender, "concurrency", 1) or 1) + 1) if forks else 1
    try:
        cap = fit_to_server(processes)
    except Exception:  # a database that is down now: the pool keeps its size, the boot goes on
        log_event(log, "db_pool_not_checked", logging.WARNING, exc_info=True)
        cap = None
    size, overflow = pool_limits()
    level = logging.WARNING if cap is not None else logging.INFO
    log_event(log, "db_pool", level, loops=loops, processes=processes, size=size, overflow=overflow, capped=cap)
    return forks


@worker_init.connect
def _boot_generation(sender: object = None, **_: object) -> None:
    """Size the database pool for this worker's pool, then record a new boot generation for
    this worker's stable name (WORKER_ID, else the node name) before the pool forks: work
    leased by an older generation is taken back at once by the boot scan (models.worker). A
    database that is down here only costs that speed-up. A pool that does not fork runs its
    loops in this process: its statement warm-up starts here (a forked one's, in each child)."""
    from models.worker import boot
    from settings import get_settings

    forks = _size_the_database_pool(sender)
    name = get_settings().WORKER_ID or str(getattr(sender, "hostname", "") or "")
    if not name:
        return
    try:
        generation = boot(name)
    except Exception:
        log_event(log, "worker_boot_not_recorded", logging.WARNING, exc_info=True, worker=name)
        return
    finally:
        release_for_fork(close=True)  # never hand the main process's sockets to the forked pool
    log_event(log, "worker_boot", worker=name, generation=generation)
    if not forks:
        _warm_up()


@worker_process_init.connect
def _fresh_connections(**_: object) -> None:
    # A forked pool child must never reuse the parent's sockets (it keeps the engines: their
    # initialized dialect and compiled SQL).
    release_for_fork(close=False)
    _warm_up()


@task_prerun.connect
def _pause_the_warm_up(**_: object) -> None:
    # The process has work: the warm-up waits from its next statement on (models.warmup).
    warmup.quiet.task_began()


@task_postrun.connect
def _resume_the_warm_up(**_: object) -> None:
    warmup.quiet.task_ended()


@task_postrun.connect
def _stop_when_tool_threads_are_stuck(**_: object) -> None:
    # Past TOOL_MAX_STUCK_THREADS the process holds threads it can never get back: the worker
    # stops warmly (its other tasks end first) and its supervisor starts a fresh one
    # (docs/tools.md). A prefork pool process asks its worker's main process.
    from harness.tools.registry import over_stuck_limit

    if not over_stuck_limit():
        return
    from billiard.process import current_process

    main = os.getppid() if current_process().name != "MainProcess" else os.getpid()
    log_event(log, "worker_stopping_for_stuck_tool_threads", logging.ERROR, worker_pid=main)
    os.kill(main, signal.SIGTERM)


def _warm_up() -> None:
    """The hot statements built and compiled, and a first connection opened, in a daemon thread
    in this pool process's idle time (models.warmup). Only in a booted
    worker (a boot identity) on PostgreSQL: on the embedded SQLite default each BEGIN takes
    the database's write lock."""
    from models.db import get_engine
    from models.worker import identity

    if identity() is None:
        return
    engine = get_engine()
    if engine.dialect.name != "postgresql":
        return
    warmup.warm_up_in_background(engine)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")


@setup_logging_signal.connect
def _logging(**_: object) -> None:
    # Our own key=value lines (logfmt); Celery then leaves logging alone.
    from settings import get_settings

    setup_logging(get_settings().LOG_LEVEL)


@worker_ready.connect
def _ready(sender: object = None, **_: object) -> None:
    log_event(log, "worker_ready", logging.WARNING)
    _start_name_watcher(sender)


class NameWatcher:
    """Watches this worker's name in ``worker_boot`` from the worker's MAIN process
    (docs/fault-model.md). When a newer process booted under the same name (a shared ``WORKER_ID``, two
    ``-n worker1@%h`` on one host), this one is the older: it logs ``event=worker_name_conflict``
    at ERROR once, records the conflict at every tick (``agent-recovery status``, the metrics)
    and stops consuming from every queue, so it takes no new message.

    NOTE: it does not exit: under a restarting supervisor an exit would come back as the newest
    generation, and the two processes would supersede each other in turns forever. Its leases
    are safe meanwhile: a superseded process can neither take nor renew one
    (``models.worker.still_current``), so the scan takes each of them back once. Messages
    already prefetched by its pool still run and find their take refused (the scan re-sends
    their work once the reservation lapses)."""

    def __init__(self, consumer: Any, name: str, generation: int, period_seconds: float) -> None:
        from models.base import utcnow

        self.consumer, self.name, self.generation = consumer, name, generation
        self.period_seconds = period_seconds
        self.superseded_by: int | None = None
        self.started_at = utcnow()
        #: The release of this worker's configuration, stored at the first tick that could.
        self.release_id: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-name-watcher", daemon=True)

    def start(self) -> NameWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        _forget_old_presence()
        self.seen()  # alive from the start, not from the first tick
        while not self._stop.wait(self.period_seconds):
            self.tick()

    def tick(self) -> int | None:
        """One check; returns the newer generation when this process is superseded. While it
        is not, the check is also this worker's sign of life (``seen``)."""
        from models.worker import check_name

        try:
            newer = check_name(self.name, self.generation)
        except Exception:  # a DB blip: check again next tick
            log_event(log, "worker_name_check_failed", logging.WARNING, exc_info=True, worker=self.name)
            return None
        if newer is None:
            self.seen()
        if newer is not None and self.superseded_by is None:
            self.superseded_by = newer
            log_event(
                log,
                "worker_name_conflict",
                logging.ERROR,
                worker=self.name,
                generation=self.generation,
                newer_generation=newer,
                hostname=getattr(self.consumer, "hostname", None),
                pid=os.getpid(),
                action="stopped_consuming",
            )
            self._stop_consuming()
        return newer

    def seen(self) -> None:
        """Record that this worker is alive (``worker_presence``), with the release of its
        configuration; a failure is logged and the next tick tries again."""
        import socket

        from models.db import transaction
        from models.presence import record_seen

        try:
            with transaction() as s:
                if self.release_id is None:
                    self.release_id = _release_id(s)
                record_seen(
                    s,
                    name=self.name,
                    hostname=socket.gethostname(),
                    pid=os.getpid(),
                    started_at=self.started_at,
                    release_id=self.release_id,
                )
        except Exception:
            self.release_id = None  # it may have been stored in the transaction rolled back
            log_event(log, "worker_presence_not_recorded", logging.WARNING, exc_info=True, worker=self.name)

    def _stop_consuming(self) -> None:
        consumer = self.consumer
        if consumer is None or not hasattr(consumer, "call_soon"):
            return
        # The consumer's event loop owns its channels: cancel from there, not from this thread.
        consumer.call_soon(_cancel_all_queues, consumer)


def _forget_old_presence() -> None:
    """Names not seen for days leave ``worker_presence`` (models.presence), once per start."""
    from models.db import transaction
    from models.presence import forget_old

    try:
        with transaction() as s:
            forget_old(s)
    except Exception:
        log_event(log, "worker_presence_not_pruned", logging.WARNING, exc_info=True)


def _release_id(s: Any) -> int | None:
    """The release of this worker's configuration (harness.release), None when it cannot be
    made (no agents file read: a worker of field recovery only)."""
    from harness.release import current_release_id

    try:
        with s.begin_nested():
            return current_release_id(s)
    except Exception:
        log_event(log, "worker_release_unknown", logging.INFO, exc_info=True)
        return None


def _cancel_all_queues(consumer: Any) -> None:
    queues = consumer.app.amqp.queues
    names = list(queues.consume_from or {})
    for name in names:
        queues.deselect(name)  # a reconnect must not consume it again
        if consumer.task_consumer is not None:
            consumer.task_consumer.cancel_by_queue(name)
    log_event(log, "worker_stopped_consuming", logging.ERROR, queues=names)


#: The running watcher of this process (tests read it).
watcher: NameWatcher | None = None


def _start_name_watcher(consumer: object) -> None:
    global watcher
    from models.worker import identity

    booted = identity()
    if booted is None:
        return
    period = lease.renewal_seconds()
    watcher = NameWatcher(consumer, booted[0], booted[1], period).start()


@worker_process_shutdown.connect
@worker_shutdown.connect
def _close_mcp_sessions(**_: object) -> None:
    # Each process closes the MCP sessions it kept (docs/mcp.md): a stdio server gets its stdin
    # closed, then SIGTERM, then SIGKILL. A process that dies without this still takes its
    # servers with it (the parent-death signal).
    from harness.tools.mcp import close_sessions

    close_sessions()
