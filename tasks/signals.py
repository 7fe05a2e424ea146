"""Worker signals: fresh DB connections in each pool process; logging set up once."""

from __future__ import annotations

import logging

from celery.signals import setup_logging as setup_logging_signal
from celery.signals import worker_init, worker_process_init, worker_ready

from models.db import dispose_engines

log = logging.getLogger("tasks.signals")


@worker_init.connect
def _boot_generation(sender: object = None, **_: object) -> None:
    """Record a new boot generation for this worker's stable name (WORKER_ID, else the node
    name) before the pool forks: work leased by an older generation is taken back at once by
    the boot scan (models.worker). A database that is down here only costs that speed-up."""
    from models.worker import boot
    from settings import get_settings

    name = get_settings().WORKER_ID or str(getattr(sender, "hostname", "") or "")
    if not name:
        return
    try:
        generation = boot(name)
    except Exception:
        log.warning("event=worker_boot_not_recorded worker=%s", name, exc_info=True)
        return
    finally:
        dispose_engines()  # never hand the main process's sockets to the forked pool
    log.info("event=worker_boot worker=%s generation=%s", name, generation)


@worker_process_init.connect
def _fresh_connections(**_: object) -> None:
    # A forked pool child must never reuse the parent's sockets.
    dispose_engines()


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")


@setup_logging_signal.connect
def _logging(**_: object) -> None:
    # Our own key=value lines (DESIGN §9); Celery then leaves logging alone.
    from settings import get_settings

    setup_logging(get_settings().LOG_LEVEL)


@worker_ready.connect
def _ready(sender: object = None, **_: object) -> None:
    logging.getLogger("tasks.signals").warning("event=worker_ready")
