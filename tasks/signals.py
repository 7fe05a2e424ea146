"""Worker signals: fresh DB connections in each pool process; logging set up once."""

from __future__ import annotations

import logging

from celery.signals import setup_logging as setup_logging_signal
from celery.signals import worker_process_init, worker_ready

from models.db import dispose_engines


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
