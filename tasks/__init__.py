"""The Celery app (`celery -A tasks worker`). Tasks are thin adapters over the domain."""

from __future__ import annotations

from celery import Celery

import celeryconfig

app = Celery("agent_recovery")
app.conf.update(celeryconfig.build())

import tasks.queues  # noqa: E402,F401  (every publisher stamps sent_at: `status` shows queue waits)


def _load_tools() -> None:
    """TOOL_MODULES and entry points imported, every agent's tools checked, before the worker
    (or beat, or the CLI) takes anything: a configuration error stops the process here."""
    import sys

    from harness.agents import load_at_start
    from harness.errors import AgentConfigError

    try:
        load_at_start()
    except AgentConfigError as exc:
        print(f"agent-recovery: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


_load_tools()

__all__ = ["app"]
