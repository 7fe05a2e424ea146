"""The Celery app (`celery -A tasks worker`). Tasks are thin adapters over the domain."""

from __future__ import annotations

from celery import Celery

import celeryconfig

app = Celery("agent_recovery")
app.conf.update(celeryconfig.build())

__all__ = ["app"]
