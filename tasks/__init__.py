"""The Celery app (`celery -A tasks worker`). Tasks are thin adapters over the domain."""

from __future__ import annotations

from celery import Celery

import celeryconfig

app = Celery("agent_recovery")
app.conf.update(celeryconfig.build())

import tasks.queues  # noqa: E402,F401  (every publisher stamps sent_at: `status` shows queue waits)

__all__ = ["app"]
